"""Every ``lcsm`` command (and every test that starts one) pays for what importing the engine
imports. Two of torch's modules that only some runs use are left to those runs: dynamo
(torch.compile, 1.3 s) and torch.distributed's checkpoint and DTensor modules (FSDP, 0.7 s)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor"])
def test_importing_the_engine_leaves_out(module):
    code = f"import sys, lcsm.cli, lcsm.engine, lcsm.models, lcsm.ops; print({module!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", f"importing lcsm imports {module}"
