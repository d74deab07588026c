"""A packed lm run (``task.packing: true``): a training step's loss is the mean over its documents
each run alone, a resumed run is bit-exact, and a packed task asks for a causal model."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.engine import RunConfig, apply_overrides, train
from lcsm.engine.trainer import Trainer
from lcsm.tasks import IGNORE_INDEX
from lcsm.tasks.base import packed_cu_seqlens

from .conftest import TINY
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


def test_packing_needs_the_lm_task_and_a_causal_model(corpus):
    with pytest.raises(ValueError, match="task 'mqar': option 'packing' .* only the 'lm' task has"):
        RunConfig.from_dict(apply_overrides(TINY, {"task.packing": True}))
    with pytest.raises(ValueError, match="bidirectional: head.kind='lm' must be causal"):
        RunConfig.from_dict(packed_run(corpus, **{"model.bidirectional": True}))
