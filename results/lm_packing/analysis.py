r"""The numbers of VERDICT.md beyond the runs' own: how many rows and targets packing changes, and
each run's last weights evaluated on the validation split served both ways (packed / unpacked).

    OMP_NUM_THREADS=1 python results/lm_packing/analysis.py results/lm_packing/packing=*/ \
        > results/lm_packing/analysis.json
"""

import json
import sys
from pathlib import Path

import torch

from lcsm.engine import evaluate, load_run
from lcsm.engine.config import RunConfig
from lcsm.models import build_model
from lcsm.tasks import IGNORE_INDEX, SegmentBatchSampler

torch.set_num_threads(1)
out = {"data": {}, "evaluations": {}}
for run in map(Path, sys.argv[1:]):
    config, _, model, _ = load_run(run, which="last")
    for packing in (False, True):
        task = RunConfig.from_dict({**config.to_dict(), "task": {**config.task, "packing": packing}}).build_task()
        metrics = evaluate(model, task, "validation", 64, torch.device("cpu"))
        targets = int((task.dataset("validation").segments[0].labels != IGNORE_INDEX).sum())
        out["evaluations"][f"{run.name} on packing={packing}"] = {**metrics, "targets": targets}
        if packing and not out["data"]:
            for split in ("train", "validation"):
                seg = task.dataset(split).segments[0]
                out["data"][split] = {
                    "rows": len(seg),
                    "documents": len(task.documents()[split]),
                    "rows with a document start inside": int((seg.extras["document_starts"][:, 1:] != 0).any(1).sum()),
                    "ignored targets": int((seg.labels == IGNORE_INDEX).sum()),
                    "targets": seg.labels.numel(),
                }
            # the rows the runs trained on: the first max_steps batches of epoch 0 (both runs alike)
            t = config.train
            sampler = SegmentBatchSampler(
                task.dataset("train"), t.batch_size, shuffle=True, seed=t.seed, drop_last=True
            )
            batches = sampler.batches()[: t.max_steps]
            rows = torch.tensor([i for batch in batches for i in batch])
            seg = task.dataset("train").segments[0]
            out["data"]["trained"] = {
                "steps whose batch holds a document start inside a row": [
                    k + 1 for k, b in enumerate(batches) if bool((seg.extras["document_starts"][b, 1:] != 0).any())
                ],
                "rows": len(rows),
                "rows with a document start inside": int((seg.extras["document_starts"][rows, 1:] != 0).any(1).sum()),
                "ignored targets": int((seg.labels[rows] == IGNORE_INDEX).sum()),
                "targets": seg.labels[rows].numel(),
            }
# The first step's batch (no document start inside a row) run both ways by the initial weights: the
# packed row is another summation order, so the two runs part by rounding from the first step.
torch.manual_seed(config.train.seed)
model = build_model(config.model_config(task), verbose=False)
batch = task.dataset("train").__getitems__(batches[0])
with torch.no_grad():
    rows_logits, packed_logits = model(batch["input_ids"]), task.logits(model, batch)
out["first step, initial weights: largest logit difference packed - rows"] = float(
    (rows_logits - packed_logits).abs().max()
)
print(json.dumps(out, indent=1))
