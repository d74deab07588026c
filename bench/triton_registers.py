"""Compile every variant of lcsm's Triton kernels (``lcsm/ops/triton_chunk.py``: the chunk form's
states and output kernels, packed or not; ``lcsm/ops/triton_delta.py``: the delta-rule carry,
forward and backward; ``lcsm/ops/triton_scan.py``: the selective scan, forward and backward, packed
or not) for sm_90 (H100 / H200) on a machine without a GPU, and report ptxas's
registers and spills for each: a check that the kernels compile for the device (Triton's
interpreter, which the tests use, accepts programs the compiler refuses) and the evidence behind
their launch shapes (``WARPS_*``, ``STAGES_*``, ``NUM_*``), before a GPU is at hand. Nothing is run or timed.

    TRITON_INTERPRET=0 python -m bench.triton_registers [--only REGEX] [--out FILE]

Needs triton with its NVIDIA backend (ptxas ships with it); K = D = 128, BT = 64, C = 64; the scan at
Mamba's shape (one head, K = N = 16, D = d_inner = 1536).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("TRITON_INTERPRET is set: the kernels would be interpreter functions; run with TRITON_INTERPRET=0")

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench._common import provenance_header  # noqa: E402
from lcsm.ops import triton_chunk as tc  # noqa: E402
from lcsm.ops import triton_delta as td  # noqa: E402
from lcsm.ops import triton_scan as ts  # noqa: E402

INT_TABLES = {"first_ptr", "last_ptr", "limits_ptr"}  # the packed layout's tables, the strict kernel's limits
DECAYS = {0: "none", 1: "scalar", 2: "row", 3: "col"}
GAMMAS = {0: "none", 1: "scalar", 2: "row"}
# The shape the reports are for: B 1, H 16, T 32768, K = D = 128, chunks of BT = C = 64; the scan's
# Mamba's (130M: d_inner 1536, N 16, one head).
H, T, K, D, BT = 16, 32768, 128, 128, 64
SCAN_K, SCAN_D = 16, 1536


def chunk_ints(decay: int) -> dict[str, int]:
    """The chunk kernels' integer arguments at that shape, the inputs [B, T, H, X] as ``eos``
    passes them (a step's stride H * X, the features' 1) and the logs G as ``cumulative`` makes
    them (contiguous [B, H, T, X], X = K for a row decay, D for a column decay; a scalar decay's
    [B, H, T] with stride 0 over X; no decay's [B, H, T, 1])."""
    ints = dict(T=T, H=H, K=K, D=D, N=T // BT)
    for prefix, width in (("ss", K), ("se", K), ("si", D)):
        ints.update({f"{prefix}_b": T * H * width, f"{prefix}_h": width, f"{prefix}_t": H * width})
    ints.update(ss_k=1, se_k=1, si_d=1)
    X = {0: 1, 1: 1, 2: K, 3: D}[decay]
    ints.update(sg_b=H * T * X, sg_h=T * X, sg_t=X, sg_x=0 if decay == 1 else 1)
    return ints


def carry_ints() -> dict[str, int]:
    """The delta-rule carry's integer arguments at that shape."""
    return dict(N=T // BT, C=BT, K=K, D=D, BH=H)


def scan_ints(rows: bool) -> dict[str, int]:
    """The selective scan's integer arguments at Mamba's shape, its operands as Mamba's layer passes
    them ([B, T, 1, X] permuted to [B, 1, T, X]; Delta [B, T, 1, 1, D] or a full [B, T, 1, K, D]; A^T
    [1, K, D]; the states [B, 1, K, D])."""
    K_, D_ = SCAN_K, SCAN_D
    ints = dict(T=T, B=1, H=1, K=K_, D=D_)
    for prefix, width in (("sx", D_), ("se", K_), ("ss", K_)):
        ints.update({f"{prefix}_b": T * width, f"{prefix}_h": width, f"{prefix}_t": width})
    a_step = K_ * D_ if rows else D_
    ints.update(sa_b=T * a_step, sa_h=a_step, sa_t=a_step, sa_k=D_ if rows else 0)
    ints.update(sb_h=K_ * D_, sb_k=D_, s0_doc=K_ * D_, s0_h=K_ * D_, s0_k=D_)
    ints.update(L=T, S=1)  # one segment; the segmented variants' S and L are integers alike
    return ints


def ptxas(fn, constexprs: dict, ints: dict[str, int], num_warps: int, num_stages: int) -> str:
    """ptxas's register and spill report of ``fn`` compiled for sm_90 with these constexprs, its
    other arguments specialised as a launch specialises them (Triton's own rule, the one its JIT
    applies: an integer 1 becomes a constant, integers and pointers divisible by 16 are marked so):
    ``ints`` for the integers, float32 pointers (int32 for the packed tables and the limits)."""
    names = fn.arg_names
    signature, constants, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            table = torch.int64 if name == "doc_ptr" else torch.int32  # the scan's documents are int64
            example = torch.zeros(1, dtype=table if name in INT_TABLES | {"doc_ptr"} else torch.float32)
        else:
            example = ints[name]
        kind, hint = native_specialize_impl(BaseBackend, example, False, True, True)[:2]
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = example
        elif hint:
            attrs[(index,)] = BaseBackend.parse_attr(hint)
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs
    )
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    binary = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run(
            [str(binary), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return "; ".join(
        line.split(":", 1)[-1].strip() for line in out.stderr.splitlines() if "registers" in line or "spill" in line
    )


def variants():
    """(kernel, variant, operands, function, constexprs, integer arguments, warps, stages) for every
    variant."""
    for decay, name in DECAYS.items():
        for bf16 in (True, False):
            dtype = "bfloat16" if bf16 else "float32"
            yield (
                "output",
                name,
                dtype,
                tc._output_kernel,
                dict(
                    DECAY=decay,
                    STRICT=1,
                    BT=64,
                    BC=tc.SUB,
                    BK=128,
                    BD=tc.BLOCK_D_COL_FLOAT32 if name == "col" and not bf16 else tc.BLOCK_D,
                    BF16=bf16,
                    BKD=tc.DIAGONAL_K,
                ),
                chunk_ints(decay),
                tc.WARPS_OUTPUT,
                tc.STAGES_OUTPUT,
            )
            for packed in (False, True):
                yield (
                    "states, packed" if packed else "states",
                    name,
                    dtype,
                    tc._states_kernel,
                    dict(DECAY=decay, HAS_M0=True, PACKED=packed, BT=64, BK=tc.BLOCK_K, BD=tc.BLOCK_D, BF16=bf16),
                    chunk_ints(decay),
                    tc.WARPS_STATES,
                    tc.STAGES_STATES,
                )
            for packed in (False, True) if decay else ():
                yield (
                    "strict, packed" if packed else "strict",
                    name,
                    dtype,
                    tc._strict_final_kernel,
                    dict(DECAY=decay, PACKED=packed, BT=64, BK=tc.BLOCK_K, BD=tc.BLOCK_D, BF16=bf16),
                    chunk_ints(decay),
                    tc.WARPS_STATES,
                    tc.STAGES_STATES,
                )
    for gamma, name in GAMMAS.items():
        for kernel, fn in (("delta carry", td._carry_kernel), ("delta carry backward", td._carry_backward_kernel)):
            constexprs = dict(GAMMA=gamma, BCS=td.SUB_C, BK=128, BD=td.BLOCK_D)
            yield kernel, name, "float32", fn, constexprs, carry_ints(), td.NUM_WARPS, td.NUM_STAGES
    # the scan's kernels: one segment (packed or not), and for Mamba's product the segmented
    # launches (each segment's summary, then the kernel from the carried values) and the carry
    segmented = [(False, False), (True, True), (True, False)]
    for rows in (False, True):
        decay = "full" if rows else "product"
        for packed in (False, True):
            for seg, summary in segmented if not (rows or packed) else segmented[:1]:
                for backward in (False, True):
                    fn = ts._scan_backward_kernel if backward else ts._scan_forward_kernel
                    flags = {"HAS_DMT": True} if backward else {"KEEP": not summary}
                    shape = dict(BT=ts.STEPS, KP=SCAN_K, BD=ts.columns(SCAN_K, SCAN_D, backward))
                    constexprs = dict(A_ROWS=rows, HAS_M0=True, PACKED=packed, SEGMENTED=seg, SUMMARY=summary)
                    kind = ", packed" if packed else ", segment summary" if summary else ", segmented" if seg else ""
                    name = ("scan backward" if backward else "scan") + kind
                    warps = ts.WARPS_BACKWARD if backward else ts.WARPS
                    yield name, decay, "float32", fn, {**constexprs, **flags, **shape}, scan_ints(rows), warps, 1
    carry = dict(REVERSE=True, KP=SCAN_K, BD=ts.columns(SCAN_K, SCAN_D))
    yield "scan carry", "product", "float32", ts._carry_kernel, carry, dict(S=17, K=SCAN_K, D=SCAN_D), ts.WARPS, 1


def _tf32(x):
    """x rounded to TF32 (10 mantissa bits, to nearest even), as a float32 tensor."""
    bits = x.view(torch.int32)
    return ((bits + ((bits >> 13) & 1) + 0xFFF) & ~0x1FFF).view(torch.float32)


def precision_lines(trials: int = 8) -> list[str]:
    """The float32 kernels' products (``tf32x3``: three TF32 products, high * high + high * low +
    low * high) emulated on the CPU against float32's and one TF32 product's, on [64, K] @ [K, 64]
    standard normal operands: the relative RMS error against float64, the mean over ``trials``."""
    lines = [
        "## The float32 kernels' products, emulated",
        "",
        f"Relative RMS error against float64 of a [64, K] @ [K, 64] product, standard normal operands, the mean of "
        f"{trials} draws (TF32 as round to nearest even at 10 mantissa bits; the device rounds ties away):",
        "",
        "| K | float32 | tf32x3 | tf32 |",
        "| --- | --- | --- | --- |",
    ]
    gen = torch.Generator().manual_seed(0)
    for K in (64, 128, 256):
        errors = {"float32": 0.0, "tf32x3": 0.0, "tf32": 0.0}
        for _ in range(trials):
            a, b = torch.randn(64, K, generator=gen), torch.randn(K, 64, generator=gen)
            exact = a.double() @ b.double()
            ah, bh = _tf32(a), _tf32(b)
            al, bl = _tf32(a - ah), _tf32(b - bh)
            for name, got in (("float32", a @ b), ("tf32x3", ah @ bh + (ah @ bl + al @ bh)), ("tf32", ah @ bh)):
                errors[name] += ((got.double() - exact).norm() / exact.norm()).item() / trials
        lines.append(f"| {K} | " + " | ".join(f"{errors[n]:.2e}" for n in ("float32", "tf32x3", "tf32")) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="", help="only the variants whose 'kernel decay operands' matches this regular expression"
    )
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    header = provenance_header("TRITON_INTERPRET=0 python -m bench.triton_registers", argv, 1, args.out)
    lines = [
        f"# ptxas for sm_90: lcsm's Triton kernels (triton {triton.__version__}; B 1, H {H}, T {T}, K = D = {K}, "
        f"BT = C = {BT})",
        "",
        *(f"- {k}: {v}" for k, v in header.items()),
        "",
        "The launch shapes are the modules' own "
        f"(triton_chunk: {tc.WARPS_OUTPUT} / {tc.WARPS_STATES} warps and {tc.STAGES_OUTPUT} / {tc.STAGES_STATES} "
        f"pipeline stages for the output / states and strict kernels, the output kernel's {tc.BLOCK_D} columns "
        f"({tc.BLOCK_D_COL_FLOAT32} for a float32 column decay) and diagonal key blocks of {tc.DIAGONAL_K}; "
        f"triton_delta: {td.NUM_WARPS} warps, {td.NUM_STAGES} stage, {td.BLOCK_D} columns; triton_scan: "
        f"blocks of {ts.STEPS} steps, {ts.WARPS} / {ts.WARPS_BACKWARD} warps and {ts.columns(SCAN_K, SCAN_D)} / "
        f"{ts.columns(SCAN_K, SCAN_D, True)} columns forward / backward at K = {SCAN_K}, D = {SCAN_D}).",
        "",
        "| kernel | decay | operands | warps | stages | ptxas |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kernel, decay, dtype, fn, constexprs, ints, warps, stages in variants():
        if not re.search(args.only, f"{kernel} {decay} {dtype}"):
            continue
        lines.append(
            f"| {kernel} | {decay} | {dtype} | {warps} | {stages} | {ptxas(fn, constexprs, ints, warps, stages)} |"
        )
        print(lines[-1], flush=True)
    precision = precision_lines()
    print("", *precision, sep="\n")
    lines += ["", *precision]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
