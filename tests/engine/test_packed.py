"""A packed lm run (``task.packing: true``): a training step's loss is the mean over its documents
each run alone, a resumed run is bit-exact, and a packed task asks for a causal model."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lcsm.engine import RunConfig, apply_overrides, evaluate, load_run, train
from lcsm.engine.trainer import Trainer
from lcsm.tasks import IGNORE_INDEX
from lcsm.tasks.base import packed_cu_seqlens

from .conftest import TINY, cli_env, write_config
from .test_resume import assert_identical, died_after_step, final_weights, metric_rows


def packed_run(corpus, **overrides):
    """TINY's model and schedule on the lm task over ``corpus`` (documents of about 40 bytes, so
    rows of 32 tokens hold several), packed."""
    task = {
        "name": "lm",
        "corpus": f"path:{corpus}",
        "seq_len": 32,
        "validation_fraction": 0.2,
        "test_fraction": 0.2,
        "packing": True,
    }
    return apply_overrides({**TINY, "task": task}, {"run.keep_last": 10, **overrides})


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for d in range(40):
        (root / f"doc{d:03d}.txt").write_text(f"the sea was calm {d} and the ship sailed on [{d}]")
    return root


def test_a_packed_step_loss_is_the_mean_over_documents_alone(cache_env, corpus):
    trainer = Trainer(RunConfig.from_dict({**packed_run(corpus), "out_dir": str(cache_env / "run")}), quiet=True)
    trainer.model.double()  # the optimizer holds the same parameters, now fp64
    indices = trainer.sampler.batches()[0]
    batch = trainer.train_set.__getitems__(indices)
    flat_ids, flat_labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    cu = packed_cu_seqlens(batch["document_starts"], batch["input_ids"]).tolist()
    assert len(cu) - 1 > len(indices)  # documents inside the rows, not only one per row
    with torch.no_grad():
        total = sum(
            F.cross_entropy(
                trainer.model(flat_ids[a:b].unsqueeze(0))[0].float(),
                flat_labels[a:b],
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            for a, b in zip(cu[:-1], cu[1:], strict=True)
        )
    labelled = int((flat_labels != IGNORE_INDEX).sum())
    assert labelled < flat_labels.numel()  # the targets after each document's end are ignored
    loss, tokens, _, _ = trainer.train_step(indices)
    assert tokens == flat_ids.numel()
    assert loss == pytest.approx(float(total) / labelled, rel=1e-6)


def test_a_packed_run_resumes_bit_exactly(cache_env, corpus):
    values = {**packed_run(corpus, **{"model.dropout": 0.1}), "out_dir": str(cache_env / "a")}
    train(RunConfig.from_dict(values), quiet=True)
    b = cache_env / "b"
    train(RunConfig.from_dict({**values, "out_dir": str(b)}), quiet=True)
    died_after_step(b, 4)
    result = train(RunConfig.from_dict({**values, "out_dir": str(b)}), quiet=True)
    assert result["step"] == 12 and "perplexity" in result["metrics"]
    assert_identical(final_weights(cache_env / "a"), final_weights(b))
    assert metric_rows(cache_env / "a") == metric_rows(b)
    # `lcsm eval` of the run serves the split packed, as training evaluated it
    _, task, model, _ = load_run(b)
    assert task.config.packing
    assert evaluate(model, task, "validation", 8, torch.device("cpu")) == result["metrics"]


def test_packing_needs_the_lm_task_and_a_causal_model(corpus):
    with pytest.raises(ValueError, match="task 'mqar': option 'packing' .* only the 'lm' task has"):
        RunConfig.from_dict(apply_overrides(TINY, {"task.packing": True}))
    with pytest.raises(ValueError, match="bidirectional: head.kind='lm' must be causal"):
        RunConfig.from_dict(packed_run(corpus, **{"model.bidirectional": True}))


def test_a_packed_run_on_two_processes_is_one_process_accumulating(tmp_path, corpus):
    """Under DDP and FSDP each rank runs its rows as one packed row: 2 processes (gloo) train bit for
    bit like 1 process with grad_accum 2 (as tests/engine/test_distributed.py for unpacked rows),
    and FSDP with activation checkpointing within its summation order of DDP
    (tests/engine/test_fsdp.py)."""
    cfg = write_config(tmp_path / "packed.yaml", packed_run(corpus, **{"train.batch_size": 16}))
    env = cli_env(tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

    def run(out, *launcher_and_settings):
        launcher, settings = launcher_and_settings[0], launcher_and_settings[1:]
        args = [*launcher, "-m", "lcsm", "train", str(cfg), "--quiet", "--out", str(tmp_path / out)]
        done = subprocess.run([*args, *settings], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return tmp_path / out

    ddp, accum = run("ddp", torchrun), run("accum", [sys.executable], "--set", "train.grad_accum=2")
    assert metric_rows(ddp) == metric_rows(accum)
    assert_identical(final_weights(ddp), final_weights(accum))
    fsdp = run("fsdp", torchrun, "--set", "run.parallel=fsdp", "--set", "run.activation_checkpointing=true")
    for a, b in zip(metric_rows(ddp), metric_rows(fsdp), strict=True):
        assert (a["kind"], a["step"]) == (b["kind"], b["step"]) and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_compiling_a_packed_run_warns_of_recompiles(cache_env, corpus, capsys):
    """run.compile with packed rows runs (graph breaks allowed) but recompiles for each new document
    count: the trainer says so when it compiles the step, and not for unpacked rows."""
    Trainer(RunConfig.from_dict({**packed_run(corpus, **{"run.compile": "eager"}), "out_dir": str(cache_env / "a")}))
    assert "run.compile with task.packing" in capsys.readouterr().err
    unpacked = apply_overrides(packed_run(corpus, **{"run.compile": "eager"}), {"task.packing": False})
    Trainer(RunConfig.from_dict({**unpacked, "out_dir": str(cache_env / "b")}))
    assert "task.packing" not in capsys.readouterr().err
