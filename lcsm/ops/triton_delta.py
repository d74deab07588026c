"""A Triton kernel for the sequential part of the WY / UT chunk forms (``eos_delta``'s and
``eos_dplr``'s): the carry of the memory across chunks, forward and backward (float32).

The chunk forms (``delta._chunk_maps``, ``dplr._maps``) make each chunk an affine map of the
memory M entering it: the corrections are U = W M + U0 and the memory after the chunk is

    M' = gamma M + Psi - A^T (W M)        (the transition Phi = diag(gamma) - A^T W, never formed)

with W, A [C, K], Psi [K, D] and gamma the chunk's decay: none (1), a scalar (a gate) or one per
memory row (a per-row decay, each row of M scaled by its own). Everything else is batched over all
chunks at once as PyTorch matmuls. The carry alone is a loop over the chunks: in PyTorch one small
batched product per chunk (and autograd's node per chunk in the backward), which on a GPU is a
kernel launch each; here one program per (batch * head, block of BD memory columns) walks the
chunks with its [K, BD] block of M in registers (the columns of M evolve independently: every map
acts on M from the left).

Backward, walking the chunks from the last, G = dL/dM' (the carry, plus the gradient of each
chunk's start memory as it is passed):

    dU = -A G      dPsi = G      dA = -U G^T      dW = dU M^T      dgamma = sum_d M * G
    dM = gamma G + W^T dU        (U = W M recomputed from the saved start memory)

(dgamma summed over every entry for a scalar gamma, over each row's columns for a per-row one.)
dA, dW and dgamma sum over the memory columns: each column block writes its share, summed after.

Imported only when this carry runs (``eos_delta`` / ``eos_dplr`` with mode "triton", or "auto" on
CUDA tensors); under ``TRITON_INTERPRET=1`` set before triton is imported it runs on CPU tensors
in Triton's interpreter (the tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._autograd import first_order
from ._inputs import on_device

Tensor = torch.Tensor

# The memory's rows are one register block [K, BD] (K up to delta.TRITON_MAX_K); W and A are read
# SUB_C chunk rows at a time (U = W M and A^T U summed over the row blocks): whole [C, K] blocks of
# both, held with the memory, made ptxas spill 13-33 KB a thread. Launch shapes from ptxas's
# reports for sm_90 at K = 128 (bench/results/triton_registers.md): 32 memory columns, 8 warps
# and no pipelining leave both kernels unspilled; 64 columns spill ~90 bytes in the backward (M, G
# and dM held), 2 or 3 stages 20 or 4; 32 columns also make twice the programs of this sequential
# walk. ``lcsm bench gpu --shapes`` times the alternatives.
BLOCK_D = 32
SUB_C = 16  # tl.dot's least size
NUM_WARPS = 8
NUM_STAGES = 1


@triton.jit
def _dot(a, b):
    """a @ b in three TF32 tensor-core products (high * high + high * low + low * high): float32's
    accuracy (docs/eos_delta.md), where ``ieee`` full-precision products run on the CUDA cores
    with their operands' rows in registers (spilling up to ~50 KB a thread at K = 128)."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _decayed(x, gamma_ptr, chunk, offs_k, K, GAMMA: tl.constexpr):
    """x [BK, BD] scaled by chunk ``chunk``'s decay (GAMMA: 0 none, 1 a scalar, 2 one per row)."""
    if GAMMA == 1:
        x = x * tl.load(gamma_ptr + chunk)
    elif GAMMA == 2:
        x = x * tl.load(gamma_ptr + chunk * K + offs_k, mask=offs_k < K, other=0.0)[:, None]
    return x


@triton.jit
def _blocks_of(pid_d, K, D, BK: tl.constexpr, BD: tl.constexpr):
    """A program's memory rows offs_k and its [K, BD] block of memory columns pid_d (kd, mkd).
    Every tensor is contiguous in its last dims."""
    offs_k = tl.arange(0, BK)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mkd = (offs_k < K)[:, None] & (offs_d < D)[None, :]
    return offs_k, offs_k[:, None] * D + offs_d[None, :], mkd


@triton.jit
def _rows_of(c0, C, K, offs_k, BCS: tl.constexpr):
    """Chunk rows c0 .. c0 + BCS of a [C, K] map (W, A or their gradients): offsets and mask."""
    offs_c = c0 + tl.arange(0, BCS)
    return offs_c[:, None] * K + offs_k[None, :], (offs_c < C)[:, None] & (offs_k < K)[None, :]


@triton.jit
def _carry_kernel(
    w_ptr,
    a_ptr,
    psi_ptr,
    gamma_ptr,
    m0_ptr,
    starts_ptr,
    final_ptr,
    N,
    C,
    K,
    D,
    GAMMA: tl.constexpr,
    BCS: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
):
    pid_d = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_k, kd, mkd = _blocks_of(pid_d, K, D, BK, BD)
    M = tl.load(m0_ptr + bh * K * D + kd, mask=mkd, other=0.0)
    for n in range(0, N):
        chunk = bh * N + n
        tl.store(starts_ptr + chunk * K * D + kd, M, mask=mkd)
        after = _decayed(M, gamma_ptr, chunk, offs_k, K, GAMMA) + tl.load(
            psi_ptr + chunk * K * D + kd, mask=mkd, other=0.0
        )
        for c0 in range(0, C, BCS):
            ck, mck = _rows_of(c0, C, K, offs_k, BCS)
            W = tl.load(w_ptr + chunk * C * K + ck, mask=mck, other=0.0)
            A = tl.load(a_ptr + chunk * C * K + ck, mask=mck, other=0.0)
            after -= _dot(tl.trans(A), _dot(W, M))
        M = after
    tl.store(final_ptr + bh * K * D + kd, M, mask=mkd)


@triton.jit
def _carry_backward_kernel(
    w_ptr,
    a_ptr,
    gamma_ptr,
    starts_ptr,
    dstarts_ptr,
    dfinal_ptr,
    dpsi_ptr,
    dw_ptr,
    da_ptr,
    dgamma_ptr,
    dm0_ptr,
    N,
    C,
    K,
    D,
    BH,
    GAMMA: tl.constexpr,
    BCS: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
):
    pid_d = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_k, kd, mkd = _blocks_of(pid_d, K, D, BK, BD)
    # this column block's share of the column sums dW, dA, dgamma: [D blocks, B * H, N, ...]
    share = pid_d.to(tl.int64) * BH + bh
    G = tl.load(dfinal_ptr + bh * K * D + kd, mask=mkd, other=0.0)
    for back in range(0, N):
        n = N - 1 - back
        chunk = bh * N + n
        M = tl.load(starts_ptr + chunk * K * D + kd, mask=mkd, other=0.0)
        tl.store(dpsi_ptr + chunk * K * D + kd, G, mask=mkd)
        if GAMMA == 1:
            tl.store(dgamma_ptr + share * N + n, tl.sum(tl.sum(M * G, axis=1), axis=0))
        elif GAMMA == 2:
            tl.store(dgamma_ptr + (share * N + n) * K + offs_k, tl.sum(M * G, axis=1), mask=offs_k < K)
        dM = _decayed(G, gamma_ptr, chunk, offs_k, K, GAMMA)
        for c0 in range(0, C, BCS):
            ck, mck = _rows_of(c0, C, K, offs_k, BCS)
            W = tl.load(w_ptr + chunk * C * K + ck, mask=mck, other=0.0)
            A = tl.load(a_ptr + chunk * C * K + ck, mask=mck, other=0.0)
            U = _dot(W, M)
            dU = -_dot(A, G)
            out = (share * N + n) * C * K + ck
            tl.store(da_ptr + out, -_dot(U, tl.trans(G)), mask=mck)
            tl.store(dw_ptr + out, _dot(dU, tl.trans(M)), mask=mck)
            dM += _dot(tl.trans(W), dU)
        G = dM + tl.load(dstarts_ptr + chunk * K * D + kd, mask=mkd, other=0.0)
    tl.store(dm0_ptr + bh * K * D + kd, G, mask=mkd)


def _blocks(K: int, D: int) -> tuple[int, int]:
    """Register block sizes: powers of two, at least 16 (``tl.dot``'s least size)."""
    return max(16, triton.next_power_of_2(K)), max(16, min(BLOCK_D, triton.next_power_of_2(D)))


def _options(gamma: Tensor | None, BK: int, BD: int) -> dict:
    """The constants and launch options both carry kernels take."""
    return dict(GAMMA=_gamma_kind(gamma), BCS=SUB_C, BK=BK, BD=BD, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _gamma_kind(gamma: Tensor | None) -> int:
    """The kernels' GAMMA: 0 for None, 1 for [B, H, N] (a scalar a chunk), 2 for [B, H, N, K] (one per row)."""
    if gamma is None:
        return 0
    return 1 if gamma.dim() == 3 else 2


def _carry_forward(W: Tensor, A: Tensor, Psi: Tensor, gamma: Tensor | None, M0: Tensor) -> tuple[Tensor, Tensor]:
    """The forward kernel's launch: (the memory entering each chunk, the memory after the last)."""
    B, H, N, C, K = W.shape
    D = Psi.shape[-1]
    W, A, Psi, M0 = (x.float().contiguous() for x in (W, A, Psi, M0))
    gamma = None if gamma is None else gamma.float().contiguous()
    starts = W.new_empty(B, H, N, K, D)
    final = W.new_empty(B, H, K, D)
    BK, BD = _blocks(K, D)
    with on_device(W):
        _carry_kernel[(triton.cdiv(D, BD), B * H)](
            W,
            A,
            Psi,
            M0 if gamma is None else gamma,  # unread without a gate
            M0,
            starts,
            final,
            N,
            C,
            K,
            D,
            **_options(gamma, BK, BD),
        )
    return starts, final


def _carry_backward(
    W: Tensor, A: Tensor, gamma: Tensor | None, starts: Tensor, dstarts: Tensor | None, dfinal: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel's launch: dW, dA, dPsi, dgamma (empty without a gate) and dM0."""
    W, A = W.float().contiguous(), A.float().contiguous()
    gamma = None if gamma is None else gamma.float().contiguous()
    B, H, N, C, K = W.shape
    D = starts.shape[-1]
    BK, BD = _blocks(K, D)
    nd = triton.cdiv(D, BD)
    dstarts = torch.zeros_like(starts) if dstarts is None else dstarts.float().contiguous()
    dfinal = starts.new_zeros(B, H, K, D) if dfinal is None else dfinal.float().contiguous()
    dpsi = torch.empty_like(starts)
    dW = W.new_empty(nd, B, H, N, C, K)
    dA = torch.empty_like(dW)
    dgamma = W.new_empty(nd, *(gamma.shape if gamma is not None else (B, H, N)))
    dm0 = torch.empty_like(dfinal)
    with on_device(W):
        _carry_backward_kernel[(nd, B * H)](
            W,
            A,
            dgamma if gamma is None else gamma,  # unread without a gate
            starts,
            dstarts,
            dfinal,
            dpsi,
            dW,
            dA,
            dgamma,
            dm0,
            N,
            C,
            K,
            D,
            B * H,
            **_options(gamma, BK, BD),
        )
    return dW.sum(0), dA.sum(0), dpsi, dgamma.sum(0) if gamma is not None else W.new_empty(0), dm0


class TritonDeltaCarry(torch.autograd.Function):
    """(W, A [B, H, N, C, K], Psi [B, H, N, K, D], gamma [B, H, N] or [B, H, N, K] or None, M0
    [B, H, K, D]) -> (the memory entering each chunk [B, H, N, K, D], the memory after the last
    [B, H, K, D]), M_{n+1} = gamma_n M_n + Psi_n - A_n^T W_n M_n, a per-row gamma scaling each row
    of M; float32 (module docstring)."""

    @staticmethod
    def forward(ctx: Any, W: Tensor, A: Tensor, Psi: Tensor, gamma: Tensor | None, M0: Tensor):
        out = _carry_forward(W, A, Psi, gamma, M0)
        _carry_setup_context(ctx, (W, A, Psi, gamma, M0), out)
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, dstarts: Tensor | None, dfinal: Tensor | None):
        return _carry_gradients(ctx, dstarts, dfinal, _carry_backward)


def _carry_setup_context(ctx, inputs, output):
    W, A, _, gamma, _ = inputs
    ctx.save_for_backward(W, A, gamma, output[0])


def _carry_gradients(ctx, dstarts, dfinal, backward) -> tuple:
    """The inputs' gradients by ``backward`` (the backward launch or its op) from ctx's saved tensors."""
    W, A, gamma, starts = ctx.saved_tensors
    dW, dA, dpsi, dgamma, dm0 = backward(W, A, gamma, starts, dstarts, dfinal)
    return dW, dA, dpsi, None if gamma is None else dgamma, dm0


# The same two launches as custom ops with autograd, which a graph traced by torch.compile calls
# (eager calls keep the Function above: no dispatch on the way).
@torch.library.custom_op("lcsm::triton_delta_carry", mutates_args=())
def _carry_op(W: Tensor, A: Tensor, Psi: Tensor, gamma: Tensor | None, M0: Tensor) -> tuple[Tensor, Tensor]:
    return _carry_forward(W, A, Psi, gamma, M0)


@torch.library.custom_op("lcsm::triton_delta_carry_backward", mutates_args=())
def _carry_backward_op(
    W: Tensor, A: Tensor, gamma: Tensor | None, starts: Tensor, dstarts: Tensor | None, dfinal: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _carry_backward(W, A, gamma, starts, dstarts, dfinal)


@_carry_op.register_fake
def _(W, A, Psi, gamma, M0):
    B, H, N, C, K = W.shape
    D = Psi.shape[-1]
    return W.new_empty(B, H, N, K, D, dtype=torch.float32), W.new_empty(B, H, K, D, dtype=torch.float32)


@_carry_backward_op.register_fake
def _(W, A, gamma, starts, dstarts, dfinal):
    B, H, N, C, K = W.shape
    dgamma = starts.new_empty(gamma.shape if gamma is not None else (0,))
    grads = (W.new_empty(W.shape, dtype=torch.float32), A.new_empty(A.shape, dtype=torch.float32))
    return *grads, torch.empty_like(starts), dgamma, starts.new_empty(B, H, K, starts.shape[-1])


_carry_op.register_autograd(
    lambda ctx, dstarts, dfinal: _carry_gradients(ctx, dstarts, dfinal, _carry_backward_op),
    setup_context=_carry_setup_context,
)


def triton_delta_carry(W: Tensor, A: Tensor, Psi: Tensor, gamma: Tensor | None, M0: Tensor) -> tuple[Tensor, Tensor]:
    """``TritonDeltaCarry`` applied (in a graph traced by torch.compile, the custom op
    ``lcsm::triton_delta_carry``); the returned memories are float32."""
    if torch.compiler.is_compiling():
        # contiguous here, as the launches need them: W and A, saved for the backward, are then no
        # views of the maps' split, whose strides inductor fails to bound (ValueRangeError)
        W, A, Psi = (x.contiguous() for x in (W, A, Psi))
        return _carry_op(W, A, Psi, gamma, M0)
    return TritonDeltaCarry.apply(W, A, Psi, gamma, M0)
