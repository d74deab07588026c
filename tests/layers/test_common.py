"""Contract tests run for every registered mixer, with its defaults and with each of its
``option_variants``: adding a mixer to the registry covers it here."""

import copy
import inspect
from pathlib import Path

import pytest
import torch

from lcsm import layers
from lcsm.layers import EOSRow, State
from lcsm.layers.base import _cu_seqlens_position
from lcsm.testing import assert_close, case_id, decode, mixer_cases

D_MODEL = 16
NAMES = layers.available()
CASES = mixer_cases()


def make(name, options=None):
    torch.manual_seed(0)
    return layers.build(name, D_MODEL, **(options or {})).double()


def inputs(B=2, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name", NAMES)
def test_each_mixer_lives_in_the_file_named_by_its_registry_name(name):
    """One mixer, one file: ``lcsm/layers/<name>.py`` (shared bodies go in private ``_*.py``)."""
    source = Path(inspect.getsourcefile(layers.resolve(name)[0]))
    assert (source.parent.name, source.name) == ("layers", f"{name}.py")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_step_loop_equals_forward(case):
    name = case_id(case)
    mixer, x = make(*case), inputs()
    y, final = mixer(x, return_state=True)
    y_steps, state = decode(mixer, x)
    assert_close({"y": y_steps, **state.tensors()}, {"y": y, **final.tensors()}, context=name)


@pytest.mark.parametrize("T,cut", [(13, 6), (150, 67)])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_carried_state_equals_one_pass(case, T, cut):
    """At 150 tokens, cut at 67, both calls span more than one of the operator's default chunks
    (64) and neither starts or ends on a chunk boundary."""
    name = case_id(case)
    mixer, x = make(*case), inputs(T=T)
    y, final = mixer(x, return_state=True)
    y1, s1 = mixer(x[:, :cut], return_state=True)
    y2, s2 = mixer(x[:, cut:], state=s1, return_state=True)
    assert_close({"y": torch.cat([y1, y2], 1)}, {"y": y}, context=name)
    assert_close(s2.tensors(), final.tensors(), dtype=torch.float64, context=name)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_causal(case):
    name = case_id(case)
    mixer, x = make(*case), inputs()
    x2 = x.clone()
    x2[:, 6:] = torch.randn_like(x2[:, 6:])
    assert_close({"y_prefix": mixer(x2)[:, :6]}, {"y_prefix": mixer(x)[:, :6]}, context=name)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_parameter_gets_gradient(case):
    name = case_id(case)
    mixer, x = make(*case), inputs()
    y = mixer(x)
    (y * torch.randn_like(y)).sum().backward()
    dead = [
        n
        for n, p in mixer.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or not (p.grad != 0).any()
    ]
    assert not dead, f"{name}: parameters with missing, non-finite or all-zero gradient: {dead}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_describe_complete(case):
    name = case_id(case)
    row = make(*case).describe()
    assert isinstance(row, EOSRow)
    for field, value in row.as_dict().items():
        if field.endswith("_dd"):
            assert isinstance(value, bool), (name, field, value)
        else:
            assert isinstance(value, str) and value.strip(), (name, field, value)
    assert row.psi in ("elementwise", "matrix"), row.psi


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_size_counts_state(case):
    name = case_id(case)
    mixer = make(*case)
    for T in (1, 7):
        _, state = mixer(inputs(T=T), return_state=True)
        assert isinstance(state, State)
        assert state.numel_per_sequence() == mixer.state_size(T), name


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_init_state_on_mixer_device_and_dtype(case):
    name = case_id(case)
    mixer = make(*case)
    for key, t in mixer.init_state(3).tensors().items():
        assert t.device == torch.device("cpu")
        assert t.shape[0] == 3, (name, key, t.shape)
        if t.is_floating_point() or t.is_complex():
            real = t.real.dtype if t.is_complex() else t.dtype
            assert real == torch.float64, (name, key, t.dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_parameters_take_the_default_dtype(case):
    """Built under a float64 default, a mixer holds float64 parameters before any .double(), so a
    float64 reference from its raw parameters is exact (some of RWKV-4, HGRN, Mamba and CES were
    float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        mixer = layers.build(case[0], D_MODEL, **case[1])
    finally:
        torch.set_default_dtype(previous)
    wrong = {n: p.dtype for n, p in mixer.named_parameters() if p.dtype != torch.float64}
    assert not wrong, (case_id(case), wrong)


# The bfloat16 tests run the contract cases and these options besides: the complex and real
# variants, and the parameterisations the defaults do not reach.
BFLOAT16_CASES = CASES + [
    ("lcsm", {"code": "1-11-1-0"}),
    ("lcsm", {"param": "ssm"}),
    ("lcsm", {"code": "1-1-1-0"}),
    ("ces", {"field": "real"}),
    ("s4d", {"init": "real"}),
    ("metala", {"use_key": True}),
]


def _bfloat16_case(name, options):
    """A float64 mixer moved off its init (zero-initialised parts such as MetaLA's w_aug and the
    gate biases take values), so that every term of the layer reaches the output."""
    torch.manual_seed(0)
    mixer = layers.build(name, D_MODEL, **options).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def _twin(mixer, round_linear=False):
    """A float64 copy of ``mixer``; with round_linear the parameters of its Linear and Conv1d
    modules rounded to bfloat16 first, as autocast rounds their operands, except the
    float32_parameters, which the layers use outside autocast (TNN's RPE) or add in float32
    (Mamba's Delta bias)."""
    twin = copy.deepcopy(mixer).double()
    if round_linear:
        with torch.no_grad():
            for prefix, module in twin.named_modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
                    for n, p in module.named_parameters(prefix=prefix, recurse=False):
                        if not twin.keeps_float32(n):
                            p.copy_(p.to(torch.bfloat16))
    return twin


@pytest.mark.parametrize("case", BFLOAT16_CASES, ids=case_id)
def test_bfloat16_autocast_matches_float64(case):
    """The engine's ``precision: bf16``: a float32 layer's forward under autocast against the
    float64 layer with the same bfloat16-rounded Linear and Conv1d parameters, and a finite
    gradient from the backward outside autocast. Catches a layer that raises under autocast (S4
    and TNN did) or whose output drifts beyond bfloat16's tolerance; that the operators compute
    in float32 inside is the operator tests' to show (bfloat16 matmuls there stay within this
    tolerance). The input's gradient is not compared: for some layers it is far more sensitive to
    autocast's rounding than the output (at d_model 64, 0.08 off for GLA and 0.17 for LCSM's SSM
    parameterisation without its Delta bias: their norms of the read-out amplify the rounding at
    the few positions whose read-out is nearly constant, docs/zoo.md), so the gradient check is that
    the backward runs to a finite, non-zero gradient."""
    mixer = _bfloat16_case(*case).float()
    x = inputs(T=40).to(torch.bfloat16).float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(x)
    y_ref = _twin(mixer, round_linear=True)(x.detach().double())
    assert_close({"y": y}, {"y": y_ref}, dtype=torch.bfloat16, context=case_id(case))
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.isfinite(dx).all() and dx.abs().amax() > 0


@pytest.mark.parametrize("case", BFLOAT16_CASES, ids=case_id)
def test_bfloat16_layer_matches_float64(case):
    """A layer cast to bfloat16 against its float64 twin: outputs, final state and the next step's
    output; the state keeps init_state's dtypes (recurrent memories float32 or complex64, as the
    operators return them) and an SSM's system stays float32 (its float32_parameters, each of
    which names a parameter)."""
    name = case_id(case)
    mixer = _bfloat16_case(*case).to(torch.bfloat16)
    twin = _twin(mixer)
    x = inputs(T=40).to(torch.bfloat16)
    y, state = mixer(x[:, :-1], return_state=True)
    y_next, state_next = mixer(x[:, -1:], state=state, return_state=True)
    y_ref, state_ref = twin(x[:, :-1].double(), return_state=True)
    y_next_ref, _ = twin(x[:, -1:].double(), state=state_ref, return_state=True)
    assert y.dtype == y_next.dtype == torch.bfloat16
    init = {k: t.dtype for k, t in mixer.init_state(2).tensors().items()}
    assert (
        {k: t.dtype for k, t in state.tensors().items()}
        == init
        == {k: t.dtype for k, t in state_next.tensors().items()}
    )
    names = [n for n, _ in mixer.named_parameters()]
    kept = {n for n, p in mixer.named_parameters() if p.dtype == torch.float32}
    assert kept == {n for n in names if mixer.keeps_float32(n)}, (kept, mixer.float32_parameters)
    assert all(p.dtype in (torch.bfloat16, torch.float32) for p in mixer.parameters())
    if not case[1]:  # an option may drop a declared parameter (CES without alpha); the defaults do not
        for declared in mixer.float32_parameters:
            assert any(mixer.entry_matches(declared, n) for n in names), declared
    assert_close(
        {"y": y, "y_next": y_next, **state.tensors()},
        {"y": y_ref, "y_next": y_next_ref, **state_ref.tensors()},
        dtype=torch.bfloat16,
        context=name,
    )


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_is_a_clear_error(name):
    with pytest.raises(ValueError, match="Valid options"):
        layers.build(name, D_MODEL, definitely_not_an_option=1)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="Valid names"):
        layers.build("no-such-mixer", D_MODEL)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="^d_model: expected a positive integer, got 0"):
        layers.build("gla", 0)
    with pytest.raises(TypeError, match="^name: expected a mixer name"):
        layers.build(None, D_MODEL)
    with pytest.raises(ValueError, match="^mixer 'gla' takes no ':spec' suffix, got 'gla:1-1-1-0'"):
        layers.build("gla:1-1-1-0", D_MODEL)
    mixer = make("gla")
    with pytest.raises(ValueError, match=rf"^x: expected \[B, T, d_model\] = \[B, T, {D_MODEL}\], got \[2, 11, 8\]"):
        mixer(inputs()[..., :8])
    with pytest.raises(ValueError, match=rf"^x_t: expected \[B, d_model\] = \[B, {D_MODEL}\], got \[2, 1, {D_MODEL}\]"):
        mixer.step(inputs(T=1), mixer.init_state(2))


@pytest.mark.parametrize("name", ["hgrn", "hgrn2", "mamba2", "mingru", "minlstm", "rwkv4"])
def test_chunk_size_option_changes_only_rounding(name):
    """The mixers whose strong decays take a short chunk by default (16): chunk_size is validated,
    and chunks of 64 (the operator's default) give the same outputs and final states in float64."""
    with pytest.raises(ValueError, match="^chunk_size: expected an integer >= 1, got 0"):
        layers.build(name, 16, chunk_size=0)
    x = torch.randn(2, 150, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outs = []
    for chunk_size in (None, 64):
        torch.manual_seed(0)
        mixer = layers.build(name, 16, **({} if chunk_size is None else {"chunk_size": chunk_size})).double()
        y, state = mixer(x, return_state=True)
        outs.append({"y": y, **state.tensors()})
    assert_close(outs[0], outs[1], dtype=torch.float64, context=name)


@pytest.mark.parametrize("name", layers.available())
def test_a_state_of_another_mixer_is_refused_by_type(name):
    """Every mixer refuses a state that is not of its own type (two mixers' states may share field
    names and shapes: the wrong one ran silently in most mixers)."""

    class Foreign(State):
        pass

    mixer = layers.build(name, D_MODEL)
    with pytest.raises(ValueError, match=rf"^state: expected a {type(mixer.init_state(0)).__name__} from this mixer"):
        mixer(inputs(T=5), state=Foreign())


@pytest.mark.parametrize("name", layers.available())
def test_a_state_of_other_rows_is_refused_by_name(name):
    """A state of one row for a batch of two, in forward and in step (S4's step broadcast it over
    the batch silently; other mixers failed inside torch.cat or a kernel, naming its argument),
    and a packed row's state of another number of documents."""
    mixer = make(name)
    x = inputs(B=2, T=5)
    _, one = mixer(x[:1], return_state=True)
    for call in (lambda: mixer(x, state=one), lambda: mixer.step(x[:, 0], one)):
        with pytest.raises(ValueError, match=r"^state[.:]"):
            call()
    with pytest.raises(ValueError, match=r"^state[.:]"):
        mixer(x[:1], state=mixer.init_state(3), cu_seqlens=torch.tensor([0, 2, 5]))
    if name != "attention":  # (its cache is checked with its positions, in forward)
        state = mixer.init_state(2)
        field = next(iter(state.tensors()))
        setattr(state, field, None)
        with pytest.raises(ValueError, match=rf"^state.{field}: expected a tensor"):
            mixer(x, state=state)


def test_cu_seqlens_is_found_at_its_place_in_forward():
    """(CES takes lengths before it: a positional lengths was read as cu_seqlens)"""
    assert _cu_seqlens_position(layers.resolve("gla")[0]) == 2
    assert _cu_seqlens_position(layers.resolve("ces")[0]) == 3


@pytest.mark.parametrize("name", layers.available())
def test_token_ids_complex_inputs_and_other_precisions_are_refused_by_name(name):
    """(other precisions failed in a matmul, or promoted and returned another dtype: RWKV)"""
    mixer = make(name)
    for x in (torch.zeros(2, 5, D_MODEL, dtype=torch.long), inputs(T=5).to(torch.complex128)):
        with pytest.raises(ValueError, match=r"^x: expected a real floating-point tensor"):
            mixer(x)
    with pytest.raises(ValueError, match=r"^x: expected the layer's dtype torch.float64 .*, got torch.float32"):
        mixer(inputs(T=5).float())


@pytest.mark.parametrize("name", layers.available())
def test_no_tokens_give_no_output_and_leave_the_state(name):
    """T = 0 (several forms cannot reshape or convolve an empty sequence: six mixers raised from
    inside): an empty output, the given state returned as it is, or the initial state."""
    mixer = make(name)
    x = inputs(T=5)[:, :0]
    assert mixer(x).shape == x.shape
    state = mixer.init_state(x.shape[0])
    y, same = mixer(x, state=state, return_state=True)
    assert y.shape == x.shape and same is state
    assert type(mixer(x, return_state=True)[1]) is type(state)
