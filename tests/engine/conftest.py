"""Tiny runs for the engine tests: MQAR at vocab 32, length 16, two key-value pairs."""

import os
import subprocess
import sys

import pytest
import yaml

TINY = {
    "task": {
        "name": "mqar",
        "vocab_size": 32,
        "train_grid": "16:2",
        "test_grid": "16:2",
        "train_examples": 128,
        "test_examples": 32,
    },
    "model": {"mixer": "gla", "d_model": 16, "n_layers": 1},
    "optim": {"lr": 3.0e-3, "warmup_steps": 2},
    "train": {"max_steps": 12, "batch_size": 8, "eval_every": 6, "save_every": 4},
    "run": {"log_every": 2, "threads": 1},
}


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """Task data cached under the test's own directory (never the user's cache)."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    return tmp_path


def write_config(path, values):
    path.write_text(yaml.safe_dump(values))
    return path


def cli_env(env_dir):
    """The environment of a test's ``lcsm`` subprocess: the task cache and temporary files under
    ``env_dir`` (torchrun leaves a log directory in the temporary directory of every launch), one
    thread."""
    tmp = env_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "LCSM_CACHE": str(env_dir / "cache"), "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def run_cli(args, env_dir, **kwargs):
    """``python -m lcsm ARGS`` in a subprocess with ``cli_env(env_dir)``."""
    return subprocess.run(
        [sys.executable, "-m", "lcsm", *args],
        env=cli_env(env_dir),
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )
