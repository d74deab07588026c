"""fla's autotuning ahead of the benchmark: ``bench/gpu.sh`` runs this in the background during the
test step (the tests leave the device mostly idle), under a timeout, and waits for it before
``bench/gpu_bench.py``.

fla 0.6 autotunes each of its Triton kernels at its first call in a process, for each tuning key
(the tensors' dtypes, head counts and widths, in some kernels the batch), and has Triton keep the
winners on disk (``cache_results``, on unless FLA_CACHE_RESULTS=0), keyed by the kernel's source,
the key and the configurations tried: a later process calling with the same key skips the tuning.
This makes the first calls of gpu_bench's fla pass and of ``bench/gpu_peers.py`` at their own
shapes: each fla op's forward + backward at the benchmark's B, H, K and fla length in ``--dtypes``
(gpu_bench's ``--fla-dtypes``); gpu_peers' GatedDeltaNet2 cases; a forward + backward of each of
fla's models (``--models``) at the benchmark's width, batch and length, in one layer (every layer
calls its kernels with the same keys). Each item prints its time, or its exception (the next item
runs); a timeout keeps the winners stored so far.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from bench import gpu_bench, gpu_peers


def items(args) -> Iterator[tuple[str, Callable[[], object]]]:
    for dname in args.dtypes:
        for op in gpu_bench.OPS:
            shape = (op, args.length, getattr(torch, dname), args.batch, args.heads, args.dim)

            def op_step(op=op, shape=shape):
                gpu_bench.fwd_bwd(lambda x: gpu_bench.fla_op(op, x), gpu_bench.op_inputs(*shape))()

            yield f"{op} {dname} T={args.length}", op_step
    for name, layers in gpu_peers.gdn2_cases():
        yield f"gpu_peers {name}", lambda name=name, layers=layers: list(gpu_peers.check(name, *layers()))
    for model in args.models:

        def model_step(model=model):
            lm = gpu_bench.fla_lm(model, args.model_dim, 1, args.vocab).cuda()
            tokens = torch.randint(0, args.vocab, (args.train_batch, args.train_len + 1), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = lm(tokens[:, :-1]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()

        yield f"fla {model} model (1 layer)", model_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fla_warmup", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", type=lambda s: [d for d in s.split(",") if d], default=["bfloat16"])
    p.add_argument("--length", type=int, default=gpu_bench.TARGET_LENGTHS[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--models", type=lambda s: [m for m in s.split(",") if m], default=["gla", "gated_deltanet"])
    p.add_argument("--model-dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-len", type=int, default=2048)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fla_warmup.py: no CUDA device (fla's kernels run on GPUs only)", file=sys.stderr)
        return 1
    start = time.perf_counter()
    for label, run in items(args):
        t0 = time.perf_counter()
        try:
            run()
            torch.cuda.synchronize()
            print(f"{label}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:
            print(f"{label}: failed after {time.perf_counter() - t0:.1f} s: {exc!r}", flush=True)
    print(f"fla_warmup: done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
