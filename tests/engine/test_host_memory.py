"""run.host_allocator: "retain" keeps freed host memory for reuse; it is validated, recorded and
not part of the training config. lcsm train retains by default, the library only when asked."""

import json
import os
import platform
import subprocess
import sys

import pytest

from lcsm.engine import RunConfig, apply_overrides, host_memory, load_config, train

from .conftest import TINY, run_cli, write_config

# Ten 64 MB blocks, each above glibc's largest mmap threshold (32 MB), allocated and freed in turn,
# after one more whose pages grow the heap under either setting.
FAULTS = """
import resource, sys, torch
from lcsm.engine.host_memory import use_host_allocator
print(use_host_allocator(sys.argv[1]))
torch.ones(1)
torch.empty(16 * 2**20).fill_(1.0)  # one block first: its pages are the heap's growth, not reuse
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(16 * 2**20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(choice):
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, choice],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    record, faults = done.stdout.split("\n")[:2]
    return record, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the retain setting acts on glibc's malloc")
def test_retain_reuses_freed_pages_that_system_faults_in_again():
    record, retained = page_faults("retain")
    assert record.startswith("retain (glibc")
    system_record, system = page_faults("system")
    assert system_record == "system"
    block_pages = 64 * 2**20 // 4096
    assert system > 8 * block_pages  # every block paged in afresh
    assert retained < 3 * block_pages  # the first blocks' pages, then reused


def test_host_allocator_is_checked_and_leaves_the_training_config_alone(tmp_path):
    values = apply_overrides(TINY, {"out_dir": str(tmp_path / "run")})
    default = RunConfig.from_dict(values)
    assert default.run.host_allocator == "system"  # the library's; lcsm train's is retain
    system = RunConfig.from_dict(apply_overrides(values, {"run.host_allocator": "system"}))
    assert system.training_dict() == default.training_dict()  # same run id, resumable either way
    with pytest.raises(ValueError, match=r"run.host_allocator: expected one of 'retain', 'system', got 'jemalloc'"):
        RunConfig.from_dict(apply_overrides(values, {"run.host_allocator": "jemalloc"}))


def test_retain_changes_no_number(cache_env):
    """The same run under either setting ends with the same metrics, to the bit: nothing reads the
    stale contents that reused memory holds (fresh mmap pages are zeros)."""
    config = write_config(cache_env / "tiny.yaml", {**TINY, "model": {**TINY["model"], "mixer": "lcsm:1-1-1-0"}})
    results = {}
    for choice in ("system", "retain"):
        done = run_cli(
            [
                "train",
                str(config),
                "--quiet",
                "--out",
                str(cache_env / choice),
                "--set",
                f"run.host_allocator={choice}",
            ],
            cache_env,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads((cache_env / choice / "result.json").read_text())
        applied = choice if platform.libc_ver()[0] == "glibc" else "system"
        assert result["machine"]["host_allocator"].split()[0] == applied
        results[choice] = result
    assert results["retain"]["metrics"] == results["system"]["metrics"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the retain setting acts on glibc's malloc")
def test_system_after_retain_says_the_process_keeps_retain():
    from lcsm.engine.host_memory import use_host_allocator

    assert use_host_allocator("retain").startswith("retain (glibc")
    assert use_host_allocator("system") == "retain (set earlier in this process, which keeps it)"


def test_the_library_leaves_the_callers_malloc_alone_unless_asked(cache_env, monkeypatch):
    """A notebook that imports lcsm and trains keeps its malloc: mallopt holds for the rest of the
    process, which is the caller's, not lcsm's."""
    calls = []

    class NoCtypes:
        c_int = int

        @staticmethod
        def CDLL(*args, **kwargs):
            calls.append(args)
            raise AssertionError("mallopt reached")

    monkeypatch.setattr(host_memory, "ctypes", NoCtypes)
    train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "run")}), quiet=True)
    assert calls == []


def test_lcsm_train_retains_by_default_and_the_config_has_the_last_word(cache_env):
    from lcsm.cli.train import TRAIN_DEFAULTS

    config = write_config(cache_env / "tiny.yaml", apply_overrides(TINY, {"train.max_steps": 1}))
    assert load_config(config, defaults=TRAIN_DEFAULTS).run.host_allocator == "retain"
    assert load_config(config, ["run.host_allocator=system"], defaults=TRAIN_DEFAULTS).run.host_allocator == "system"
    own = write_config(cache_env / "own.yaml", apply_overrides(TINY, {"run.host_allocator": "system"}))
    assert load_config(own, defaults=TRAIN_DEFAULTS).run.host_allocator == "system"
    # an older config's train.host_allocator is its run.host_allocator, and has the last word too
    old = write_config(cache_env / "old.yaml", apply_overrides(TINY, {"train.host_allocator": "system"}))
    assert load_config(old, defaults=TRAIN_DEFAULTS).run.host_allocator == "system"
    assert load_config(config, ["train.host_allocator=system"], defaults=TRAIN_DEFAULTS).run.host_allocator == "system"
    no_run = write_config(cache_env / "no_run.yaml", {k: v for k, v in TINY.items() if k != "run"})
    assert load_config(no_run, defaults=TRAIN_DEFAULTS).run.host_allocator == "retain"
    done = run_cli(["train", str(config), "--quiet", "--out", str(cache_env / "run")], cache_env)
    assert done.returncode == 0, done.stderr
    applied = json.loads((cache_env / "run" / "result.json").read_text())["machine"]["host_allocator"]
    assert applied.split()[0] == ("retain" if platform.libc_ver()[0] == "glibc" else "system")
