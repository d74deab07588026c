"""Loads an lm-evaluation-harness task's examples from JSON-lines files next to its YAML.

A task YAML's ``custom_dataset: !function local_jsonl.load`` calls ``load`` with the YAML's
``dataset_kwargs`` (and the run's ``metadata``, unused here). ``dataset_path: json`` would resolve
relative ``data_files`` against the working directory instead, so a task shipped inside the package
would work only from one directory; this reads them relative to this file, in memory (nothing is
downloaded or cached). lm_eval imports this file by its path (its ``!function`` tag), not as part
of the ``lcsm`` package.
"""

from __future__ import annotations

import json
from pathlib import Path


def load(data_files: dict[str, str], **_metadata):
    """``data_files``: split name -> a ``.jsonl`` file (relative to this directory, or absolute),
    one JSON object per line. Returns a ``datasets.DatasetDict`` of those splits."""
    import datasets

    here = Path(__file__).resolve().parent
    splits = {}
    for split, name in data_files.items():
        path = here / name
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            raise ValueError(f"data_files: {str(path)!r} (split {split!r}) holds no examples")
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)
