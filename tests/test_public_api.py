"""The public API: each package's ``__all__`` is the list we mean to offer (a name added or dropped
is a decision, made here), every name in it exists, and lcsm's own layers use only what lcsm.ops
offers, so that the operators' internals can change without touching a mixer."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = {
    "lcsm.ops": [
        "DELTA_MODES",
        "DPLR_MODES",
        "LogO",
        "LogProduct",
        "MODES",
        "Plan",
        "autocast_off",
        "causal_fft_conv",
        "eos",
        "eos_delta",
        "eos_dplr",
        "eos_rotating",
        "eos_step",
        "explain",
        "explain_dplr",
        "fft_length",
        "first_order",
        "log_sigmoid_product",
        "native_block_diag",
        "native_causal_conv",
        "native_diag_scan",
        "native_gated_rms_norm",
        "native_mlstm_readout",
        "native_s4_kernel",
        "native_s4_spectrum",
        "native_serves",
        "native_silu_mul",
        "native_unavailable",
        "packed_bounds",
    ],
    "lcsm.layers": [
        "EOSRow",
        "Mixer",
        "State",
        "ValueFirst",
        "aliases",
        "available",
        "build",
        "no_weight_decay",
        "register",
        "resolve",
    ],
    "lcsm.models": [
        "Bidirectional",
        "Block",
        "CausalLM",
        "DualClassifier",
        "HeadConfig",
        "Model",
        "ModelConfig",
        "PRESETS",
        "PRESET_REVISIONS",
        "SequenceClassifier",
        "build_model",
        "model_revisions",
        "preset",
        "reverse_valid",
        "sample_next",
    ],
    "lcsm.tasks": [
        "Evaluator",
        "IGNORE_INDEX",
        "Segment",
        "SegmentBatchSampler",
        "SegmentedDataset",
        "Task",
        "TaskConfig",
        "available",
        "build",
        "config_model_fields",
        "default_cache_dir",
        "recorded_task_data",
        "register",
        "resolve",
        "task_data",
    ],
    "lcsm.engine": [
        "Distributed",
        "EarlyStopConfig",
        "LoopState",
        "OptimConfig",
        "RunConfig",
        "RuntimeConfig",
        "TrainConfig",
        "Trainer",
        "apply_overrides",
        "build_optimizer",
        "evaluate",
        "latest_checkpoint",
        "list_checkpoints",
        "load_config",
        "load_run",
        "lr_factor",
        "parse_override",
        "read_yaml",
        "resolve_checkpoint",
        "train",
    ],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_all_is_the_intended_api_and_every_name_exists(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    assert len(set(module.__all__)) == len(module.__all__), "a name listed twice"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"


def _ops_imports(path: Path):
    """(line, module, names) of every import of lcsm.ops or a submodule of it in ``path`` (a file of
    lcsm/layers; relative imports resolved against lcsm.layers)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = "lcsm.layers".rsplit(".", node.level - 1)[0]
                module = f"{package}.{module}" if module else package
            if module == "lcsm.ops" or module.startswith("lcsm.ops."):
                yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lcsm.ops"):
                    yield node.lineno, alias.name, []


LAYER_FILES = sorted((ROOT / "lcsm" / "layers").glob("*.py"))


@pytest.mark.parametrize("path", LAYER_FILES, ids=lambda p: p.name)
def test_layers_import_only_public_ops_names(path):
    public = set(PUBLIC["lcsm.ops"])
    bad = [
        (line, module, names)
        for line, module, names in _ops_imports(path)
        if module != "lcsm.ops" or not set(names) <= public
    ]
    assert not bad, f"lcsm/layers/{path.name} reaches past lcsm.ops.__all__ at (line, module, names) {bad}"


def test_the_import_scan_resolves_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from ..ops import eos\nfrom .base import Mixer\nfrom ..ops.delta import DELTA_MODES\nimport lcsm.ops.eos\n"
    )
    assert list(_ops_imports(source)) == [
        (1, "lcsm.ops", ["eos"]),
        (3, "lcsm.ops.delta", ["DELTA_MODES"]),
        (4, "lcsm.ops.eos", []),
    ]
