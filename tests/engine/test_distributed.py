"""torchrun with 2 CPU processes (gloo) trains like 1 process with the same global batch (bit for bit
like 1 process with grad_accum 2), and leaves no gloo thread behind."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lcsm.engine import apply_overrides
from lcsm.testing import assert_close

from .conftest import TINY, cli_env, write_config

DDP = apply_overrides(
    TINY,
    {"train.max_steps": 10, "train.batch_size": 16, "run.log_every": 1, "train.eval_every": 5, "train.save_every": 5},
)


def losses(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def test_two_processes_match_one(tmp_path):
    cfg = write_config(tmp_path / "ddp.yaml", DDP)
    env = cli_env(tmp_path)
    one = subprocess.run(
        [sys.executable, "-m", "lcsm", "train", str(cfg), "--out", str(tmp_path / "one")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "lcsm",
            "train",
            str(cfg),
            "--out",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stderr
    assert two.stdout.count("final test metrics of") == one.stdout.count("final test metrics of") == 1
    # Rank 0 alone writes: one metrics file, one line per step.
    (loss1, eval1), (loss2, eval2) = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(loss1) == len(loss2) == 10
    for a, b in zip(loss1, loss2, strict=False):
        assert abs(a - b) <= 1e-5 * abs(a), (loss1, loss2)
    assert [e["step"] for e in eval2] == [5, 10]
    for e1, e2 in zip(eval1, eval2, strict=False):
        assert abs(e1["loss"] - e2["loss"]) <= 1e-5 * e1["loss"]
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "step-00000010" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000010" / "model.safetensors"))
    assert_close(w2, w1, context="2 processes vs 1")
    # Bit for bit, 2 processes are 1 process accumulating the same 2 micro-batches: each rank's
    # gradient is scaled by 2 and DDP halves the sum, both exact. Against grad_accum 1 (above) the
    # summation order differs, and AdamW amplifies the rounding over a longer run (docs/engine.md).
    accum = subprocess.run(
        [sys.executable, "-m", "lcsm", "train", str(cfg), "--out", str(tmp_path / "accum")]
        + ["--set", "train.grad_accum=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert accum.returncode == 0, accum.stderr
    loss_accum, eval_accum = losses(tmp_path / "accum")
    assert loss_accum == loss2 and [e["loss"] for e in eval_accum] == [e["loss"] for e in eval2]
    w_accum = load_file(str(tmp_path / "accum" / "checkpoints" / "step-00000010" / "model.safetensors"))
    assert all(torch.equal(w_accum[k], w2[k]) for k in w2)
    # each rank draws its own random numbers (dropout masks) after the same initial weights
    rng = torch.load(tmp_path / "two" / "checkpoints" / "step-00000010" / "trainer.pt", weights_only=True)["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["cpu"], rng[1]["cpu"])


GLOO_THREADS = """
import os, sys
from lcsm.cli import main
status = main(["train", sys.argv[1], "--out", sys.argv[2], "--quiet"])
tasks = "/proc/self/task"
names = [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)]
with open(os.path.join(sys.argv[3], "gloo-threads-rank" + os.environ["RANK"]), "w") as report:
    report.write(" ".join(sorted(n for n in names if "gloo" in n)))
sys.exit(status)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names come from Linux's /proc")
def test_teardown_leaves_no_gloo_threads(tmp_path):
    """After training under torchrun no gloo thread is left to meet interpreter shutdown, where one
    that still releases a work's tensor aborts the process (seen once in test_two_processes_match_one)."""
    cfg = write_config(tmp_path / "ddp.yaml", apply_overrides(DDP, {"train.max_steps": 2, "train.eval_every": 2}))
    script = tmp_path / "train_and_list_threads.py"
    script.write_text(GLOO_THREADS)
    env = cli_env(tmp_path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(cfg),
            str(tmp_path / "run"),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # one report file a rank: the ranks share stderr, where their lines interleave
    reports = {rank: (tmp_path / f"gloo-threads-rank{rank}").read_text() for rank in (0, 1)}
    assert reports == {0: "", 1: ""}, reports


def test_setup_on_cuda_under_torchrun_reaches_the_process_group(monkeypatch):
    """The cuda branch of Distributed.setup, on a CPU machine: device resolution and the CUDA and
    process-group calls are mocked; the function itself runs as under torchrun on GPUs."""
    import torch

    from lcsm.engine import distributed

    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed, "resolve_device", lambda option, name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: calls.setdefault("backend", backend))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    d = distributed.Distributed.setup("cuda")
    assert calls == {"set_device": torch.device("cuda", 1), "backend": "nccl"}
    assert (d.device, d.rank, d.world) == (torch.device("cuda", 1), 1, 2)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_process_group_the_caller_made_decides_the_ranks(monkeypatch, device):
    """init_process_group before lcsm.engine.train (mp.spawn without torchrun's environment): the
    run read only WORLD_SIZE, so each rank trained the whole run alone. Mocked as above."""
    from lcsm.engine import distributed

    calls = {}
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(distributed, "resolve_device", lambda option, name: torch.device(device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: calls.setdefault("backend", backend))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    d = distributed.Distributed.setup(device)
    expected = torch.device("cuda", 3) if device == "cuda" else torch.device("cpu")
    assert (d.device, d.rank, d.world, d.enabled) == (expected, 1, 2, True)
    assert "backend" not in calls and not d._owns_group  # the caller's group, left to the caller
