"""Which registered mixers compile whole: ``torch.compile(fullgraph=True, dynamic=True)`` of each
mixer's forward and backward, two sequence lengths through one graph, compared with eager
(docs/compile.md):

    python -m bench.compile_survey [--backend aot_eager] [--timeout 600] [--out FILE] [MIXER...]

Each mixer runs in its own process (a failing or hanging trace cannot take the survey down) at
d_model 16, batch 2, T 19 then 29 under ``error_on_recompile``: a mixer passes when both lengths
run through one graph and the output and every gradient (input and parameters) equal eager to
the float32 tolerance. A mixer that traces whole but recompiles for the second length is run
again with ``dynamic=False`` (one graph per length) and marked so. aot_eager traces what inductor
would compile without its code generation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench._common import REPO, provenance_header, write_out

D_MODEL, LENGTHS = 16, (19, 29)


def _worker(name: str, backend: str) -> dict:
    import torch
    import torch._dynamo

    from lcsm import layers
    from lcsm.testing import assert_close, gradients

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mixer = layers.build(name, D_MODEL)
    params = dict(mixer.named_parameters())

    def run(compiled) -> None:
        for T in LENGTHS:
            x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(T)).requires_grad_()
            wrt = {"x": x, **params}
            assert_close(gradients({"y": compiled(x)}, wrt), gradients({"y": mixer(x)}, wrt), context=f"T={T}")

    start = time.perf_counter()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            run(torch.compile(mixer, fullgraph=True, dynamic=True, backend=backend))
        return {"ok": True, "seconds": time.perf_counter() - start}
    except torch._dynamo.exc.RecompileError as err:
        # Whole graphs, but the length is baked in (a Python loop over chunks): one graph per T.
        torch._dynamo.reset()
        start = time.perf_counter()
        run(torch.compile(mixer, fullgraph=True, dynamic=False, backend=backend))
        return {"ok": True, "per_length": True, "seconds": time.perf_counter() - start, "error": str(err)}


def _survey(name: str, backend: str, timeout: float) -> dict:
    code = (
        "import json, sys; from bench.compile_survey import _worker\n"
        "try:\n"
        f"    r = _worker({name!r}, {backend!r})\n"
        "except Exception as err:\n"
        "    r = {'ok': False, 'error': type(err).__name__ + ': ' + str(err)}\n"
        "print('RESULT ' + json.dumps(r))\n"
    )
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no result within {timeout:.0f} s", "seconds": time.perf_counter() - start}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"worker exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _first_line(text: str, width: int = 160) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return (line[: width - 1] + "…" if len(line) > width else line).replace("|", "\\|")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mixers", nargs="*", help="mixer names (default: every registered mixer)")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mixer")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from lcsm import layers

    names = args.mixers or layers.available()
    unknown = sorted(set(names) - set(layers.available()))
    if unknown:
        parser.error(f"unknown mixers {unknown}; registered: {', '.join(layers.available())}")
    argv = sys.argv[1:] if argv is None else argv
    header = provenance_header("python -m bench.compile_survey", argv, 1, args.out)
    rows = []
    for name in names:
        result = _survey(name, args.backend, args.timeout)
        verdict = ("one graph per T" if result.get("per_length") else "yes") if result["ok"] else "no"
        print(f"{name}: {verdict} {result.get('error', '')}", flush=True)
        seconds = f"{result['seconds']:.0f}" if "seconds" in result else ""
        rows.append(f"| `{name}` | {verdict} | {seconds} | {_first_line(result.get('error', ''))} |")
    passed = sum(r.split("|")[2].strip() == "yes" for r in rows)
    per_length = sum(r.split("|")[2].strip() == "one graph per T" for r in rows)
    text = "\n".join(
        [
            f"# Mixers under torch.compile(fullgraph=True, dynamic=True), backend {args.backend}",
            "",
            *(f"- {k}: {v}" for k, v in header.items()),
            "",
            f"Forward and backward at d_model {D_MODEL}, batch 2, T {LENGTHS[0]} then {LENGTHS[1]} through one graph, "
            "output and every gradient against eager (float32 tolerance). "
            f"**{passed} of {len(rows)} compile whole with a symbolic T; {per_length} more compile whole with "
            "one graph per T** (dynamic=False: the length is fixed in the graph, e.g. by a loop over chunks; "
            "each new length compiles again; the error column then gives the recompile reason). "
            "Seconds: both lengths, tracing included.",
            "",
            "| mixer | compiles whole | s | first error line |",
            "|---|---|---:|---|",
            *rows,
            "",
        ]
    )
    write_out(text, args.out, print)


if __name__ == "__main__":
    main()
