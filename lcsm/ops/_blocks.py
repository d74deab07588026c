"""Blocks of time steps sized to a CPU's cache, shared by the kernels that run their steps in
blocks: the chunk mode's elementwise kernel (``chunk_scan``) and ``log_sigmoid_product``
(``decay``)."""

from __future__ import annotations

import torch

# Cache budget of one block of [B, H, K, D] tensors on a CPU (``block_steps``): 1 MiB, about a
# core's share of a server CPU's cache.
BLOCK_BYTES = 1 << 20


def block_steps(B: int, H: int, K: int, D: int, dtype: torch.dtype, device: torch.device, c: int) -> int:
    """Steps per block of a chunk of c steps (see ``chunk_scan.scan_chunk``): on a CPU as many
    [B, H, K, D] tensors as fit in BLOCK_BYTES, at least one; elsewhere the whole chunk, the form
    the project's GPU runs used, since there each operation is a kernel launch whose fixed cost
    dominates at these sizes and per-step blocks would multiply the launches."""
    if device.type != "cpu":
        return c
    step = B * H * K * D * torch.empty((), dtype=dtype).element_size()
    return min(c, max(1, BLOCK_BYTES // step))
