"""Which runs of a sweep are done already: cached in their own directory with the same training
config (``cached_result``), or finished by a sweep beside this one (``Equivalents``, copied with
``copy_run``); and whether a finished run's data or model is older than what its config gives
today (``stale_data``, ``stale_model``)."""

from __future__ import annotations

import errno
import inspect
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lcsm.tasks import recorded_task_data, task_data

from ..config import OptimConfig, TrainConfig, runtime_out_of_train
from ..lock import environment_error
from ..results import FINISHED
from .grid import Run, _run_config

# ``copy_run`` copies into ``<run dir><STAGING>`` and renames it into place once whole.
STAGING = ".reusing"


def _equivalence_key(config: Mapping[str, Any]) -> dict[str, Any]:
    """The training part with the mixer's options resolved, layer by layer: its registered name,
    and per layer every option of its constructor, with the defaults, the options a
    ``family:spec`` name implies and those the model sets by the layer's position (HGRN's lower
    bound k / n_layers unless one is given, ``Mixer.layer_options``) filled in. Two configs with equal
    keys train the same weights however they were written (``lcsm:1-1-1-0`` or ``lcsm`` with
    ``code: 1-1-1-0``; ``tau: 16`` written out or left to its default), and HGRN without a bound
    differs from HGRN with ``lower_bound: 0.0`` (0 in every layer). Run ids keep hashing the config
    as written, so committed runs keep their ids; caching and reuse compare these keys (dicts, so
    16 and 16.0 are equal)."""
    from lcsm.layers.base import resolve
    from lcsm.models import ModelConfig
    from lcsm.models.blocks import layer_options
    from lcsm.models.config import layer_mixers

    run = _run_config(config)
    part = json.loads(json.dumps(run.training_dict()))
    merged, _ = run.model_keys()
    mixer = merged.get("mixer")  # absent: keys as before hybrids (the default written nowhere)
    n_layers = merged.get("n_layers", ModelConfig.n_layers)
    bidirectional = bool(merged.get("bidirectional", ModelConfig.bidirectional))

    def built(name: str, given: Mapping[str, Any], k: int) -> tuple[str, dict[str, Any]]:
        """Registry name and every option of layer k's mixer (defaults, implied, given, per layer)."""
        cls, implied = resolve(name)
        defaults = {
            option: p.default
            for option, p in inspect.signature(cls.__init__).parameters.items()
            if option not in ("self", "d_model") and p.default is not inspect.Parameter.empty
        }
        return cls.registry_name, {**defaults, **implied, **layer_options(cls, given, k, n_layers, bidirectional)}

    if isinstance(mixer, str):
        given = merged.get("mixer_options") or {}
        part["model"]["mixer"] = resolve(mixer)[0].registry_name
        part["model"]["mixer_options"] = json.loads(
            json.dumps([built(mixer, given, k)[1] for k in range(n_layers)], default=repr)
        )
    elif mixer is not None:
        # A hybrid: the registry name and options of every layer, however the stack was written
        # (a list, a pattern, options per name or per layer).
        layers = [
            built(name, given, k)
            for k, (name, given) in enumerate(layer_mixers(mixer, merged.get("mixer_options") or {}, n_layers))
        ]
        names = [name for name, _ in layers]
        # One mixer written as a list is the single-mixer model it builds.
        part["model"]["mixer"] = names[0] if len(set(names)) == 1 else names
        part["model"]["mixer_options"] = json.loads(json.dumps([o for _, o in layers], default=repr))
    return part


def stale_data(result: Mapping[str, Any]) -> str | None:
    """How a finished run's task data differ from what this lcsm makes for its config, or None."""
    name = result["config"]["task"]["name"]
    then, now = recorded_task_data(result, name), task_data(name)
    if then == now:
        return None
    return f"task {name!r} data of generator version {then['generator_version']}, now {now['generator_version']}"


def stale_model(result: Mapping[str, Any]) -> str | None:
    """Why a finished run's model is not the one its config builds today (a mixer or preset whose
    revision was bumped since), or None. A record without revisions predates them: revision 1."""
    then = result.get("model_revisions") or {}
    now = _run_config(result["config"]).model_revisions()
    changed = [
        f"{name} revision {then.get(name, 1)}, now {rev}" for name, rev in now.items() if then.get(name, 1) != rev
    ]
    return "; ".join(changed) or None


def cached_result(run: Run) -> dict[str, Any] | None:
    """The run's result if it finished with exactly this training config."""
    path = run.out_dir / "result.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
        same = _equivalence_key(result["config"]) == _equivalence_key(run.config)
    except (ValueError, KeyError, TypeError):
        return None
    return result if same else None


class Equivalents:
    """Finished runs of the sweeps beside a sweep directory (``<its parent>/*/<run>/result.json``,
    itself included), found by their training config, so a run that another experiment has made
    already is copied instead of trained again (the LCSM tables share runs: the tau table's tau 16
    is the activation table's 1-1-1-0). Read once, on the first lookup."""

    def __init__(self, sweep_dir: Path):
        self.root = Path(sweep_dir).resolve().parent
        self._runs: list[dict[str, Any]] | None = None

    @staticmethod
    def _typed_sections(config: Mapping[str, Any]) -> Any:
        """The task's name and the optimiser and loop settings, defaults filled in: cheap to
        compare, where the whole key builds the task (an LM task reads its corpus to do so)."""
        # a committed run's config may give the runtime settings in train, as configs did
        train = TrainConfig.from_dict(runtime_out_of_train(config)["train"]).to_dict()
        return json.loads(
            json.dumps([config["task"]["name"], OptimConfig.from_dict(config.get("optim")).to_dict(), train])
        )

    def _index(self) -> list[dict[str, Any]]:
        if self._runs is None:
            self._runs = []
            for path in sorted(self.root.glob("*/*/result.json")):
                if path.parent.name.endswith(STAGING):
                    # a copy that was stopped (or ran out of disk) part way, which the next copy
                    # of its run deletes: no source, and it may lack any file but result.json
                    continue
                try:
                    result = json.loads(path.read_text())
                    config = result["config"]
                    if result.get("status") not in FINISHED:
                        continue  # a diverged run is no copy of a finished one
                    if stale_data(result) or stale_model(result):
                        continue  # trained on other data, or another model, than the same config gives now
                    self._runs.append({"dir": path.parent, "config": config, "typed": self._typed_sections(config)})
                except (ValueError, KeyError, TypeError, OSError):
                    continue  # unreadable, or from a config this version no longer reads
        return self._runs

    def find(self, run: Run) -> Path | None:
        """The directory of a finished run with ``run``'s training config, or None. Only for a run
        that has not started here: an interrupted run resumes from its own checkpoints instead."""
        if run.out_dir.exists() and any(run.out_dir.iterdir()):
            return None
        typed, key = self._typed_sections(run.config), None
        for entry in self._index():
            if entry["typed"] != typed or entry["dir"].resolve() == run.out_dir.resolve():
                continue
            if "key" not in entry:
                try:
                    entry["key"] = _equivalence_key(entry["config"])
                except (ValueError, KeyError, TypeError):
                    entry["key"] = None
            key = key or _equivalence_key(run.config)
            if entry["key"] == key:
                return entry["dir"]
        return None


def copy_run(run: Run, source: Path) -> None:
    """Copy the finished run ``source`` (every file: results, logs, checkpoints) to ``run``'s
    directory, atomically: an interrupted copy leaves no half run behind. The copy is exact, so its
    ``config.yaml`` and ``result.json`` keep the source's ``name`` and ``out_dir``, which say where
    it came from."""
    staging = run.out_dir.with_name(run.out_dir.name + STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    failures: list[OSError] = []

    def copy(src: str, dst: str) -> None:
        try:
            shutil.copy2(src, dst)
        except OSError as err:
            failures.append(err)
            raise

    try:
        shutil.copytree(source, staging, copy_function=copy)
        if run.out_dir.exists():
            run.out_dir.rmdir()  # empty (``Equivalents.find``)
        staging.rename(run.out_dir)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        # copytree goes on past a failed file and then raises every failure as text in one
        # shutil.Error; the first file's own error keeps its errno (a full disk)
        if isinstance(err, shutil.Error):
            err = failures[0] if failures else OSError(errno.EIO, err.args[0][0][2])
        raise environment_error(run.out_dir, err) from None
