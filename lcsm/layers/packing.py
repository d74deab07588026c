"""Packed sequences and padding for mixers: the pieces every mixer's ``cu_seqlens`` path shares.

A packed row (FlashAttention's ``cu_seqlens``, batch 1) holds N documents back to back; a mixer
given ``cu_seqlens`` treats each document as its own sequence: its state (memory, short-convolution
window, token shift, positions) restarts at the document's first token from that document's
initial state (row n of the state's batch, N rows), and the returned state has one row per
document. Nothing crosses a boundary.

Padding reduces to packing: ``pack_rows`` gathers the tokens an attention mask keeps (left, right
or any padding) into one packed row, one document per batch row, and ``unpack_rows`` scatters the
outputs back, zeros at the pads. A pad token therefore leaves every state exactly as if it were
absent (decay 1, write 0), and positions count only kept tokens.

Shape glossary: T tokens of the packed row, N documents, C channels, W window (kernel) width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lcsm.ops import native_causal_conv, native_serves, packed_bounds

Tensor = torch.Tensor


def documents(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Checks ``cu_seqlens`` against x [1, T, ...] and returns it as int64 on x's device."""
    packed_bounds(cu_seqlens, x.shape[0], x.shape[1])
    return cu_seqlens.to(device=x.device, dtype=torch.int64)


def document_index(cu_seqlens: Tensor, T: int) -> Tensor:
    """[T] int64: the document of each token."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=T)


def document_positions(cu_seqlens: Tensor, T: int) -> Tensor:
    """[T] int64: each token's position inside its own document (0 at every document's start)."""
    doc = document_index(cu_seqlens, T)
    return torch.arange(T, device=cu_seqlens.device) - cu_seqlens[doc]


def check_document_state(name: str, t: Tensor, n_docs: int) -> None:
    """A state tensor given with packed sequences must hold one row per document."""
    if t.shape[0] != n_docs:
        raise ValueError(
            f"{name}: with cu_seqlens of N = {n_docs} documents the state holds one row per document, "
            f"expected batch {n_docs}, got {list(t.shape)}"
        )


def windows(x: Tensor, cu_seqlens: Tensor, history: Tensor | None, W: int) -> tuple[Tensor, Tensor]:
    """Each token's causal window of W inputs inside its own document.

    x [1, T, C]; history [N, W - 1, C] (the inputs before each document, oldest first; None: zeros).
    Returns (win [T, W, C], oldest first, win[:, -1] = x_t; final [N, W - 1, C], each document's
    last W - 1 inputs, reaching into its history when the document is shorter)."""
    T, C = x.shape[1], x.shape[2]
    N = cu_seqlens.numel() - 1
    if history is not None:
        if history.shape != (N, W - 1, C):
            raise ValueError(f"history: expected [N, W - 1, C] = [{N}, {W - 1}, {C}], got {list(history.shape)}")
        hist = history.to(x.dtype).reshape(N * (W - 1), C)
    else:
        hist = x.new_zeros(N * (W - 1), C)
    # One table: the row's tokens, then every document's history.
    table = torch.cat([x[0], hist])
    lag = torch.arange(W - 1, -1, -1, device=x.device)  # oldest first

    def gather(pos: Tensor, doc: Tensor) -> Tensor:
        """Rows of the table for virtual positions pos [M, W'] of documents doc [M]."""
        start = cu_seqlens[doc][:, None]
        back = pos - start  # < 0: before the document, in its history
        into_hist = T + doc[:, None] * (W - 1) + (W - 1) + back
        return table[torch.where(back >= 0, pos, into_hist)]

    doc = document_index(cu_seqlens, T)
    t = torch.arange(T, device=x.device)
    win = gather(t[:, None] - lag, doc)
    docs = torch.arange(N, device=x.device)
    return win, gather(cu_seqlens[1:][:, None] - 1 - lag[1:], docs)


def causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, history: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution restarted at every document (``nn.Conv1d(C, C, W, groups=C)``
    weights [C, 1, W]): x [1, T, C] -> (y [1, T, C], the last W - 1 inputs of each document [N, W - 1, C])."""
    W = weight.shape[-1]
    win, final = windows(x, cu_seqlens, history, W)
    y = torch.einsum("twc,cw->tc", win, weight[:, 0].to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y[None], final


def short_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    cu_seqlens: Tensor | None,
    history: Tensor | None,
    silu: bool = False,
) -> tuple[Tensor, Tensor]:
    """``causal_conv`` for a packed row (``cu_seqlens``) or, without, for each row of a batch:
    x [B, T, C] continuing from history [B, W - 1, C] (the inputs before x, oldest first; None:
    zeros) -> (y [B, T, C], the last W - 1 inputs [B, W - 1, C]); y through SiLU when ``silu``.
    A batch runs as it is, not as one packed row of B documents: the same results, one
    convolution over [B, C, W - 1 + T], and no bounds read from tensor data (which torch.compile
    cannot trace with a symbolic T). Eagerly on the CPU a batch takes the native kernel
    (``lcsm.ops.native_causal_conv``: the convolution and SiLU in one pass each way, where
    ``depthwise_causal``'s backward zero-fills a gradient of the whole row per tap)."""
    if cu_seqlens is not None:
        y, last = causal_conv(x, weight, bias, cu_seqlens, history)
        return (F.silu(y) if silu else y), last
    W = weight.shape[-1]
    if native_serves(x) and weight.dtype == x.dtype:
        return native_causal_conv(x, weight, bias, history, silu), _last_inputs(x, history, W)
    if history is None:
        history = x.new_zeros(x.shape[0], W - 1, x.shape[2])
    full = torch.cat([history.to(x.dtype), x], dim=1)
    y = depthwise_causal(full, weight, bias)
    return (F.silu(y) if silu else y), full[:, full.shape[1] - (W - 1) :]


def _last_inputs(x: Tensor, history: Tensor | None, W: int) -> Tensor:
    """The last W - 1 of history's and x's inputs [B, W - 1, C] (a view of x when it has them)."""
    T = x.shape[1]
    if T >= W - 1:
        return x[:, T - (W - 1) :]
    before = history.to(x.dtype) if history is not None else x.new_zeros(x.shape[0], W - 1, x.shape[2])
    return torch.cat([before[:, T:], x], dim=1)


def depthwise_causal(full: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The depthwise convolution of ``full`` [B, W - 1 + T, C] (the W - 1 inputs before the
    sequence, then its T inputs) with ``weight`` [C, 1, W] (``nn.Conv1d(C, C, W, groups=C)``),
    plus ``bias`` [C]: [B, T, C], y_t = bias + sum_j weight[:, 0, j] full_{t + j}.

    As W shifted multiply-adds along the channels' contiguous dim, summed in float32 at least (a
    CUDA causal-conv kernel's accumulator): F.conv1d wants [B, C, T], so its input and output are
    transposed copies, and its depthwise CPU backward ran several times slower than its forward
    (fwd + bwd of the conv and SiLU at B 1, T 2048, C 256: 13 ms against 5 ms)."""
    W = weight.shape[-1]
    T = full.shape[1] - (W - 1)
    wide = torch.promote_types(full.dtype, torch.float32)
    taps = weight[:, 0].t().to(wide)  # [W, C]
    first = full[:, :T].to(wide)
    y = first * taps[0] if bias is None else torch.addcmul(bias.to(wide), first, taps[0])
    for j in range(1, W):
        y = y.addcmul(full[:, j : j + T].to(wide), taps[j])
    return y.to(full.dtype)


def silu_short_conv(
    conv: nn.Conv1d, x: Tensor, history: Tensor | None, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor]:
    """SiLU of a depthwise causal convolution (``conv``: ``nn.Conv1d(C, C, W, groups=C)``), fla's
    ``ShortConvolution(activation="silu")``: x [B, T, C] continuing from history [B, W - 1, C] (the
    inputs before x, oldest first; None: zeros) -> (y [B, T, C], the last W - 1 inputs [B, W - 1, C]).
    With ``cu_seqlens`` x is a packed row, history holds one row per document and the convolution
    restarts at each document's start."""
    return short_conv(x, conv.weight, conv.bias, cu_seqlens, history, silu=True)


def token_shift(x: Tensor, cu_seqlens: Tensor, previous: Tensor | None) -> tuple[Tensor, Tensor]:
    """x_{t-1} inside each document: x [1, T, C], previous [N, C] (the token before each document;
    None: zeros) -> (shifted [1, T, C], each document's last token [N, C])."""
    win, final = windows(x, cu_seqlens, None if previous is None else previous[:, None], 2)
    return win[None, :, 0], final[:, 0]


def check_mask(attention_mask: Tensor, B: int, T: int) -> Tensor:
    """An attention mask [B, T] (1 / True = token, 0 = padding) as bool; every row keeps a token."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, T):
        got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected [B, T] = [{B}, {T}], got {got}")
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)][0].item()
        raise ValueError(f"attention_mask: expected 0 (padding) and 1 (token) entries only, got {bad}")
    mask = attention_mask.to(torch.bool)
    if not bool(mask.any(1).all()):
        raise ValueError("attention_mask: every row needs at least one token (a row of only padding has no document)")
    return mask


def pack_rows(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The kept tokens of x [B, T, ...] (mask [B, T] bool) as one packed row [1, M, ...] with one
    document per batch row; returns (packed, cu_seqlens [B + 1] int64)."""
    counts = mask.sum(1)
    cu = F.pad(counts.cumsum(0), (1, 0))
    return x[mask][None], cu


def unpack_rows(y: Tensor, mask: Tensor) -> Tensor:
    """Inverse of ``pack_rows``: y [1, M, ...] -> [B, T, ...], zeros at the padding."""
    out = y.new_zeros(*mask.shape, *y.shape[2:])
    out[mask] = y[0]
    return out


def previous(t: Tensor, first: Tensor | None, cu_seqlens: Tensor | None) -> Tensor:
    """t_{t-1} along dim 1 of t [B, T, X], inside each sequence (each document of a packed row):
    ``first`` [B | N, X] stands before every sequence's first token (None: zeros)."""
    if cu_seqlens is not None:
        return token_shift(t, cu_seqlens, first)[0]
    first = t.new_zeros(t.shape[0], 1, t.shape[2]) if first is None else first.to(t.dtype).unsqueeze(1)
    if torch.compiler.is_compiling():
        # T steps sliced from the cat: a slice of t to T - 1 steps would be guarded on T - 1 != 1,
        # a second graph for T = 2 (eager keeps the contiguous cat)
        return torch.cat([first, t], dim=1)[:, :-1]
    return torch.cat([first, t[:, :-1]], dim=1)


def last(t: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """The last token of each sequence (each document): t [B, T, X] -> [B | N, 1, X]."""
    return t[:, -1:] if cu_seqlens is None else t[0, cu_seqlens[1:] - 1].unsqueeze(1)


def running_max(a: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """max(a_1..a_t) along dim 1 of a [B, T, C], restarting at every document of a packed row.
    Packed: a doubling scan (step j takes the max with the value 2^j back, within the document),
    log2 of the longest document steps over the whole row; max is exact, so each document's
    maxima are exactly those of torch.cummax on it alone."""
    if cu_seqlens is None:
        return torch.cummax(a, dim=1).values
    doc = document_index(cu_seqlens, a.shape[1])
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    step = 1
    while step < longest:
        same = (doc[step:] == doc[:-step]).unsqueeze(-1)
        a = torch.cat([a[:, :step], torch.where(same, torch.maximum(a[:, step:], a[:, :-step]), a[:, step:])], dim=1)
        step *= 2
    return a
