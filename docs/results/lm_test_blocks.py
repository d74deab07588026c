r"""How far apart an LM run's test windows must be drawn to count as independent: the evidence for
``LanguageModelling.example_block``, the block length of ``lcsm.engine.stats``'s draw of them.

Every committed LM run with a ``test_examples.csv`` (all of one task: the default corpus, BPE 4096,
256-token windows) is read; the test split's documents are rebuilt from the corpus to say which
document each window belongs to (the one holding most of its labelled positions). Printed: the
documents' lengths in windows, the correlation of a window's loss per token with its neighbours',
and the standard error of a run's test loss from the library's own draw in circular blocks of b
windows (``stats.cell_replicates`` of one run, 4000 replicates), as a multiple of the standard
error from resampling the test documents whole (what the split's random choice of documents
varies): median and range over the runs.

    OMP_NUM_THREADS=1 python docs/results/lm_test_blocks.py [DATA_DIR] > docs/results/lm_test_blocks.txt

DATA_DIR: where the corpus's sources are (``lcsm data prepare``'s layout; default: fetched).
"""

import glob
import json
import sys
from pathlib import Path

import numpy as np

from lcsm.engine import report, stats
from lcsm.tasks import build

BLOCKS = (1, 2, 5, 10, 25, 50, 64, 75, 100, 128, 150, 200)
LAGS = (1, 2, 5, 10, 20, 50)

runs = []
for path in sorted(glob.glob("results/*/*/test_examples.csv")):
    run = Path(path).parent
    task = json.loads((run / "result.json").read_text())["config"]["task"]
    if task["name"] == "lm":
        runs.append((run, task))
tasks = {json.dumps(t, sort_keys=True) for _, t in runs}
if len(tasks) != 1:
    raise SystemExit(f"expected the runs to share one LM task, got {sorted(tasks)}")
options = {k: v for k, v in runs[0][1].items() if k != "name"}
lm = build("lm", use_cache=False, data_dir=sys.argv[1] if len(sys.argv) > 1 else None, **options)
stream = lm.stream("test")
L = lm.config.seq_len
n = (len(stream) - 1) // L
# the document of each token: how many end-of-document tokens come before it
doc = np.concatenate([[0], np.cumsum(stream[:-1] == lm.tokenizer.eod)])
window_doc = np.array([np.bincount(doc[i * L + 1 : (i + 1) * L + 1]).argmax() for i in range(n)])
ids = [d for d, _ in lm.documents()["test"]]
print(f"task: {runs[0][1]}; {len(runs)} runs; test split: {n} windows of {L} tokens, {len(ids)} documents")
print("windows per document (stream order):")
for i, d in enumerate(ids):
    print(f"  {d}: {int((window_doc == i).sum())}")

rng = np.random.default_rng(0)
docs = [np.nonzero(window_doc == d)[0] for d in np.unique(window_doc)]
picks = rng.integers(0, len(docs), size=(stats.N_BOOT, len(docs)))
lags = {k: [] for k in LAGS}
ratios = {b: [] for b in BLOCKS}
for run, _ in runs:
    columns = report.read_examples(run)
    loss, total = columns["loss"], columns["total"]
    if len(loss) != n:
        raise SystemExit(f"{run}: expected {n} test windows, got {len(loss)}")
    x = loss / total - (loss / total).mean()
    for k in LAGS:
        lags[k].append(float((x[:-k] * x[k:]).sum() / (x * x).sum()))
    per_doc = np.array([[loss[d].sum(), total[d].sum()] for d in docs])
    sums = per_doc[picks].sum(1)
    documents_se = float((sums[:, 0] / sums[:, 1]).std())
    for b in BLOCKS:
        one = stats.RunScore(0, float(loss.sum() / total.sum()), stats.Examples(loss, total, block=b))
        ratios[b].append(float(stats.cell_replicates([one]).std()) / documents_se)

print("correlation of a window's loss per token with the k-th next window's, median over runs:")
print("  " + ", ".join(f"lag {k}: {np.median(v):+.2f}" for k, v in lags.items()))
print("standard error of a run's test loss, circular blocks of b windows / resampling whole documents:")
print("  b: median (min-max over runs)")
for b, r in ratios.items():
    print(f"  {b}: {np.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
