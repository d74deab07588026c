"""Compile every variant of the Triton kernels of ``lcsm/ops/triton_chunk.py`` for sm_90 (H100 / H200)
on a machine without a GPU, and report ptxas's registers and spills for each: a check that the
kernels compile, and the evidence behind their launch shapes (``NUM_WARPS``, ``STAGES_*``), before
a GPU is at hand. Nothing is run or timed.

    TRITON_INTERPRET=0 python -m bench.triton_registers [--out FILE]

Needs triton with its NVIDIA backend (ptxas ships with it); K = D = 128, BT = 64.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("TRITON_INTERPRET is set: the kernels would be interpreter functions; run with TRITON_INTERPRET=0")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lcsm.ops import triton_chunk as tc  # noqa: E402

OUTPUT_POINTERS = {"s_ptr", "e_ptr", "i_ptr", "g_ptr", "states_ptr", "y_ptr"}
STATES_POINTERS = {"e_ptr", "i_ptr", "g_ptr", "m0_ptr", "states_ptr", "final_ptr", "strict_ptr"}
DECAYS = {0: "none", 1: "scalar", 2: "row", 3: "col"}


def ptxas_report(fn, constexprs: dict, pointers: set, num_warps: int, num_stages: int) -> str:
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else "*fp32" if n in pointers else "i32" for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return "; ".join(
        line.split(":", 1)[-1].strip() for line in out.stderr.splitlines() if "registers" in line or "spill" in line
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    lines = [
        f"# ptxas for sm_90: lcsm/ops/triton_chunk.py (triton {triton.__version__}; K = D = 128, BT = 64)",
        "",
        f"`TRITON_INTERPRET=0 python -m bench.triton_registers`; {tc.NUM_WARPS} warps, "
        f"{tc.STAGES_OUTPUT} / {tc.STAGES_STATES} pipeline stages (output / states kernel).",
        "",
        "| kernel | decay | operands | ptxas |",
        "| --- | --- | --- | --- |",
    ]
    for decay, name in DECAYS.items():
        for bf16 in (True, False):
            dtype = "bfloat16" if bf16 else "float32"
            out = ptxas_report(
                tc._output_kernel,
                dict(DECAY=decay, STRICT=1, BT=64, BC=tc.SUB, BK=128, BD=tc.BLOCK_D, BF16=bf16),
                OUTPUT_POINTERS,
                tc.NUM_WARPS,
                tc.STAGES_OUTPUT,
            )
            lines.append(f"| output | {name} | {dtype} | {out} |")
            states = ptxas_report(
                tc._states_kernel,
                dict(DECAY=decay, HAS_M0=True, STRICT_FINAL=True, BT=64, BK=tc.BLOCK_K, BD=tc.BLOCK_D, BF16=bf16),
                STATES_POINTERS,
                tc.NUM_WARPS,
                tc.STAGES_STATES,
            )
            lines.append(f"| states | {name} | {dtype} | {states} |")
            print(lines[-2], lines[-1], sep="\n", flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
