"""Peer agreement on a GPU: fla's official layers, whose kernels are Triton-only, run on CUDA with
the weights of the lcsm layer, against the lcsm layer in float64 on the CPU (``bench/gpu.sh``).

Each case prints the relative RMS error of the output and of the input's gradient (fla's chunk
kernels, training mode), of the output in eval mode (fla's fused recurrent kernel), and of a
packed row of three documents (``cu_seqlens``), each row printed as soon as it is computed. fla's
first call of each kernel autotunes it, so a case takes tens of seconds on a fresh machine (less
where ``bench/fla_warmup.py`` ran first). A case that fails, fla's import or its layer's
constructor included, prints a "failed" row and its traceback on stderr, and the next case runs.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator

import torch

from lcsm.layers import build
from lcsm.testing import rel_rms


def gdn2_cases() -> Iterator[tuple[str, Callable[[], tuple[torch.nn.Module, torch.nn.Module]]]]:
    """(name, factory of (lcsm's layer, fla's)) pairs: fla is imported, and both layers built, only
    when a case's factory is called, inside that case's ``try``."""

    def layers(lcsm_opts: dict, fla_opts: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
        from fla.layers.gdn2 import GatedDeltaNet2

        ours = build("gdn2", 64, num_heads=2, **lcsm_opts)
        return ours, GatedDeltaNet2(hidden_size=64, head_dim=32, num_heads=2, **fla_opts)

    yield "gdn2", lambda: layers({}, {})
    opts = {"num_v_heads": 4, "expand_v": 2.0}
    yield (
        "gdn2 (4 value heads, negative eigenvalues)",
        lambda: layers({"negative_eigenvalues": True, **opts}, {"allow_neg_eigval": True, **opts}),
    )


# fla names the output norm's weight "o_norm.weight"; lcsm's gdn2 holds it as "o_norm".
RENAME = {"o_norm": "o_norm.weight"}


def check(name: str, ours: torch.nn.Module, theirs: torch.nn.Module) -> Iterator[str]:
    torch.manual_seed(0)
    ours = ours.double()
    with torch.no_grad():  # move every parameter off its init so that none sits at a special value
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    theirs = theirs.cuda().float()
    theirs.load_state_dict({RENAME.get(k, k): v.float() for k, v in ours.state_dict().items()}, strict=True)
    x = torch.randn(2, 150, 64, dtype=torch.float64)
    x_dev = x.float().cuda().requires_grad_()
    x_ref = x.clone().requires_grad_()
    y_dev, y_ref = theirs(x_dev)[0], ours(x_ref)
    cotangent = torch.randn_like(y_ref)
    y_dev.backward(cotangent.float().cuda())
    y_ref.backward(cotangent)
    yield f"| {name} | chunk: output | {rel_rms(y_dev.double().cpu(), y_ref.detach()):.1e} |"
    yield f"| {name} | chunk: input gradient | {rel_rms(x_dev.grad.double().cpu(), x_ref.grad):.1e} |"
    theirs.eval()
    with torch.no_grad():
        y_rec = theirs(x[:, :40].float().cuda())[0].double().cpu()
        yield f"| {name} | fused recurrent (eval): output | {rel_rms(y_rec, ours(x[:, :40])):.1e} |"
        cu = torch.tensor([0, 37, 38, 150])
        y_packed = theirs(x[:1].float().cuda(), cu_seqlens=cu.cuda().int())[0].double().cpu()
        yield f"| {name} | packed, 3 documents: output | {rel_rms(y_packed, ours(x[:1], cu_seqlens=cu)):.1e} |"


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/gpu_peers.py: no CUDA device", file=sys.stderr)
        return 1
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    print(f"fla layers on {torch.cuda.get_device_name()} (float32) against lcsm (float64, CPU), same weights\n")
    print("| layer | what | relative RMS |\n| --- | --- | --- |")
    for name, layers in gdn2_cases():
        try:
            for row in check(name, *layers()):
                print(row, flush=True)
        except Exception as exc:
            traceback.print_exc()
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:150]} | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
