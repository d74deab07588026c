"""Causal softmax attention: the quadratic baseline every linear mixer is measured against.

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V      (per head, width D = d_model / H)
    o_t = sum_{s<=t} softmax_s(q_t . k_s / sqrt(D)) v_s,     y_t = o_t W_O

Softmax attention is not an EOS recurrence with a fixed-size memory: the normalisation over all
past keys cannot be folded into m_t = o_t * m_{t-1} + e_t i_t^T. MetaLA (Table 1, section 3)
treats it as the map that linear attention approximates; its "memory" is the KV cache, which
grows with t (T x d keys and T x d values). The full sequence runs through
``torch.nn.functional.scaled_dot_product_attention``; decoding appends to the cache, in place
when it can (``KVCache``), so that a step costs the attention over the cache, not a copy of it.

Packed rows (``cu_seqlens``): one SDPA call over the row with a block-diagonal causal mask (each
document sees its own earlier tokens and its own initial cache row), positions counted from each
document's start; the final state is a ragged, left-padded KV cache with one row per document.

Sliding window (``window`` W; Beltagy et al. 2020, the local attention of Samba, Ren et al.
2024): query t sees keys t - W + 1 .. t only, a band of the causal mask,

    o_t = sum_{t-W < s <= t} softmax_s(q_t . k_s / sqrt(D)) v_s,

so its decoding memory is the last W - 1 tokens' keys and values (the query's own comes with it):
O(W d) whatever the context, the KV cache trimmed after every call. A full sequence runs in
blocks of W queries against the keys of two blocks, O(T W) rather than a T x T mask. Positions (learned, rotary)
stay absolute; the band is in token distance, the same in packed rows, where it intersects the
block-diagonal mask. W >= T is full causal attention over T tokens.

Defaults follow the Zoology MQAR baseline (``zoology.mixers.attention.MHA``): one head, biased
projections, no positional information inside the mixer (Zoology adds learned positions at the
embedding). ``positions`` adds them here instead:
  * "learned": a learned table P [max_len, d_model] added to x before the projections
    (GPT-style absolute positions), init N(0, 0.02^2);
  * "rotary": RoPE (Su et al., 2021) on q and k, base 10000, the half-split pairing
    (i, i + D/2) of GPT-NeoX; needs an even head width.

Shape glossary: B batch, T new tokens, P cached tokens, H heads, D head width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_int

from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import check_document_state, document_index, document_positions, documents

Tensor = torch.Tensor

POSITIONS = ("none", "learned", "rotary")


class _Buffer:
    """Storage that cached keys and values are views of: keys, values [B, H, capacity, D], the
    first ``filled`` slots written. Shared by the states of one decoding stream."""

    def __init__(self, keys: Tensor, values: Tensor, filled: int):
        self.keys, self.values, self.filled = keys, values, filled


@dataclass
class KVCache(State):
    """keys, values: past tokens' k and v [B, H, P, D] (they grow by one per token);
    position: number of tokens seen per sequence [B] (int64). A full cache holds every one of them
    (position <= P); a sliding-window cache holds the last min(position, P) only, P <= W - 1.

    Ragged rows: a row that has seen fewer tokens than the cache holds slots (position[b] < P) keeps
    its tokens in its last position[b] slots (``held``), after P - position[b] slots of padding (zeros) that
    every attention masks out. A packed call returns its documents' caches so (documents differ in
    length), and appends keep the layout, since new tokens go after slot P in every row. The
    padding is implied by ``position``, not stored: a full cache (position == P everywhere, every
    unpacked, unpadded run) needs no mask and runs as it did before. numel_per_sequence counts the
    slots held, padding included.

    keys and values are views of the first P slots of a buffer with room to spare (capacity
    doubles when full), and the next tokens are written into the slots after them, so an append
    costs O(T d), not a copy of the cache (torch.cat copied all P tokens at every step: about 40%
    of a step at P = 16K). States stay values: appending to a state whose slots after P another
    append has already written (a second branch from one state) first copies its P tokens to a
    buffer of its own. Under autograd, where the views are saved for the backward, appends
    concatenate instead of writing in place."""

    keys: Tensor
    values: Tensor
    position: Tensor
    buffer: _Buffer | None = field(default=None, repr=False, compare=False)

    def tensors(self) -> dict[str, Tensor]:
        return {"keys": self.keys, "values": self.values, "position": self.position}

    def map(self, fn: Callable[[Tensor], Tensor]) -> KVCache:
        # fn makes new tensors (another device, a subset of the batch): the buffer is not theirs
        return KVCache(**{k: fn(v) for k, v in self.tensors().items()})

    def held(self) -> Tensor:
        """[B] int64: the tokens each row holds (fewer than ``position`` once a window dropped some)."""
        return self.position.clamp(max=self.keys.shape[2])

    def valid(self) -> Tensor:
        """[B, P] bool: the slots that hold a token (False: a ragged row's left padding)."""
        P = self.keys.shape[2]
        return torch.arange(P, device=self.keys.device) >= (P - self.held())[:, None]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, _Buffer | None]:
        """The cache with k, v [B, H, T, D] appended: (keys, values [B, H, P + T, D], their buffer,
        None where they were concatenated)."""
        P, T = self.keys.shape[2], k.shape[2]
        if torch.is_grad_enabled() and (
            k.requires_grad or v.requires_grad or self.keys.requires_grad or self.values.requires_grad
        ):
            return torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2), None
        buf = self.buffer
        if not (
            buf is not None
            and buf.filled == P
            and buf.keys.shape[2] >= P + T
            and buf.keys.dtype == k.dtype
            and buf.keys.device == k.device
            and self.keys.data_ptr() == buf.keys.data_ptr()
            and self.values.data_ptr() == buf.values.data_ptr()
        ):
            B, H, _, D = k.shape
            capacity = max(2 * (P + T), 16)
            buf = _Buffer(k.new_empty(B, H, capacity, D), v.new_empty(B, H, capacity, D), P)
            buf.keys[:, :, :P] = self.keys
            buf.values[:, :, :P] = self.values
        buf.keys[:, :, P : P + T] = k
        buf.values[:, :, P : P + T] = v
        buf.filled = P + T
        return buf.keys[:, :, : P + T], buf.values[:, :, : P + T], buf


def rotate(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """RoPE on x [B, H, T, D] at integer ``positions`` [T] (shared by the batch) or [B, T]: pairs
    (i, i + D/2) rotated by positions * base^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    real = x.real.dtype if x.is_complex() else x.dtype
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=real) * 2 / D)
    angle = positions.to(real).unsqueeze(-1) * inv_freq  # [T, D/2] or [B, T, D/2]
    if angle.dim() == 3:
        angle = angle[:, None]  # over the heads
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@register("attention", "softmax_attention", "mha")
class Attention(Mixer):
    """Multi-head causal softmax attention with a growing KV cache.

    Args:
        d_model: model width, divisible by ``heads``.
        heads: number of heads H (Zoology's MQAR baseline uses 1).
        bias: biases on the q/k/v/o projections (Zoology: True).
        positions: "none", "learned" (needs ``max_len``) or "rotary" (needs an even head width).
        max_len: number of positions of the learned table (required for "learned" only).
        window: None: every earlier token. An integer W >= 1: each query sees itself and the W - 1
            tokens before it (sliding-window attention); the decoding cache keeps W - 1 tokens.
    """

    def __init__(
        self,
        d_model: int,
        heads: int = 1,
        bias: bool = True,
        positions: str = "none",
        max_len: int | None = None,
        window: int | None = None,
    ):
        super().__init__(d_model)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d_model % heads:
            raise ValueError(f"heads: expected a positive divisor of d_model={d_model}, got {heads!r}")
        check_bool("bias", bias)
        check_choice("positions", positions, POSITIONS)
        check_int("window", window, 1, allow_none=True)
        if positions == "learned":
            if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
                raise ValueError(f"max_len: positions='learned' needs a positive integer max_len, got {max_len!r}")
        elif max_len is not None:
            raise ValueError(
                f"max_len: only used with positions='learned', got max_len={max_len!r} with positions={positions!r}"
            )
        self.heads = heads
        self.head_dim = d_model // heads
        if positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"positions: 'rotary' needs an even head width, got d_model/heads = {self.head_dim}")
        self.positions = positions
        self.max_len = max_len
        self.window = window
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)
        if bias:
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                no_weight_decay(lin.bias)
        if positions == "learned":
            self.position_embedding = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def _split(self, t: Tensor) -> Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]

    def _project(self, x: Tensor, positions: Tensor, last: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, H, T, D] of x [B, T, d_model] at ``positions`` [T] or [B, T] (the highest,
        ``last``, checked against the learned table)."""
        if self.positions == "learned":
            if self.max_len <= last:
                raise ValueError(f"x: positions up to {last} exceed the learned table (max_len={self.max_len})")
            x = x + self.position_embedding[positions]
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        if self.positions == "rotary":
            q, k = rotate(q, positions), rotate(k, positions)
        return q, k, v

    def check_state(self, state: KVCache, batch: int, packed: bool) -> None:
        # A cache's length is its own (it grows): forward checks it against its positions
        # (_check_cache), whose answer it needs anyway.
        pass

    def _check_cache(self, state: KVCache, B: int) -> bool:
        """Checks the cache's shapes and positions against batch B; returns whether every row is
        full (position == P: no padding to mask, the one check the unpadded path pays; windowed:
        position >= P)."""
        H, P, D = self.heads, state.keys.shape[2], self.head_dim
        for name in ("keys", "values"):
            t = getattr(state, name)
            if t.shape != (B, H, P, D):
                raise ValueError(f"state: {name} expected [B, H, P, D] = [{B}, {H}, {P}, {D}], got {list(t.shape)}")
        if self.window is not None and self.window <= P:
            raise ValueError(
                f"state: a window of {self.window} keeps at most {self.window - 1} cached tokens, got a cache of {P}"
            )
        if self.window is None and state.position.shape == (B,) and bool((state.position == P).all()):
            return True
        if self.window is not None and state.position.shape == (B,) and bool((state.position >= P).all()):
            return True
        if (
            state.position.shape != (B,)
            or bool((state.position < 0).any())
            or (self.window is None and bool((state.position > P).any()))
        ):
            raise ValueError(
                f"state: position {state.position.tolist()} does not match the cache length {P} for batch {B} "
                f"(each of the {B} rows holds between 0 and {P} tokens)"
            )
        return False

    def _band(self, queries: Tensor, keys: Tensor) -> Tensor:
        """[Tq, Tk] bool: key index <= query index, and within the window (indices in tokens)."""
        distance = queries[:, None] - keys[None, :]
        if self.window is None:
            return distance >= 0
        return (distance >= 0) & (distance < self.window)

    def _windowed_blocks(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Sliding-window attention of q, k, v [B, H, T, D] (no cache) in O(T W) time and memory:
        the queries in blocks of W, each block against the keys of itself and the block before it
        (all that its band can reach), one SDPA call over the blocks. A T x T band mask would cost
        O(T^2), as full attention does. The call is 4-d, [B H, blocks, rows, D], with the blocks'
        mask [1, blocks, W, 2W] broadcast over B H: torch's CPU flash kernel takes that (a 5-d call
        or a mask repeated per head fell to the math form, which keeps the [W, 2W] probabilities of
        every block for its backward: 2.5x the time at T 16384)."""
        B, H, T, D = q.shape
        W = self.window
        n = -(-T // W)
        pad = n * W - T
        # Keys and values get one block of zeros in front (the block before the first) and the
        # queries' tail padding; the mask never lets a real query see either.
        k, v = (F.pad(t, (0, 0, W, pad)) for t in (k, v))
        q = F.pad(q, (0, 0, 0, pad)).reshape(B * H, n, W, D)  # (not view: q may be a transposed view)
        k_blocks, v_blocks = (t.unfold(2, 2 * W, W).transpose(-1, -2).reshape(B * H, n, 2 * W, D) for t in (k, v))
        i = torch.arange(W, device=q.device)[:, None]
        j = torch.arange(2 * W, device=q.device)[None, :]
        distance = i + W - j  # query i of a block to key j of its two blocks
        band = (distance >= 0) & (distance < W)
        first = band & (j >= W)  # the first block has no block before it
        mask = torch.stack([first, *[band] * (n - 1)]).unsqueeze(0)  # [1, n, W, 2W]
        o = F.scaled_dot_product_attention(q, k_blocks, v_blocks, attn_mask=mask)
        return o.view(B, H, n * W, D)[:, :, :T]

    def _trim(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The last W - 1 slots of a windowed cache (all that a later query can see): a copy of
        O(W d) per call, the order of the attention over the window itself."""
        keep = self.window - 1
        if keys.shape[2] <= keep:
            return keys, values
        return keys[:, :, keys.shape[2] - keep :].contiguous(), values[:, :, values.shape[2] - keep :].contiguous()

    def forward(
        self, x: Tensor, state: KVCache | None = None, return_state: bool = False, cu_seqlens: Tensor | None = None
    ):
        """x [B, T, d_model] -> y [B, T, d_model]; with ``state`` the new tokens attend to the cache
        too (the tokens of each row's cache, ragged rows' padding masked out). ``cu_seqlens``: x
        is a packed row of documents (``_forward_packed``)."""
        self.check_input(x)
        if cu_seqlens is not None:
            return self._forward_packed(x, documents(x, cu_seqlens), state, return_state)
        B, T, d = x.shape
        if state is None:
            # An empty cache is full (no row holds padding): nothing to check, and no value read,
            # which torch.compile would not trace.
            state, full = self.init_state(B), True
        else:
            full = self._check_cache(state, B)
        P = state.keys.shape[2]
        if full and self.window is None:
            positions, last = torch.arange(P, P + T, device=x.device), P + T - 1
        else:
            # Windowed rows may have seen different numbers of tokens even when their caches are full.
            positions = state.position[:, None] + torch.arange(T, device=x.device)  # [B, T]
            last = int(state.position.max()) + T - 1
        q, k, v = self._project(x, positions, last)
        if self.window is not None:
            keys, values, buffer = (
                (torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2), None) if P else (k, v, None)
            )
        elif P == 0 and not return_state:
            keys, values, buffer = k, v, None
        else:
            keys, values, buffer = state.append(k, v)
        banded = self.window is not None and self.window < P + T
        if P == 0 and not banded:
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        elif P == 0:
            o = self._windowed_blocks(q, k, v)
        elif T == 1 and full:
            o = F.scaled_dot_product_attention(q, keys, values)  # one query sees every key (P <= W - 1)
        else:
            # Query t (absolute P + t) sees keys 0..P + t (within the window): a causal mask shifted
            # by the cache length (is_causal would align the mask to the top-left corner instead).
            t = torch.arange(P + T, device=x.device)
            mask = self._band(t[P:], t)
            if not full:
                mask = mask & F.pad(state.valid(), (0, T), value=True)[:, None, None, :]  # [B, 1, T, P + T]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, d))
        if return_state:
            if self.window is not None:
                keys, values = self._trim(keys, values)
            return y, KVCache(keys=keys, values=values, position=state.position + T, buffer=buffer)
        return y

    def _forward_packed(self, x: Tensor, cu: Tensor, state: KVCache | None, return_state: bool):
        """x [1, T, d_model], N documents at ``cu`` [N + 1], ``state`` one cache row per document.

        One SDPA call over the row and every document's initial cache, with a boolean mask of
        T x (N P + T): query t sees its own document's earlier tokens and the tokens of its own
        cache row. That mask is quadratic in the row's length, as attention is here anyway (the
        reference library has no variable-length kernel). The returned cache is ragged: row n holds
        its initial tokens and then its document's, left-padded to the longest row."""
        T, d = x.shape[1], x.shape[2]
        N = cu.numel() - 1
        if state is None:
            state = self.init_state(N)
        for name, t in state.tensors().items():
            check_document_state(f"state.{name}", t, N)
        self._check_cache(state, N)
        H, P, D = self.heads, state.keys.shape[2], self.head_dim
        doc = document_index(cu, T)
        offsets = document_positions(cu, T)
        positions = state.position[doc] + offsets  # from each document's start
        q, k, v = self._project(x, positions, int(positions.max()))
        t = torch.arange(T, device=x.device)
        mask = (doc[:, None] == doc[None, :]) & self._band(t, t)  # block-diagonal causal (banded)
        # Every document's cache as one sequence of N P slots before the row's tokens.
        cached_k = state.keys.transpose(0, 1).reshape(H, N * P, D)
        cached_v = state.values.transpose(0, 1).reshape(H, N * P, D)
        keys, values = k, v
        if P:
            slot_doc = torch.arange(N, device=x.device).repeat_interleave(P)
            sees_cache = (doc[:, None] == slot_doc[None, :]) & state.valid().reshape(1, N * P)
            if self.window is not None:
                # Slot s of a cache row is P - s tokens before its document's first token.
                before = P - torch.arange(P, device=x.device).repeat(N)
                sees_cache = sees_cache & (offsets[:, None] + before[None, :] < self.window)
            mask = torch.cat([sees_cache, mask], 1)
            keys, values = torch.cat([cached_k[None], k], 2), torch.cat([cached_v[None], v], 2)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = self.o_proj(o.transpose(1, 2).reshape(1, T, d))
        if not return_state:
            return y
        # Row n of the final cache: padding, then the last ``kept`` of [the tokens its initial row
        # holds, its document's tokens] (all of them without a window). One gather per tensor from
        # [cache slots (N P), row tokens (T), a zero slot].
        held = state.held()
        lengths = cu[1:] - cu[:-1]
        kept = held + lengths if self.window is None else (held + lengths).clamp(max=self.window - 1)
        P_out = int(kept.max())
        offset = torch.arange(P_out, device=x.device) - (P_out - kept)[:, None]  # < 0: padding
        j = offset + (held + lengths - kept)[:, None]  # index in [held tokens, document tokens]
        from_cache = torch.arange(N, device=x.device)[:, None] * P + P - held[:, None] + j
        from_row = N * P + cu[:-1, None] + j - held[:, None]
        index = torch.where(offset < 0, N * P + T, torch.where(j < held[:, None], from_cache, from_row))

        def gather(cached: Tensor, new: Tensor) -> Tensor:
            table = torch.cat([cached, new[0], new.new_zeros(H, 1, D)], 1)
            return table[:, index].transpose(0, 1).contiguous()  # [N, H, P_out, D]

        return y, KVCache(keys=gather(cached_k, k), values=gather(cached_v, v), position=state.position + lengths)

    def init_state(self, batch_size: int) -> KVCache:
        p = self._param_like()
        empty = p.new_zeros(batch_size, self.heads, 0, self.head_dim)
        return KVCache(
            keys=empty, values=empty.clone(), position=torch.zeros(batch_size, dtype=torch.long, device=p.device)
        )

    def state_size(self, seq_len: int) -> int:
        """Keys and values of every token seen (2 T d_model; windowed: of the last W - 1) plus the
        position counter."""
        held = seq_len if self.window is None else min(seq_len, self.window - 1)
        return 2 * held * self.d_model + 1

    def describe(self) -> EOSRow:
        held = "T" if self.window is None else f"W - 1 = {self.window - 1}"
        return EOSRow(
            name=("softmax attention" if self.window is None else f"sliding-window attention (W = {self.window})")
            + ("" if self.positions == "none" else f" ({self.positions} positions)"),
            input="v_t",
            expand="k_t (normalised by softmax over all keys; not a fixed-size EOS state)",
            oscillation="none (softmax over all keys; psi 'elementwise' only nominally: not an EOS recurrence)",
            shrink="q_t",
            memory=f"{held} x d (KV cache: {held} x {self.d_model} keys + {held} x {self.d_model} values"
            + (", grows with T)" if self.window is None else ", a fixed window)"),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Vaswani et al., 2017; the softmax baseline of MetaLA Table 1 / section 3",
        )
