"""Packed sequences and padding, for every registered mixer: a packed row of N documents equals
each document run alone (outputs, final states, every gradient; float64), and padding is as if
absent. Adding a mixer to the registry (or an option set to its ``option_variants``) covers it here."""

import pytest
import torch

from lcsm import layers
from lcsm.testing import assert_close, case_id, gradients, mixer_cases

D_MODEL = 16
NAMES = layers.available()
CASES = mixer_cases()
# (T, boundaries): length-1 documents at the start, the middle and the end; at 150 tokens documents
# straddle the operators' default chunk (64) and one spans more than one chunk.
BOUNDS = {
    "short": [0, 1, 6, 7, 16, 22, 23],
    "long": [0, 70, 71, 121, 150],
}


def make(name, options=None):
    torch.manual_seed(0)
    return layers.build(name, D_MODEL, **(options or {})).double()


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def leaf_state(state):
    """The state's floating tensors as leaves that take gradients (integer ones, positions, stay)."""
    return state.map(lambda t: t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else t)


def row(state, n):
    return None if state is None else state.map(lambda t: t[n : n + 1])


def stacked(states):
    """The per-document states as one batch (None where their shapes differ: a KV cache)."""
    out = {}
    for key in states[0].tensors():
        parts = [s.tensors()[key] for s in states]
        if any(p.shape != parts[0].shape for p in parts):
            return None
        out[key] = torch.cat(parts)
    return out


def initial_states(mixer, N, seed):
    """Realistic per-document initial states: the mixer's own state after 3 random tokens."""
    with torch.no_grad():
        _, state = mixer(randn(N, 3, D_MODEL, seed=seed), return_state=True)
    return leaf_state(state)


def continuation_matches(mixer, packed_final, reference_finals, name):
    """Each document's final state carries on the same: 4 more tokens from the packed final state
    equal 4 more tokens from the document's own."""
    with torch.no_grad():
        for n, ref in enumerate(reference_finals):
            more = randn(1, 4, D_MODEL, seed=100 + n)
            assert_close(
                {"y_next": mixer(more, state=row(packed_final, n))},
                {"y_next": mixer(more, state=ref)},
                context=f"{name} document {n}",
            )


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("bounds", list(BOUNDS), ids=list(BOUNDS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_packed_equals_each_document_alone(case, bounds, with_state):
    name = case_id(case)
    mixer = make(*case)
    cu_list = BOUNDS[bounds]
    T, N = cu_list[-1], len(cu_list) - 1
    cu = torch.tensor(cu_list)
    x = randn(1, T, D_MODEL, seed=1).requires_grad_()
    init = initial_states(mixer, N, seed=2) if with_state else None

    y, final = mixer(x, state=init, return_state=True, cu_seqlens=cu)
    ys, finals = [], []
    for n in range(N):
        y_n, f_n = mixer(x[:, cu_list[n] : cu_list[n + 1]], state=row(init, n), return_state=True)
        ys.append(y_n)
        finals.append(f_n)
    y_ref = torch.cat(ys, 1)

    ctx = f"{name} {bounds} {'initial state' if with_state else 'zero state'}"
    assert_close({"y": y}, {"y": y_ref}, context=ctx)
    ref_states = stacked(finals)
    if ref_states is not None:
        assert_close(final.tensors(), ref_states, dtype=torch.float64, context=ctx)
    continuation_matches(mixer, final, finals, ctx)

    wrt = {"x": x, **dict(mixer.named_parameters())}
    if init is not None:
        wrt.update({f"state.{k}": v for k, v in init.tensors().items() if v.requires_grad})
    outs = {"y": y}
    outs_ref = {"y": y_ref}
    if ref_states is not None:
        outs.update({f"final.{k}": v for k, v in final.tensors().items() if v.requires_grad})
        outs_ref.update({k: ref_states[k.removeprefix("final.")] for k in outs if k.startswith("final.")})
    assert_gradients_close(gradients(outs, wrt), gradients(outs_ref, wrt), context=ctx + " gradients")


def assert_gradients_close(grads, grads_ref, context):
    """``assert_close`` in float64, except for a gradient that is zero in exact arithmetic (softmax
    attention's key bias without rotation adds the same q_t . b to every score of query t, which the
    softmax ignores): rounding noise on both sides, which no relative tolerance compares. Such an
    entry (below 1e-12 of the largest reference entry) must be as small on the packed side and is
    left out of the relative comparison."""
    floor = 1e-12 * max(g.norm() for g in grads_ref.values() if g is not None)
    for k in [k for k, g in grads_ref.items() if g is not None and g.norm() <= floor]:
        got = grads.pop(k)
        grads_ref.pop(k)
        assert got is not None and got.norm() <= floor, f"{context}: {k} is {got} where the reference is zero"
    assert_close(grads, grads_ref, dtype=torch.float64, context=context)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_padding_is_as_if_absent(case, side):
    """``forward_masked``: pad tokens (random values, not zeros) change no output at a token, no
    final state, and their own outputs are zero."""
    name = case_id(case)
    mixer = make(*case)
    lengths, T = [9, 4, 1], 9
    B = len(lengths)
    x = randn(B, T, D_MODEL, seed=3)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, L in enumerate(lengths):
        if side == "left":
            mask[b, T - L :] = True
        else:
            mask[b, :L] = True
    init = initial_states(mixer, B, seed=4)
    with torch.no_grad():
        y, final = mixer.forward_masked(x, mask, state=init, return_state=True)
        finals = []
        for b in range(B):
            y_b, f_b = mixer(x[b : b + 1, mask[b]], state=row(init, b), return_state=True)
            finals.append(f_b)
            assert_close({"y": y[b : b + 1, mask[b]]}, {"y": y_b}, context=f"{name} {side} row {b}")
        assert not y[~mask].any(), f"{name}: outputs at padding are not zero"
    ref_states = stacked(finals)
    if ref_states is not None:
        assert_close(final.tensors(), ref_states, dtype=torch.float64, context=f"{name} {side} padding")
    continuation_matches(mixer, final, finals, f"{name} {side} padding")


@pytest.mark.parametrize(
    "cu,shape,match",
    [
        ([0, 3, 3, 7], (1, 7), "strictly increasing"),
        ([1, 3, 7], (1, 7), r"cu_seqlens\[0\] = 0"),
        ([0, 3, 6], (1, 7), "cu_seqlens\\[-1\\] = T = 7"),
        ([0, 3, 7], (2, 7), "batch B = 1"),
    ],
    ids=["not-increasing", "not-from-0", "not-to-T", "batch-2"],
)
@pytest.mark.parametrize("name", NAMES)
def test_bad_cu_seqlens_is_a_clear_error(name, cu, shape, match):
    mixer = make(name)
    x = randn(*shape, D_MODEL, seed=5)
    with pytest.raises(ValueError, match=match):
        mixer(x, cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("name", NAMES)
def test_cu_seqlens_of_floats_is_a_clear_error(name):
    with pytest.raises(ValueError, match="cu_seqlens: expected a torch.int64 or torch.int32 tensor"):
        make(name)(randn(1, 7, D_MODEL, seed=6), cu_seqlens=torch.tensor([0.0, 3.0, 7.0]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_initial_state_of_the_wrong_batch_is_a_clear_error(case):
    """With cu_seqlens the state holds one row per document; a state of another batch is refused."""
    mixer = make(*case)
    with pytest.raises(ValueError, match="state|memory|conv|shift|keys"):
        mixer(randn(1, 7, D_MODEL, seed=7), state=mixer.init_state(2), cu_seqlens=torch.tensor([0, 3, 5, 7]))


# The operators' packed entries and the position of their output_final_state argument: with
# cu_seqlens the documents' final states are a pass of their own (closed forms over the documents)
PACKED_ENTRIES = [
    ("lcsm.ops.eos", "_eos_packed", 6),
    ("lcsm.ops.dplr", "_packed", 7),
    ("lcsm.ops.delta", "_delta_packed", 8),
]


@pytest.mark.parametrize("name", NAMES)
def test_final_states_are_computed_only_when_asked(name, monkeypatch):
    """A packed forward without ``return_state`` (training) asks no operator for the documents'
    final states; with it, every operator it calls is asked."""
    import importlib

    asked = []
    for module, fn, index in PACKED_ENTRIES:
        mod = importlib.import_module(module)
        original = getattr(mod, fn)

        def spy(*args, _original=original, _index=index, **kwargs):
            asked.append(args[_index])
            return _original(*args, **kwargs)

        monkeypatch.setattr(mod, fn, spy)
    mixer = make(name)
    x, cu = randn(1, 23, D_MODEL, seed=0), torch.tensor(BOUNDS["short"])
    mixer(x, cu_seqlens=cu)
    assert not any(asked), f"{name}: final states computed for a forward without return_state: {asked}"
    asked.clear()
    mixer(x, cu_seqlens=cu, return_state=True)
    assert all(asked), f"{name}: final states not asked for with return_state: {asked}"
