"""Softmax attention baseline: an explicit softmax reference, cached decoding against the full
forward for every ``positions`` option, packed rows with positions counted per document, ragged
(left-padded) caches, and a state that grows linearly with T; sliding-window attention against the
written-out band mask, its decoding cache never above W - 1 tokens."""

import math

import pytest
import test_packed_mixers as contract
import torch

from lcsm import layers
from lcsm.layers.attention import rotate
from lcsm.testing import assert_close, assert_matches_reference, decode, gradients

D_MODEL = 16
POSITIONS = [
    {"positions": "none"},
    {"positions": "learned", "max_len": 32},
    {"positions": "rotary"},
    {"positions": "rotary", "heads": 4, "bias": False},
]
# Sliding windows shorter than the sequences (and than the documents of the packed tests).
WINDOWED = [
    {"window": 4},
    {"window": 1},
    {"positions": "learned", "max_len": 128, "window": 3},
    {"positions": "rotary", "heads": 4, "window": 5},
]
# W = 1 keeps an empty cache, which the contract's gradient check cannot reach.
WINDOWED_PACKED = [o for o in WINDOWED if o["window"] > 1]


def make(**options):
    torch.manual_seed(0)
    return layers.build("attention", D_MODEL, **options).double()


def inputs(B=2, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64)


def reference(m, x):
    """Causal softmax attention written out: scores, mask, softmax; RoPE as a complex rotation of
    the pairs (x_i, x_{i + D/2}) by t * 10000^(-2i/D)."""
    B, T, d = x.shape
    H, D = m.heads, m.head_dim
    if m.positions == "learned":
        x = x + m.position_embedding[:T]
    q, k, v = (lin(x).view(B, T, H, D) for lin in (m.q_proj, m.k_proj, m.v_proj))
    if m.positions == "rotary":
        freq = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
        turn = torch.polar(torch.ones(T, D // 2, dtype=torch.float64), torch.arange(T).double()[:, None] * freq)

        def rot(z):
            c = torch.complex(z[..., : D // 2], z[..., D // 2 :]) * turn[:, None]
            return torch.cat([c.real, c.imag], -1)

        q, k = rot(q), rot(k)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if m.window is not None:  # query t sees keys t - W + 1 .. t
        allowed &= ~torch.ones(T, T, dtype=torch.bool).tril(-m.window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, d)
    return m.o_proj(o)


def case_id(o):
    return ",".join(f"{k}={v}" for k, v in o.items())


@pytest.mark.parametrize("positions", ["none", "learned"])
def test_windows_that_divide_the_length_with_several_heads(positions):
    """T a multiple of the window, 2 heads, a batch of 2, no rotation: the queries reach the
    blocked form as a transposed view, which padding by nothing leaves strided (it failed there)."""
    # (no bias: without rotation a key bias's gradient is zero, rounding noise on both sides)
    m = make(heads=2, window=4, positions=positions, bias=False, **({"max_len": 64} if positions == "learned" else {}))
    x = inputs(B=2, T=12)
    assert_matches_reference(m, x, lambda x: reference(m, x), context=positions)


@pytest.mark.parametrize("options", POSITIONS + WINDOWED, ids=case_id)
def test_forward_equals_explicit_softmax(options):
    m, x = make(**options), inputs()
    if m.positions != "rotary" and m.k_proj.bias is not None:
        # Without rotation a key bias b adds q_t . b to every score of row t, which the softmax
        # ignores: its gradient is zero, rounding noise on both sides (and checked to be so).
        y = m(x)
        (db,) = torch.autograd.grad(y, m.k_proj.bias, torch.randn_like(y))
        assert db.norm() < 1e-12 * m.k_proj.weight.norm() * x.norm(), db.norm()
        m.k_proj.bias.requires_grad_(False)
    assert_matches_reference(m, x, lambda x: reference(m, x), context=case_id(options))


@pytest.mark.parametrize("options", POSITIONS + WINDOWED, ids=case_id)
def test_cached_decoding_equals_full_forward(options):
    m, x = make(**options), inputs(T=13)
    y = m(x)
    y_steps, state = decode(m, x)
    if m.window is not None:
        assert state.keys.shape[2] == m.window - 1, state.keys.shape
    # Prefill of 5 tokens, then chunks of 3 and 5 against the cache (the offset causal mask).
    y1, s = m(x[:, :5], return_state=True)
    y2, s = m(x[:, 5:8], state=s, return_state=True)
    y3, s = m(x[:, 8:], state=s, return_state=True)
    assert_close(
        {"steps": y_steps, "chunks": torch.cat([y1, y2, y3], 1)}, {"steps": y, "chunks": y}, context=case_id(options)
    )
    assert_close({"keys": s.keys, "values": s.values}, {"keys": state.keys, "values": state.values})
    assert s.position.tolist() == [13, 13]


# The contract test runs the defaults (no positions); these put positions inside the mixer.
PACKED = [
    {"positions": "learned", "max_len": 128},
    {"positions": "rotary"},
    {"positions": "rotary", "heads": 4, "bias": False},
]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("bounds", list(contract.BOUNDS))
@pytest.mark.parametrize("options", PACKED + WINDOWED_PACKED, ids=case_id)
def test_packed_equals_each_document_alone(options, bounds, with_state, monkeypatch):
    """The contract's check (tests/layers/test_packed_mixers.py) on a mixer with positions: the
    learned table index and the RoPE angle count from each document's start (after its initial
    cache), so a document packed anywhere in the row equals it run alone."""
    monkeypatch.setattr(contract, "make", lambda *_: make(**options))
    contract.test_packed_equals_each_document_alone(("attention", {}), bounds, with_state)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("options", PACKED + WINDOWED_PACKED, ids=case_id)
def test_padding_is_as_if_absent(options, side, monkeypatch):
    monkeypatch.setattr(contract, "make", lambda *_: make(**options))
    contract.test_padding_is_as_if_absent(("attention", {}), side)


@torch.no_grad()
@pytest.mark.parametrize("options", POSITIONS, ids=case_id)
def test_ragged_cache_decodes_each_row_as_its_own(options):
    """A packed call's final state is left-padded (zeros, masked out); the whole ragged batch then
    decodes step by step, in place, each row as its document continued alone, and a chunk of
    several tokens after the steps does too (the shifted causal mask with padding)."""
    m = make(**options)
    cu = [0, 5, 6, 14]
    x = inputs(B=1, T=14, seed=2)
    init = m(inputs(B=3, T=2, seed=3), return_state=True)[1]
    _, state = m(x, state=init, return_state=True, cu_seqlens=torch.tensor(cu))
    assert state.position.tolist() == [7, 3, 10] and state.keys.shape[2] == 10
    pad = torch.arange(10) < torch.tensor([3, 7, 0])[:, None]
    assert (state.valid() == ~pad).all()
    assert not state.keys.transpose(1, 2)[pad].any() and not state.values.transpose(1, 2)[pad].any()
    more = inputs(B=3, T=6, seed=4)
    ys, storages = [], set()
    for t in range(3):
        y_t, state = m.step(more[:, t], state)
        ys.append(y_t[:, None])
        storages.add(state.keys.untyped_storage().data_ptr())
    ys.append(m(more[:, 3:], state=state))
    assert len(storages) == 1  # the appends after the first wrote into one buffer
    for n in range(3):
        _, own = m(x[:, cu[n] : cu[n + 1]], state=init.map(lambda t, n=n: t[n : n + 1]), return_state=True)
        assert_close({"y": torch.cat(ys, 1)[n : n + 1]}, {"y": m(more[n : n + 1], state=own)}, context=f"row {n}")


@pytest.mark.parametrize("options", POSITIONS + WINDOWED, ids=case_id)
def test_packed_calls_chain_through_a_ragged_cache(options):
    """A packed call's ragged final state is the initial state of the next packed call: each
    document's two pieces equal its whole text run alone (outputs, the gradient of x)."""
    m = make(**options)
    first, second = [0, 5, 6, 14], [0, 3, 10, 11]
    x1 = inputs(B=1, T=14, seed=5).requires_grad_()
    x2 = inputs(B=1, T=11, seed=6)
    y1, s = m(x1, return_state=True, cu_seqlens=torch.tensor(first))
    y2, s = m(x2, state=s, return_state=True, cu_seqlens=torch.tensor(second))
    assert s.position.tolist() == [8, 8, 9]
    ys_ref = [m(torch.cat([x1[:, first[n] : first[n + 1]], x2[:, second[n] : second[n + 1]]], 1)) for n in range(3)]
    y_ref = torch.cat([r[:, : first[n + 1] - first[n]] for n, r in enumerate(ys_ref)], 1)
    y2_ref = torch.cat([r[:, first[n + 1] - first[n] :] for n, r in enumerate(ys_ref)], 1)
    assert_close(gradients({"y1": y1, "y2": y2}, {"x1": x1}), gradients({"y1": y_ref, "y2": y2_ref}, {"x1": x1}))


def test_learned_positions_count_per_document():
    """A packed row longer than the learned table is fine while each document fits in it."""
    m = make(positions="learned", max_len=8)
    m(inputs(B=1, T=14), cu_seqlens=torch.tensor([0, 8, 14]))
    with pytest.raises(ValueError, match=r"^x: positions up to 8 exceed the learned table \(max_len=8\)"):
        m(inputs(B=1, T=14), cu_seqlens=torch.tensor([0, 5, 14]))


@torch.no_grad()
def test_cache_appends_in_place_and_branches_copy():
    """Appends write into the cache's buffer (the keys of every step share one storage until it
    fills), two appends to one state give two independent branches (the second copies), and a
    state moved by map (here a batch subset) starts a buffer of its own: every branch decodes as
    the full forward over its own tokens."""
    m, x = make(positions="rotary"), inputs(T=9)
    y_full = m(x)
    _, s = m(x[:, :4], return_state=True)
    states = [s]
    for t in range(4, 8):
        states.append(m(x[:, t : t + 1], state=states[-1], return_state=True)[1])
    assert len({st.keys.untyped_storage().data_ptr() for st in states}) == 1
    other = torch.randn_like(x[:, 8:9])
    y_a, s_a = m(x[:, 8:9], state=states[-1], return_state=True)
    y_b, s_b = m(other, state=states[-1], return_state=True)  # the same state again
    y_a2 = m(x[:, 8:9], state=states[-1])
    assert s_b.keys.untyped_storage().data_ptr() != s_a.keys.untyped_storage().data_ptr()
    assert_close({"a": y_a, "again": y_a2}, {"a": y_full[:, 8:9], "again": y_full[:, 8:9]})
    assert_close({"b": y_b}, {"b": m(torch.cat([x[:, :8], other], 1))[:, 8:9]})
    assert_close({"a keys": s_a.keys}, {"a keys": m(x, return_state=True)[1].keys})
    first = states[-1].map(lambda t: t[:1])
    assert first.buffer is None
    y_first, _ = m(x[:1, 8:9], state=first, return_state=True)
    assert_close({"first": y_first}, {"first": y_full[:1, 8:9]})


def test_cached_decoding_backpropagates():
    """With gradients on, appends concatenate (an in-place write would change keys saved for the
    backward): gradients through two cached calls equal those of the full forward."""
    m, x = make(), inputs(T=7).requires_grad_()
    g = torch.randn(2, 7, D_MODEL, dtype=x.dtype)
    (dx_full,) = torch.autograd.grad(m(x), x, g)
    y1, s = m(x[:, :4], return_state=True)
    y2, _ = m(x[:, 4:], state=s, return_state=True)
    (dx_cached,) = torch.autograd.grad(torch.cat([y1, y2], 1), x, g)
    assert_close({"dx": dx_cached}, {"dx": dx_full})


def test_rotary_scores_depend_on_relative_position_only():
    """RoPE: shifting every position by the same offset leaves q . k unchanged."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    s0 = rotate(q, torch.arange(6)) @ rotate(k, torch.arange(6)).transpose(-1, -2)
    s7 = rotate(q, torch.arange(7, 13)) @ rotate(k, torch.arange(7, 13)).transpose(-1, -2)
    assert_close({"scores": s7}, {"scores": s0})
    assert (s0 - q @ k.transpose(-1, -2)).abs().max() > 1e-3  # the rotation does act


def test_state_grows_linearly():
    m = make()
    sizes = []
    for T in (1, 2, 5, 9):
        _, state = m(inputs(T=T), return_state=True)
        assert state.numel_per_sequence() == m.state_size(T) == 2 * T * D_MODEL + 1
        assert state.keys.shape == (2, m.heads, T, m.head_dim)
        sizes.append(m.state_size(T))
    assert m.state_size(0) == m.init_state(3).numel_per_sequence() == 1
    # Constant increment per token: 2 d_model scalars (one key and one value).
    assert all(
        (b - a) == 2 * D_MODEL * (t1 - t0)
        for (a, t0), (b, t1) in zip(
            zip(sizes, (1, 2, 5), strict=False), zip(sizes[1:], (2, 5, 9), strict=False), strict=False
        )
    )


def test_learned_positions_need_and_respect_max_len():
    with pytest.raises(ValueError, match="^max_len: positions='learned' needs"):
        layers.build("attention", D_MODEL, positions="learned")
    with pytest.raises(ValueError, match="^max_len: only used with positions='learned'"):
        layers.build("attention", D_MODEL, max_len=8)
    m = make(positions="learned", max_len=8)
    _, s = m(inputs(T=6), return_state=True)
    with pytest.raises(ValueError, match=r"^x: positions up to 8 exceed the learned table \(max_len=8\)"):
        m(inputs(T=3), state=s)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"heads": 3}, "^heads:"),
        ({"positions": "alibi"}, "^positions:"),
        ({"positions": "rotary", "heads": 16}, "^positions: 'rotary' needs an even head width"),
        ({"bias": 0}, "^bias:"),
    ],
)
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        layers.build("attention", D_MODEL, **options)


def test_cache_position_mismatch_is_a_clear_error():
    m = make()
    _, s = m(inputs(T=4), return_state=True)
    s.position[0] += 1
    with pytest.raises(ValueError, match=r"^state: position \[5, 4\] does not match the cache length 4"):
        m(inputs(T=2), state=s)
    s.position[0] = -1
    with pytest.raises(ValueError, match=r"^state: position \[-1, 4\] does not match the cache length 4"):
        m(inputs(T=2), state=s)
    with pytest.raises(
        ValueError, match=r"^state: keys expected \[B, H, P, D\] = \[3, 1, 4, 16\], got \[2, 1, 4, 16\]"
    ):
        m(inputs(B=3, T=2), state=s.map(lambda t: t))


@torch.no_grad()
@pytest.mark.parametrize("options", WINDOWED, ids=case_id)
def test_windowed_cache_stays_within_the_window(options):
    """Step by step, a windowed cache never holds more than W - 1 tokens; a ragged packed state
    (documents shorter and longer than the window) decodes each row as its document alone."""
    m = make(**options)
    x = inputs(B=2, T=12, seed=7)
    state = m.init_state(2)
    for t in range(12):
        _, state = m.step(x[:, t], state)
        assert state.keys.shape[2] == min(t + 1, m.window - 1)
        assert state.position.tolist() == [t + 1, t + 1]
    assert m.state_size(1000) == 2 * (m.window - 1) * D_MODEL + 1
    cu = [0, 2, 9, 10]
    xp = inputs(B=1, T=10, seed=8)
    _, packed = m(xp, return_state=True, cu_seqlens=torch.tensor(cu))
    assert packed.keys.shape[2] <= m.window - 1 and packed.position.tolist() == [2, 7, 1]
    more = inputs(B=3, T=4, seed=9)
    y = m(more, state=packed)
    for n in range(3):
        _, own = m(xp[:, cu[n] : cu[n + 1]], return_state=True)
        assert_close({"y": y[n : n + 1]}, {"y": m(more[n : n + 1], state=own)}, context=f"row {n}")


@pytest.mark.parametrize("positions", [{"positions": "none"}, {"positions": "rotary"}], ids=case_id)
def test_window_at_least_the_sequence_is_full_attention(positions):
    x = inputs(T=9)
    full = make(**positions)
    for window in (9, 50):
        assert_close({"y": make(window=window, **positions)(x)}, {"y": full(x)}, context=f"window {window}")


@pytest.mark.parametrize("window", [0, -2, 2.5, True, "4"])
def test_bad_window_is_a_clear_error(window):
    with pytest.raises(ValueError, match="window: expected an integer >= 1"):
        layers.build("attention", D_MODEL, window=window)


def test_windowed_cache_longer_than_the_window_is_a_clear_error():
    m = make(window=3)
    too_long = make()(inputs(T=5), return_state=True)[1]
    with pytest.raises(ValueError, match="a window of 3 keeps at most 2 cached tokens, got a cache of 5"):
        m(inputs(T=1), state=too_long)


@pytest.mark.parametrize("T", [3, 4, 5, 8, 12, 13])
def test_windowed_blocks_equal_the_band_at_every_length(T):
    """The O(T W) blocked forward (blocks of W queries against two blocks of keys) against the
    written-out band, at lengths below, at and between multiples of W = 4 (values and gradients)."""
    m, x = make(window=4, positions="rotary"), inputs(T=T)
    assert_matches_reference(m, x, lambda x: reference(m, x), context=f"T={T}")
