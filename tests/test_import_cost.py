"""Every ``lcsm`` command (and every test that starts one) pays for what importing the engine
imports. Two of torch's modules that only some runs use are left to those runs: dynamo
(torch.compile, 1.3 s) and torch.distributed's checkpoint and DTensor modules (FSDP, 0.7 s)."""

import json
import subprocess
import sys

LEFT_OUT = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor")


def test_importing_the_engine_leaves_out_compile_and_fsdp():
    # one interpreter for all three: each costs a torch import (seconds on 2 cores)
    code = "import json, sys, lcsm.cli, lcsm.engine, lcsm.models, lcsm.ops; "
    code += f"print(json.dumps([m in sys.modules for m in {LEFT_OUT!r}]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = [m for m, flag in zip(LEFT_OUT, json.loads(done.stdout), strict=True) if flag]
    assert imported == [], f"importing lcsm imports {imported}"
