"""Token mixers: the common interface, the EOS table row and the registry.

Every mixer maps x [B, T, d_model] -> y [B, T, d_model] causally, carries an explicit recurrent
state in and out (recurrentgemma style), and can describe itself as a row of LCSM Table 1.

Shape glossary: B batch, T time, H heads, K expand (memory rows), D memory columns per head,
d_model model width.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lcsm._checks import check_keys

from .packing import check_document_state, check_mask, documents, pack_rows, unpack_rows

Tensor = torch.Tensor


@dataclass
class State:
    """Base of every mixer's typed recurrent state: a dataclass whose fields are tensors (or None).

    Subclasses add their fields, e.g. ``memory: Tensor`` [B, H, K, D] or ``conv: Tensor``.
    """

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def numel_per_sequence(self) -> int:
        """Scalars held per sequence (complex numbers count as two real scalars)."""
        total = 0
        for t in self.tensors().values():
            per = t.numel() // max(t.shape[0], 1) if t.dim() > 0 else t.numel()
            total += per * (2 if t.is_complex() else 1)
        return total

    def map(self, fn: Callable[[Tensor], Tensor]) -> State:
        return dataclasses.replace(self, **{k: fn(v) for k, v in self.tensors().items()})


@dataclass
class ValueFirst:
    """The values [B, T, C] of a model's first layer in one forward pass, for the later layers that
    mix them into their own (RWKV-7's value residual). The model makes an empty one per forward
    call and hands it to every layer whose mixer sets ``uses_value_first``: the mixer of the
    model's layer 0 stores its values, the later ones read them. Values are per token, so carried states, decoding and
    packed rows need nothing more."""

    values: Tensor | None = None


@dataclass(frozen=True)
class EOSRow:
    """One row of the unified table (LCSM Table 1 / Table 7, MetaLA Table 1).

    Each state is written as in the papers (e.g. expand "k_t", oscillation "g_t 1^T");
    ``*_dd`` says whether that state depends on the input (the papers' subscript t).
    """

    name: str
    input: str
    expand: str
    oscillation: str
    shrink: str
    memory: str  # e.g. "K x D = 64 x 64"
    psi: str  # "elementwise" or "matrix"
    input_dd: bool
    expand_dd: bool
    oscillation_dd: bool
    shrink_dd: bool
    paper: str

    FIELDS = (
        "name",
        "input",
        "expand",
        "oscillation",
        "shrink",
        "memory",
        "psi",
        "input_dd",
        "expand_dd",
        "oscillation_dd",
        "shrink_dd",
        "paper",
    )

    def as_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.FIELDS}


class Mixer(nn.Module):
    """Base class of token mixers. Subclasses implement ``forward``, ``init_state`` and ``describe``.

    ``step`` defaults to a length-1 ``forward`` with the carried state, which costs O(state) per
    token for every mixer whose forward honours ``state``; ``state_size`` defaults to the size of
    ``init_state`` (constant-size recurrent states).
    """

    registry_name: str = ""
    # Parameters (by name; a name ending in "." covers a submodule's) that stay float32 when the
    # layer is cast to a half precision: an SSM's system (eigenvalues, steps, B, C, a kernel
    # generator) defines a kernel over thousands of steps, which bfloat16's 8-bit mantissa cannot
    # resolve (it would round S4D-Lin's frequencies, pi n up to ~100, to steps of 0.5), and there
    # is no complex bfloat16 and no bfloat16 FFT. Their forwards lift half inputs to float32 and
    # cast outputs back.
    float32_parameters: tuple[str, ...] = ()
    # A mixer that reads both directions itself: it takes a ``bidirectional`` option and its
    # forward a ``lengths`` keyword (right padding). A bidirectional model passes it
    # bidirectional=True instead of wrapping two causal copies (``lcsm.models.Bidirectional``).
    native_bidirectional: bool = False
    # Options the model sets (``layer_options``, and ``bidirectional`` of a native_bidirectional
    # mixer): a user's value would be silently overridden, so ModelConfig refuses them.
    model_owned_options: tuple[str, ...] = ()
    # A mixer whose forward takes ``value_first: ValueFirst | None`` (the first layer's values,
    # shared by the model between its layers; ``ValueFirst``; ``reads_value_first_at`` below).
    uses_value_first: bool = False
    # Bumped whenever the same options come to build another function or init (a fix that follows
    # the official code): runs record it, and a sweep does not take a run of an older revision for
    # today's model (``lcsm.models.model_revisions``).
    revision: int = 1
    # Option sets that build another structure than the defaults (a state with other fields, a
    # convolution on another path): the registry's contract tests (tests/layers/test_common.py,
    # test_packed_mixers.py) run the mixer with each of them as well as with its defaults.
    option_variants: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def revision_for(cls, options: Mapping[str, Any]) -> int:
        """The revision of what ``options`` (implied and given, before ``layer_options``) build; a
        hook for a mixer whose change touched only some of its options. Default: ``revision``."""
        return cls.revision

    @classmethod
    def layer_options(cls, options: Mapping[str, Any], layer: int, n_layers: int) -> dict[str, Any]:
        """The options of layer ``layer`` (0-based) of ``n_layers``, from the model's
        ``mixer_options``: a hook for mixers whose options depend on the layer's position (an
        init by depth, a bound per layer). The default is the options unchanged."""
        return dict(options)

    @classmethod
    def reads_value_first_at(cls, options: Mapping[str, Any], layer: int) -> bool:
        """Whether layer ``layer`` of this mixer, built with ``options``, reads layer 0's values
        (``uses_value_first``); ModelConfig checks that the model makes them."""
        return False

    def __init__(self, d_model: int):
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model: expected a positive integer, got {d_model!r}")
        self.d_model = d_model

    def __call__(self, x, *args, **kwargs):
        # Done here once for every mixer's forward, in eager only (a compiled graph is traced with
        # the arguments of its first call; a state of other shapes then fails inside the graph): a
        # state passed back in is checked for its type (another mixer's state of the same field
        # names would otherwise run silently) and its shapes (a state of one row would broadcast
        # over a batch), and an input of no tokens gives no output and leaves the state as it was
        # (several forms cannot reshape or convolve an empty sequence). Arguments as forward's:
        # (x, state, return_state, ...), cu_seqlens by name or at its place in forward.
        if not torch.compiler.is_compiling():
            state = kwargs["state"] if "state" in kwargs else (args[0] if args else None)
            if state is not None:
                want = type(self._empty_state())
                if type(state) is not want:
                    raise ValueError(f"state: expected a {want.__name__} from this mixer, got {type(state).__name__}")
                at = _cu_seqlens_position(type(self))
                cu = kwargs.get("cu_seqlens", args[at] if at is not None and len(args) > at else None)
                # (cu_seqlens that are not a 1-D tensor are refused by forward's own check)
                if isinstance(x, Tensor) and x.dim() == 3 and (cu is None or isinstance(cu, Tensor) and cu.dim() == 1):
                    self.check_state(state, x.shape[0] if cu is None else cu.numel() - 1, cu is not None)
            if isinstance(x, Tensor) and x.dim() == 3 and x.shape[1] == 0:
                return self._no_tokens(x, state, *args[1:], **{k: v for k, v in kwargs.items() if k != "state"})
        return super().__call__(x, *args, **kwargs)

    def _no_tokens(self, x: Tensor, state: State | None, return_state: bool = False, cu_seqlens=None, **_):
        """An input of no tokens: an empty output, and the state as given (or the initial one)."""
        if cu_seqlens is not None:  # documents of no tokens: the packed forms' own checks refuse them
            return super().__call__(x, state=state, return_state=return_state, cu_seqlens=cu_seqlens, **_)
        self.check_input(x)
        y = x.new_zeros(x.shape)
        return (y, state if state is not None else self.init_state(x.shape[0])) if return_state else y

    def forward(
        self, x: Tensor, state: State | None = None, return_state: bool = False, cu_seqlens: Tensor | None = None
    ):
        """x [B, T, d_model] -> y [B, T, d_model] (and the state after the last token).

        ``cu_seqlens`` [N + 1]: x is one packed row (B = 1) of N documents; each runs as its own
        sequence from row n of ``state`` (N rows) and the returned state has one row per document
        (``lcsm.layers.packing``)."""
        raise NotImplementedError

    def forward_masked(self, x: Tensor, attention_mask: Tensor, state: State | None = None, return_state: bool = False):
        """Padded rows: x [B, T, d_model] with ``attention_mask`` [B, T] (1 = token, 0 = padding,
        on either side). Padding is as if absent: each row runs over its own tokens only, from row b
        of ``state``; outputs at the pads are zero."""
        self.check_input(x)
        mask = check_mask(attention_mask.to(x.device), x.shape[0], x.shape[1])
        packed, cu = pack_rows(x, mask)
        out = self(packed, state=state, return_state=return_state, cu_seqlens=cu)
        if return_state:
            return unpack_rows(out[0], mask), out[1]
        return unpack_rows(out, mask)

    def init_state(self, batch_size: int) -> State:
        raise NotImplementedError

    def check_call(self, x: Tensor, cu_seqlens: Tensor | None) -> Tensor | None:
        """``forward``'s arguments checked: x [B, T, d_model] and ``cu_seqlens`` (returned checked,
        or None); ``__call__`` checks a given state."""
        self.check_input(x)
        return None if cu_seqlens is None else documents(x, cu_seqlens)

    def _empty_state(self) -> State:
        """``init_state(0)``, made once: the type and the shapes (after the batch) of this mixer's
        states, which ``__call__`` checks a given state against at every call."""
        empty = self.__dict__.get("_empty")
        if empty is None:
            empty = self.__dict__["_empty"] = self.init_state(0)
        return empty

    def check_state(self, state: State, batch: int, packed: bool) -> None:
        """A state given to the mixer (of ``init_state``'s type), each tensor of its shape with
        batch ``batch`` (one row per document of a packed row when ``packed``); ``__call__`` runs
        it before ``forward``."""
        for name, ref in self._empty_state().tensors().items():
            t = getattr(state, name)
            if not isinstance(t, Tensor):
                raise ValueError(f"state.{name}: expected a tensor [{batch}, *{list(ref.shape[1:])}], got {t!r}")
            if packed:
                check_document_state(f"state.{name}", t, batch)
            if list(t.shape) != [batch, *ref.shape[1:]]:
                raise ValueError(f"state.{name}: expected {[batch, *ref.shape[1:]]}, got {list(t.shape)}")

    def describe(self) -> EOSRow:
        raise NotImplementedError

    def step(self, x_t: Tensor, state: State) -> tuple[Tensor, State]:
        if x_t.dim() != 2 or x_t.shape[-1] != self.d_model:
            raise ValueError(f"x_t: expected [B, d_model] = [B, {self.d_model}], got {list(x_t.shape)}")
        y, state = self(x_t.unsqueeze(1), state=state, return_state=True)
        return y.squeeze(1), state

    def state_size(self, seq_len: int) -> int:
        return self.init_state(1).numel_per_sequence()

    def _apply(self, fn, recurse=True):
        """nn.Module's conversion of every tensor (``.to``, ``.bfloat16()``, ``.cuda()``), except that
        the ``float32_parameters`` and their gradients become float32 where it would make them a
        half precision (converted from the originals, not from their rounded copies)."""
        if not self.float32_parameters:
            return super()._apply(fn, recurse)
        keep = {
            id(t)
            for name, p in self.named_parameters()
            if self.keeps_float32(name)
            for t in (p, p.grad)
            if t is not None
        }

        def convert(t: Tensor) -> Tensor:
            out = fn(t)
            if id(t) in keep and out.dtype in (torch.float16, torch.bfloat16):
                return t.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(convert, recurse)

    @staticmethod
    def entry_matches(declared: str, name: str) -> bool:
        """Whether a ``float32_parameters`` entry names parameter ``name`` (as ``named_parameters``
        gives it): the same name, or a prefix ending in "." (a submodule's parameters)."""
        return name == declared or (declared.endswith(".") and name.startswith(declared))

    def keeps_float32(self, name: str) -> bool:
        """Whether parameter ``name`` is one of the ``float32_parameters``."""
        return any(self.entry_matches(k, name) for k in self.float32_parameters)

    def _param_like(self) -> Tensor:
        return next(self.parameters())

    def _memory_dtype(self, complex_memory: bool = False) -> torch.dtype:
        """A recurrent memory's dtype: the parameters' precision, float32 for a half-precision layer
        (the EOS operators compute half inputs in float32 and return their states so, as fla does),
        complex for a complex memory."""
        dtype = self._param_like().dtype
        if dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
        return torch.promote_types(dtype, torch.complex64) if complex_memory else dtype

    def check_input(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected [B, T, d_model] = [B, T, {self.d_model}], got {list(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"x: expected a real floating-point tensor (the embedded tokens), got {x.dtype}")
        # Outside autocast an input of another precision than the layer's would fail in its first
        # matmul, or, where an elementwise product comes first, promote and return another dtype.
        dtype = self._compute_dtype()
        if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(
                f"x: expected the layer's dtype {dtype} (its parameters'), got {x.dtype}; convert one of them, "
                "or run under autocast"
            )

    def _compute_dtype(self) -> torch.dtype | None:
        """The dtype of the layer's floating-point parameters, apart from the ``float32_parameters``
        a half-precision layer keeps (None: it has no other). The parameter it is read from is
        remembered as (its module, its name there): a walk over the parameters, or get_parameter,
        costs 5-10 us, on every decoding step; found again when it is gone from there (pruning
        renames it)."""
        where = self.__dict__.get("_dtype_from")
        if where is not None and (p := where[0]._parameters.get(where[1])) is not None:
            return p.dtype
        kept = self.float32_parameters
        names = (
            n for n, p in self.named_parameters() if p.is_floating_point() and not (kept and self.keeps_float32(n))
        )
        name = next(names, None)
        if name is None:
            return None
        owner, _, attr = name.rpartition(".")
        self.__dict__["_dtype_from"] = (self.get_submodule(owner), attr)
        return self.get_parameter(name).dtype


@functools.cache
def _cu_seqlens_position(cls: type) -> int | None:
    """Where ``cu_seqlens`` stands among the positional arguments after x of ``cls.forward``
    (None: it takes none; CES has ``lengths`` before it)."""
    names = list(inspect.signature(cls.forward).parameters)[2:]
    return names.index("cu_seqlens") if "cu_seqlens" in names else None


def no_weight_decay(param: nn.Parameter) -> nn.Parameter:
    """Tag a parameter (decay rates, A_log, D skips, norms, biases) to be excluded from weight
    decay by the training engine's AdamW parameter groups."""
    param._no_weight_decay = True
    return param


def short_convs(widths: tuple[int, ...], size: int, bias: bool) -> tuple[nn.Conv1d, ...]:
    """Depthwise causal convolutions of ``size`` taps, one per width (fla's ``ShortConvolution`` on
    q, k and v; applied by ``packing.silu_short_conv``), their biases exempt from weight decay."""
    convs = tuple(nn.Conv1d(w, w, size, groups=w, bias=bias) for w in widths)
    if bias:
        for conv in convs:
            no_weight_decay(conv.bias)
    return convs


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Mixer]] = {}
_ALIASES: dict[str, str] = {}


def register(name: str, *aliases: str):
    """Class decorator: ``@register("retnet", "tnl")``."""

    def deco(cls: type[Mixer]) -> type[Mixer]:
        for n in (name, *aliases):
            if n in _REGISTRY or n in _ALIASES:
                raise ValueError(f"mixer name {n!r} registered twice")
        _REGISTRY[name] = cls
        for a in aliases:
            _ALIASES[a] = name
        cls.registry_name = name
        return cls

    return deco


def available() -> list[str]:
    """Sorted canonical names of the registered mixers (aliases excluded)."""
    return sorted(_REGISTRY)


def aliases() -> dict[str, str]:
    return dict(_ALIASES)


def resolve(name: str) -> tuple[type[Mixer], dict[str, object]]:
    """Name -> (class, options implied by the name). ``family:spec`` names call ``cls.from_spec``."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a mixer name (str), got {type(name).__name__}")
    base, _, spec = name.partition(":")
    base = _ALIASES.get(base, base)
    if base not in _REGISTRY:
        valid = available() + sorted(_ALIASES)
        close = difflib.get_close_matches(base, valid, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown mixer {name!r}.{hint} Valid names: {', '.join(valid)}")
    cls = _REGISTRY[base]
    if not spec:
        return cls, {}
    if not hasattr(cls, "from_spec"):
        raise ValueError(f"mixer {base!r} takes no ':spec' suffix, got {name!r}")
    return cls, cls.from_spec(spec)


def build(name: str, d_model: int, **options) -> Mixer:
    """Build a registered mixer; unknown options fail with the valid ones listed."""
    check_options(name, options)
    cls, implied = resolve(name)
    return cls(d_model, **{**implied, **options})


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """The one check of a mixer's options (``build`` and ``ModelConfig`` both call it): each must be
    a keyword of the mixer's constructor, and none may contradict its ``family:spec`` name."""
    cls = resolve(name)[0]
    valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "d_model")]
    check_keys("mixer_options", options, valid, kind="option", unknown=f"mixer {name!r} has no option(s)")
    check_implied(name, options)


def check_implied(name: str, options: Mapping[str, Any]) -> None:
    """Options that contradict what a ``family:spec`` name sets (``lcsm:1-9-1-0`` with
    ``code: 0-0-0-0``) are an error: the name would no longer say what is built."""
    implied = resolve(name)[1]
    clash = {k: v for k, v in options.items() if k in implied and v != implied[k]}
    if clash:
        raise ValueError(
            f"mixer_options: mixer {name!r} sets {', '.join(f'{k}={implied[k]!r}' for k in clash)}, "
            f"got {', '.join(f'{k}={v!r}' for k, v in clash.items())}; give the option once"
        )
