"""The training loop: ``train(config)`` runs (or resumes) one run and returns its result.

The loop, per optimizer step (``Trainer.run``):

    indices = next global batch of the training split      (order fixed by seed and epoch)
    for each of this process's grad_accum micro-batches:
        loss = summed cross-entropy / labelled positions of the whole global batch
        backward (gradients synchronised across processes on the last micro-batch only)
    clip, AdamW step, schedule step
    every log_every: progress line + metrics.jsonl; every eval_every: evaluate, early stopping,
    best checkpoint; every save_every: checkpoint
    at the end: checkpoint, then the final evaluation and the test of the best checkpoint

Guarantees:
- Same global batch, same loss: the loss is normalised by the labelled positions of the global
  batch, so 1 process, N processes and any grad_accum compute the same gradient (up to the order
  of floating-point sums).
- Nothing lost on interruption: SIGINT / SIGTERM finish the current step, write a checkpoint and
  stop (a second SIGINT stops at once). Running the same command again resumes.
- Exact resume: a checkpoint holds weights, optimizer and scheduler state, every process's RNG
  state and the position in the data (epoch, batch); the resumed run takes exactly the steps the
  uninterrupted run would have, so both end with bit-identical weights on the same machine and
  CPU thread count (tested, including after SIGKILL; another thread count is noted on resume).
- Provenance across machines: a run may be resumed elsewhere (begun on a GPU, finished on a CPU).
  Each stretch of steps records its device, CPU, torch and commit, and result.json lists them
  under ``trained_on``; ``machine`` and ``git_commit`` name where the run finished.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import io
import json
import math
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

from lcsm._provenance import device_name, git_commit, machine_info
from lcsm.engine.host_memory import use_host_allocator
from lcsm.models import build_model
from lcsm.models.blocks import checkpoint_blocks
from lcsm.tasks import IGNORE_INDEX, SegmentBatchSampler, recorded_task_data, task_data
from lcsm.tasks.metrics import Evaluator

from . import checkpoint as ckpt
from . import parallel
from .config import RunConfig, TrainConfig, check_early_stop_metric, check_eval_split, in_section
from .distributed import Distributed
from .lock import DirectoryLock
from .monitor import MetricsLog, Progress, json_safe, write_atomic
from .optim import adamw, build_optimizer, lr_factor
from .results import FINISHED

Tensor = torch.Tensor


@dataclass
class LoopState:
    """Where the loop is; saved in every checkpoint."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current pass over the training split
    batch_in_epoch: int = 0  # global batches of this epoch already consumed
    tokens: int = 0  # input tokens trained on (all processes)
    elapsed: float = 0.0  # training wall time so far (brought up to date at each save)
    best_value: float | None = None
    best_step: int | None = None
    bad_evals: int = 0  # evaluations since the best one
    stopped_early: bool = False
    last_eval: dict[str, float] | None = None
    last_eval_step: int | None = None
    # stretches of steps each trained on one machine: {device, cpu, torch, git_commit, from_step, to_step}
    trained_on: list[dict[str, Any]] = field(default_factory=list)
    skipped_steps: int = 0  # steps with a non-finite loss or gradient norm, skipped (run.on_nonfinite)


class TrainingDiverged(ValueError):
    """A step's loss or gradient norm was not finite and ``run.on_nonfinite`` is "stop"."""

    exit_status = 1


def _json_canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _rows(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] for k, v in batch.items()}


def _tokens(batch: dict[str, Any]) -> int:
    return sum(int(batch[k].shape[0] * batch[k].shape[1]) for k in ("input_ids", "input_ids2") if k in batch)


def autocast(device: torch.device, precision: str):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def default_eval_split(task, option: str | None) -> str:
    if option is not None:
        check_eval_split(option, task)
        return option
    return "validation" if "validation" in task.splits else "test"


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    task,
    split: str,
    batch_size: int,
    device: torch.device,
    precision: str = "fp32",
    evaluator: Evaluator | None = None,
) -> dict[str, float]:
    """The task's metrics of ``model`` over a whole split (eval mode; the mode is restored).
    ``evaluator``: a fresh one of the task's to stream into (its ``examples()`` are read after)."""
    was_training = model.training
    model.eval()
    evaluator = evaluator if evaluator is not None else task.evaluator()
    try:
        # A loader without a generator of its own draws its base seed from the global one, which
        # also draws training's dropout masks: every evaluation would shift them, and eval_every
        # would change the trained weights.
        for batch in task.dataset(split).loader(batch_size, generator=torch.Generator()):
            batch = _to_device(batch, device)
            with autocast(device, precision):
                logits = task.logits(model, batch)
            evaluator.update(logits.float(), batch["labels"], batch)
    finally:
        model.train(was_training)
    return evaluator.compute()


EXAMPLES_FILE = "test_examples.csv"


def write_examples(path: Path, examples: dict[str, list]) -> None:
    """The reported test evaluation per example (``Evaluator.examples``), one CSV row each, in the
    split's order: what ``lcsm.engine.stats`` resamples for intervals over test examples."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["segment", "total", "correct", "loss"])
    for row in zip(examples["segment"], examples["total"], examples["correct"], examples["loss"], strict=True):
        writer.writerow([row[0], row[1], row[2], f"{row[3]:.6g}"])
    write_atomic(path, buf.getvalue())


def load_run(checkpoint_path, *, which: str = "last", device: str | torch.device = "cpu"):
    """(run config, task, model with the checkpoint's weights, checkpoint dir) from a checkpoint or
    run directory. The model is in eval mode on ``device`` (a torch.device, or an option of
    ``resolve_device``)."""
    from .distributed import resolve_device

    if not isinstance(device, torch.device):
        device = resolve_device(device, "device")

    path = ckpt.resolve_checkpoint(checkpoint_path, which)
    info = ckpt.read_info(path)
    if info.get("format") != "lcsm-run" or "config" not in info:
        raise ValueError(f"checkpoint {str(path)!r}: run.json is not an lcsm run checkpoint")
    config = RunConfig.from_dict(info["config"])
    task = config.build_task()
    model = build_model(config.model_config(task), verbose=False)
    ckpt.load_weights(model, path)
    return config, task, model.to(device).eval(), path


# Rank r > 0 draws its random numbers from train.seed + r * RANK_SEED_STRIDE: one stream per rank of
# a run (train.seed < 2**32 keeps it within int64).
RANK_SEED_STRIDE = 1_000_003


class _StopRequest:
    """SIGINT / SIGTERM set a flag the loop checks between steps (a step is never cut in half, so
    the checkpoint written on the way out is consistent); a second SIGINT interrupts at once.
    Only a second SIGINT: a sweep passes its SIGTERM on to its run, and under Ctrl-C to the whole
    process group that SIGTERM may be handled before the run's own SIGINT."""

    def __init__(self):
        self.requested = False
        self._sigint = False
        self._previous = {}

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            if self._sigint:
                raise KeyboardInterrupt
            self._sigint = True
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One run. ``Trainer(config).run()`` trains or resumes; see the module docstring."""

    def __init__(self, config: RunConfig, dist: Distributed | None = None, *, quiet: bool = False):
        self.config = config
        t, r = config.train, config.run
        self.dist = dist if dist is not None else Distributed.setup(r.device)
        self.device = self.dist.device
        self.fsdp = r.parallel == "fsdp"
        if self.fsdp and not self.dist.enabled:
            # No silent fallback: one process would train the same model unsharded, which is not
            # what the config asks for (its memory is why one asks).
            raise ValueError(
                "run.parallel: 'fsdp' shards the model over the processes torchrun starts, but this is "
                "one process (WORLD_SIZE unset or 1); run it under torchrun --nproc_per_node N (N >= 2), "
                "or set run.parallel: ddp, which trains the same model in one process"
            )
        self.out_dir = Path(config.out_dir)
        # The code that runs is the code at start: later commits in the checkout do not change it.
        self.git_commit = git_commit()
        self.host_allocator = use_host_allocator(r.host_allocator)

        # Rank 0 generates (and caches) the data first, so the others read it instead of redoing it.
        self.task = config.build_task()
        self.eval_split = default_eval_split(self.task, t.eval_split)
        if self.dist.is_main:
            note = self._data_note(["train", self.eval_split])
            if note and not quiet:
                print(note, file=sys.stderr, flush=True)
            self.train_set = self.task.dataset("train")
            # The segment and slice names exist once the evaluation data does: a misspelt one fails
            # here, before the first step, not at the first evaluation (the config checked the rest).
            check_early_stop_metric(t.early_stop.metric, self.task, self.task.dataset(self.eval_split))
        self.dist.barrier()
        if not self.dist.is_main:
            self.train_set = self.task.dataset("train")

        per_step = self.dist.world * t.grad_accum
        if t.batch_size % per_step:
            raise ValueError(
                f"train.batch_size: {t.batch_size} examples per step must split evenly over "
                f"{self.dist.world} process(es) x grad_accum {t.grad_accum} = {per_step}"
            )
        self.micro = t.batch_size // per_step
        self.sampler = SegmentBatchSampler(self.train_set, t.batch_size, shuffle=True, seed=t.seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"train.batch_size: {t.batch_size} is larger than every segment of the training split "
                f"({self.train_set.segment_sizes()}); no full batch can be formed"
            )
        self.total_steps = t.max_steps if t.max_steps is not None else t.epochs * self.steps_per_epoch

        torch.manual_seed(t.seed)
        self.model_config = config.model_config(self.task)
        # a mixer's options are checked when it is built
        with in_section("model.mixer_options", config.model.get("mixer_options")):
            model = build_model(self.model_config, verbose=False).to(self.device)
        self.n_params = model.num_parameters()
        # self.model: the whole, unsharded model, which rank 0 evaluates and checkpoints.
        # self.trained: the module whose parameters the optimizer steps (the same one unless
        # sharded); self.net: what the step runs (the latter, wrapped in DDP under torchrun).
        if self.fsdp:
            # Rank 0 keeps a whole copy, refreshed from the shards before each evaluation and
            # checkpoint (``_gather``); every rank built the same initial weights from the seed.
            self.model = copy.deepcopy(model) if self.dist.is_main else None
            named = parallel.named_groups(model, model.parameter_groups(config.optim.weight_decay))
            if r.activation_checkpointing:
                checkpoint_blocks(model)
            self.trained = self.net = parallel.shard(model)
            self.optimizer = adamw(parallel.groups_of(self.trained, named), config.optim)
        else:
            if r.activation_checkpointing:
                checkpoint_blocks(model)
            self.model = self.trained = model
            self.net = (
                DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None)
                if self.dist.enabled
                else model
            )
            self.optimizer = build_optimizer(model, config.optim)
        if r.compile_backend is not None:
            # Only the step's module: evaluation and checkpoints keep the plain one (same parameters).
            # Dynamic shapes: batches of the tasks' length grids differ in T, each would recompile.
            self.net = torch.compile(self.net, dynamic=True, backend=r.compile_backend)
            if getattr(self.task.config, "packing", False) and self.dist.is_main:
                ckpt.warn(
                    "warning: run.compile with task.packing: the packed rows' document bounds are read "
                    "as integers, so every batch with a new number of documents recompiles the step "
                    "(seconds to minutes each), and past dynamo's recompile limit the step runs eagerly "
                    "(docs/compile.md)"
                )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config.optim, self.total_steps))
        if self.dist.rank > 0:
            # Every rank built the same weights from train.seed; from here each draws its own
            # random numbers (dropout masks), rank 0 keeping the one-process stream. Resumes restore
            # each rank's own state from the checkpoint.
            torch.manual_seed(t.seed + RANK_SEED_STRIDE * self.dist.rank)
        self.state = LoopState()
        # (split, Evaluator.examples()) of the newest evaluation, on rank 0; finish writes the test's
        self._examples: tuple[str, dict[str, list]] | None = None
        self._resume_notes: list[str] = []  # restore's: how the resumed training will differ
        self._clock = time.perf_counter()
        self.log = MetricsLog(self.out_dir, enabled=self.dist.is_main, tensorboard=r.tensorboard)
        self.progress = Progress(self.total_steps, log_every=r.log_every, enabled=self.dist.is_main and not quiet)

    def _data_note(self, splits: list[str]) -> str | None:
        """The line to print before the task generates data of ``splits`` that no cache holds:
        generating can take minutes (Path-X, a large MQAR grid), silent otherwise."""
        todo = [split for split in dict.fromkeys(splits) if not self.task.cached(split)]
        if not todo:
            return None
        where = f"cached in {self.task.cache_dir} for next time" if self.task.use_cache else "not cached"
        return f"data: generating task {self.task.registry_name!r}, split(s) {', '.join(todo)} ({where})"

    # ------------------------------------------------------------------ checkpoints

    def _info(self) -> dict[str, Any]:
        from lcsm import __version__

        return {
            "format": "lcsm-run",
            "step": self.state.step,
            # which step the "best" checkpoint should hold: `--best` refuses one a resumed run left behind
            "best_step": self.state.best_step,
            "config": self.config.to_dict(),
            "training_config": _json_canonical(self.config.training_dict()),
            "model_config": self.model_config.to_dict(),
            "n_params": self.n_params,
            "world_size": self.dist.world,
            "parallel": self.config.run.parallel,
            # CPU kernels split their sums by thread count: another count continues, not bit-identically
            "threads": torch.get_num_threads(),
            "lcsm_version": __version__,
            "torch_version": torch.__version__,
            "metrics": self.state.last_eval,
            "task_data": self.task_data(),
            "model_revisions": self.config.model_revisions(),
        }

    def task_data(self) -> dict[str, Any]:
        """Which data the run trains on beyond its config: the task's generator version (bumped
        whenever a task's data change for the same options)."""
        return task_data(self.task.registry_name)

    def _rng_state(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def save(self, name: str | None = None) -> Path | None:
        """A checkpoint of this very moment (every rank must call: RNG states are gathered)."""
        now = time.perf_counter()
        self.state.elapsed += now - self._clock
        self._clock = now
        if self.state.trained_on:
            self.state.trained_on[-1]["to_step"] = self.state.step
        rng = self.dist.gather(self._rng_state())
        self._gather()
        optimizer = (
            parallel.full_optimizer_state(self.trained, self.optimizer) if self.fsdp else self.optimizer.state_dict()
        )
        path = None
        if self.dist.is_main:
            trainer = {
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "rng": rng,
                "state": dataclasses.asdict(self.state),
            }
            name = name or f"step-{self.state.step:08d}"
            path = ckpt.save_checkpoint(self.out_dir, name, self.model, trainer, self._info())
            if name != ckpt.BEST:
                ckpt.prune(self.out_dir, self.config.run.keep_last)
        self.dist.barrier()
        return path

    def restore(self, resume: bool) -> Path | None:
        states: dict[Path, dict[str, Any]] = {}  # the trainer state of the checkpoint taken, read once

        def read(path: Path) -> None:
            states[path] = ckpt.load_trainer(path)

        # (without resume a run with checkpoints is refused below: nothing to read)
        path = ckpt.latest_checkpoint(
            self.out_dir, note=ckpt.warn if self.dist.is_main else None, read=read if resume else None
        )
        if path is None:
            return None
        if not resume:
            raise ValueError(
                f"out_dir: {str(self.out_dir)!r} already holds checkpoints of a run; resume it, "
                "or start over with --restart (deletes them) or another --out"
            )
        info = ckpt.read_info(path)
        mine = _resumable(_json_canonical(self.config.training_dict()))
        theirs = _resumable(info.get("training_config"))
        if theirs != mine:
            changed = sorted(_diff_keys(theirs or {}, mine))
            raise ValueError(
                f"out_dir: {str(self.out_dir)!r} holds a run with a different training config "
                f"(differs in {', '.join(changed) or 'format'}); resuming would not continue it. "
                "Resume it with its own config (its config.yaml), or train this one into another --out, "
                "or start over with --restart (deletes the run)"
            )
        then, now = recorded_task_data(info, self.task.registry_name), self.task_data()
        if then != now:
            raise ValueError(
                f"out_dir: {str(self.out_dir)!r} holds a run trained on the data of task "
                f"{then['task']!r}, generator version {then['generator_version']}, but this lcsm "
                f"makes version {now['generator_version']} for the same options; resuming would "
                "continue on other data. Finish it with the lcsm it started with (trained_on in its "
                "checkpoint names the commit), or start over with --restart or another --out"
            )
        self._load_whole(path)
        if self.fsdp:
            parallel.load_full_model_state(self.trained, self.model.state_dict() if self.dist.is_main else {})
        trainer = states.pop(path)
        try:
            if self.fsdp:
                parallel.load_full_optimizer_state(self.trained, self.optimizer, trainer["optimizer"])
            else:
                self.optimizer.load_state_dict(trainer["optimizer"])
        except ValueError as exc:  # torch: the parameter groups differ in size
            raise ValueError(
                f"out_dir: {str(self.out_dir)!r} holds a run whose optimizer groups differ from the ones "
                "this lcsm makes for its config (a parameter's weight-decay tag changed since it "
                f"started: {exc}); resuming would not continue it. Finish it with the lcsm it started "
                "with, or start over with --restart or another --out"
            ) from None
        self.scheduler.load_state_dict(trainer["scheduler"])
        rng = trainer["rng"]
        mine_rng = rng[self.dist.rank] if len(rng) == self.dist.world else rng[0]
        torch.set_rng_state(mine_rng["cpu"])
        if self.device.type == "cuda" and "cuda" in mine_rng:
            torch.cuda.set_rng_state(mine_rng["cuda"], self.device)
        self.state = LoopState(**trainer["state"])
        # Said by run() only where steps remain: a finished run trains nothing, so nothing differs.
        if len(rng) != self.dist.world:
            self._resume_notes.append(
                f"note: resuming a {len(rng)}-process run with {self.dist.world} process(es): "
                "training continues, but not bit-identically to the original run"
            )
        threads = info.get("threads")
        if self.device.type == "cpu" and threads is not None and threads != torch.get_num_threads():
            self._resume_notes.append(
                f"note: resuming a run trained with {threads} CPU thread(s) per process with "
                f"{torch.get_num_threads()}: training continues, but not bit-identically to the original run "
                f"(run.threads: {threads} keeps it exact)"
            )
        return path

    # ------------------------------------------------------------------ steps

    def train_step(self, indices: list[int]) -> tuple[float, int, float, float]:
        """One optimizer step on a global batch: (mean loss over its labelled positions, input
        tokens of the global batch, gradient norm before clipping, learning rate of the step)."""
        t = self.config.train
        batch = self.train_set.__getitems__(indices)
        labelled = int((batch["labels"] != IGNORE_INDEX).sum())
        if labelled == 0:
            raise ValueError(f"task {self.task.registry_name!r}: a training batch has no labelled position")
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in range(t.grad_accum):
            start = (m * self.dist.world + self.dist.rank) * self.micro
            micro = _to_device(_rows(batch, start, start + self.micro), self.device)
            last = m == t.grad_accum - 1
            if self.fsdp:
                # FSDP's no_sync: gradients stay unreduced, and unsharded, until the last micro-batch.
                self.net.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last or not self.dist.enabled else self.net.no_sync()
            with sync:
                with autocast(self.device, t.precision):
                    logits = self.task.logits(self.net, micro)
                loss = self.task.loss(logits, micro["labels"], reduction="sum") / labelled
                # DDP and FSDP average gradients over processes; the global loss is their sum.
                (loss * self.dist.world).backward()
            loss_sum += loss.detach().double()
        clip = self.config.optim.grad_clip
        max_norm = clip if clip is not None else math.inf
        if self.fsdp:
            norm = parallel.clip_grad_norm(list(self.trained.parameters()), max_norm)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        loss = float(self.dist.sum(loss_sum))
        # Every process sees the same global loss and (synchronised) gradient norm, so all agree.
        # A non-finite one would make the weights and AdamW's moments nan for good: no update.
        if math.isfinite(loss) and math.isfinite(norm):
            try:
                self.optimizer.step()
            except RuntimeError as err:
                # AdamW scales each update by lr / (1 - beta1^step) in the weights' dtype
                if "cannot be converted to type" not in str(err):
                    raise
                raise ValueError(
                    f"optim.lr: {self.config.optim.lr!r} ({lr!r} at step {self.state.step + 1}) makes AdamW's "
                    f"update overflow the weights' dtype ({err}); expected a learning rate a weight can move by"
                ) from err
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, _tokens(batch), norm, lr

    def _load_whole(self, path: Path) -> None:
        """A checkpoint's weights into the whole model (every rank must call). Under FSDP rank 0
        alone holds it: its refusal (weights that do not fit, a damaged file) is every rank's, which
        would otherwise wait for it in the next collective."""
        if not self.fsdp:
            ckpt.load_weights(self.model, path)
            return
        refused = None
        if self.dist.is_main:
            try:
                ckpt.load_weights(self.model, path)
            except ValueError as err:
                refused = err
        refused = self.dist.broadcast(refused)
        if refused is not None:
            raise refused

    def _gather(self) -> None:
        """Under FSDP, the trained shards into rank 0's whole model (every rank must call)."""
        if self.fsdp:
            weights = parallel.full_model_state(self.trained)
            if self.dist.is_main:
                self.model.load_state_dict(weights)

    def evaluate(self, split: str | None = None, *, gather: bool = True) -> dict[str, float]:
        """Rank 0 evaluates the unwrapped model on ``split`` (default the eval split); every rank
        gets the metrics. ``gather=False``: the whole model as it is, not the trained weights."""
        if gather:
            self._gather()
        metrics = None
        if self.dist.is_main:
            t = self.config.train
            evaluator = self.task.evaluator()
            metrics = evaluate(
                self.model,
                self.task,
                split or self.eval_split,
                t.eval_batch_size or t.batch_size,
                self.device,
                t.precision,
                evaluator,
            )
            self._examples = (split or self.eval_split, evaluator.examples())
        return self.dist.broadcast(metrics)

    def after_eval(self, metrics: dict[str, float]) -> None:
        es = self.config.train.early_stop
        s = self.state
        s.last_eval, s.last_eval_step = metrics, s.step
        value = metrics[es.metric]
        if s.best_value is None:
            improved = math.isfinite(value)
        elif es.mode == "max":
            improved = value > s.best_value + es.min_delta
        else:
            improved = value < s.best_value - es.min_delta
        if improved:
            s.best_value, s.best_step, s.bad_evals = value, s.step, 0
            self.save(ckpt.BEST)
        else:
            s.bad_evals += 1
            # Patience running out at the last step stops nothing: the run completed its steps.
            if es.patience and s.bad_evals >= es.patience and s.step < self.total_steps:
                s.stopped_early = True
        self.log.write("eval", s.step, {"split": self.eval_split, **metrics})
        self.log.write_csv()
        shown = {k: v for k, v in metrics.items() if "/" not in k}
        self.progress.message(
            f"eval @ step {s.step} ({self.eval_split}): "
            + "  ".join(f"{k} {v:.4f}" for k, v in shown.items())
            + (f"  [early stop: no {es.metric} gain in {s.bad_evals} evals]" if s.stopped_early else "")
        )

    # ------------------------------------------------------------------ the loop

    def _begin_stretch(self) -> None:
        """Record that the steps from here on run on this machine (a resume on the same machine and
        code continues the last stretch). Checkpoints older than this record have no stretches."""
        info = machine_info()
        # str(): torch.__version__ is a TorchVersion, which the weights-only load of trainer.pt refuses
        here = {
            "device": device_name(self.device),
            "cpu": info["cpu"],
            "torch": str(info["torch"]),
            "git_commit": self.git_commit,
        }
        stretches, step = self.state.trained_on, self.state.step
        last = stretches[-1] if stretches else None
        if last is not None and last["to_step"] == step and all(last[k] == v for k, v in here.items()):
            return
        stretches.append({**here, "from_step": step, "to_step": step})

    def run(self, resume: bool = True) -> dict[str, Any]:
        t = self.config.train
        restored = self.restore(resume)
        result_path = self.out_dir / "result.json"
        recorded = (
            self._recorded_result(result_path) if restored is not None else self._kept_result(result_path, resume)
        )
        if recorded is not None:
            self.progress.message(
                f"{self.config.name or self.out_dir.name}: finished already ({recorded['status']} at step "
                f"{recorded['step']}); result {result_path} (--restart trains it again)"
            )
            self.log.close()
            return recorded
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.out_dir / "config.yaml", yaml.safe_dump(self.config.to_dict(), sort_keys=False))
            self.log.truncate_after(self.state.step, self.state.last_eval_step)
            self.progress.message(
                f"{'resuming' if restored else 'training'} {self.config.name or self.out_dir.name}: task "
                f"{self.task.registry_name}, {self.model_config.stack_summary()}, "
                f"d_model {self.model_config.d_model}, {self.n_params:,} parameters, {self.total_steps} steps "
                f"({self.steps_per_epoch} per epoch), batch {t.batch_size}, {self.dist.world} process(es) on "
                f"{self.device}" + (f", from {restored}" if restored else "")
            )
        self.progress.start = self.state.step
        finished = self.state.step >= self.total_steps or self.state.stopped_early
        if not finished:
            for note in self._resume_notes:
                self.progress.message(note)
            split = self.dist.world * t.grad_accum
            if self.model_config.norm == "batchnorm" and split > 1 and self.dist.is_main:
                self.progress.message(
                    f"note: BatchNorm normalises each of the step's {split} micro-batches by its own statistics "
                    "(and keeps the first process's running ones), so this run differs from one of the same "
                    "global batch in one piece by more than rounding (docs/engine.md)"
                )
            warmup = self.config.optim.warmup_steps
            if warmup >= self.total_steps and self.dist.is_main:
                ckpt.warn(
                    f"warning: optim.warmup_steps ({warmup}) >= the run's {self.total_steps} steps: the whole run "
                    f"warms up, its last update at {self.total_steps / warmup:.3g} x optim.lr, and the "
                    f"{self.config.optim.schedule} schedule never starts"
                )
            self._begin_stretch()
        interrupted = False
        self._clock = time.perf_counter()
        with _StopRequest() as stop:
            last_time, last_tokens = time.perf_counter(), self.state.tokens
            while not (finished or interrupted):
                self.sampler.set_epoch(self.state.epoch)
                batches = self.sampler.batches()
                while self.state.batch_in_epoch < len(batches) and not (finished or interrupted):
                    loss, tokens, norm, lr = self.train_step(batches[self.state.batch_in_epoch])
                    s = self.state
                    if not (math.isfinite(loss) and math.isfinite(norm)):
                        self._nonfinite(s.step + 1, loss, norm, lr, result_path)
                    s.step, s.batch_in_epoch, s.tokens = s.step + 1, s.batch_in_epoch + 1, s.tokens + tokens
                    now = time.perf_counter()
                    rate = (s.tokens - last_tokens) / max(now - last_time, 1e-9)
                    self.progress.update(s.step, loss, lr, rate)
                    record = {
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": norm,
                        "tokens": s.tokens,
                        "tokens_per_s": rate,
                        "epoch": s.epoch,
                    }
                    if s.skipped_steps:
                        record["skipped_steps"] = s.skipped_steps
                    log_every = self.config.run.log_every
                    logged = bool(log_every) and s.step % log_every == 0
                    if logged:
                        self.log.write("train", s.step, record)
                        last_time, last_tokens = now, s.tokens
                    # evaluations and checkpoints are not training: their time leaves the rate's window
                    paused = time.perf_counter()
                    if t.eval_every and s.step % t.eval_every == 0 and s.step < self.total_steps:
                        self.after_eval(self.evaluate())
                    finished = s.step >= self.total_steps or s.stopped_early
                    # The final training loss is always on record, whatever log_every (0: it alone) and
                    # wherever the run ends (max_steps or an early stop).
                    if finished and not logged:
                        self.log.write("train", s.step, record)
                    # Every process must agree to stop at the same step (a signal may reach one first).
                    interrupted = not finished and bool(self.dist.sum(torch.tensor(float(stop.requested))) > 0)
                    if t.save_every and s.step % t.save_every == 0 and not (finished or interrupted):
                        self.save()
                    last_time += time.perf_counter() - paused
                if self.state.batch_in_epoch == len(batches):
                    self.state.epoch, self.state.batch_in_epoch = self.state.epoch + 1, 0
            # The weights of the step the loop ended at, saved under the loop's signal handling: a
            # stop requested up to the end of this write (during the last step or right after it)
            # loses no step, and the final evaluation comes after it.
            path = self._checkpoint_now()
            if not interrupted:
                # a request during the last step or the write, which the loop did not see: the
                # final evaluation (minutes for a language model) waits for the next call
                interrupted = bool(self.dist.sum(torch.tensor(float(stop.requested))) > 0)
            if interrupted:
                where = (
                    f"interrupted at step {self.state.step}: checkpoint {path}; run the same command again to resume"
                )
                # where the run stopped is no progress output: said under --quiet too
                if self.progress.enabled:
                    self.progress.message(where)
                elif self.dist.is_main:
                    ckpt.warn(where)
                raise KeyboardInterrupt
        self.progress.close()
        return self.finish(result_path)

    def _checkpoint_now(self) -> Path | None:
        """The checkpoint of the current step: the newest one when it is of this step and intact
        (saved in the loop, or the one a finished run resumed from), else written now (the loop
        writes none at the step it ends at; a damaged one is replaced)."""
        saved = ckpt.list_checkpoints(self.out_dir)
        if saved and saved[-1][0] == self.state.step and not ckpt.damage(saved[-1][1]):
            return saved[-1][1]
        return self.save()

    def _recorded_result(self, path: Path) -> dict[str, Any] | None:
        """The result of this run when it finished before: its newest checkpoint is of its last step
        and ``path`` records that step's result. Running such a run again returns it rather than
        evaluating the same weights again, which would rewrite the commit, machine and time the
        result records. Without the result (stopped during its final evaluation) the run finishes."""
        s = self.state
        if not (s.step >= self.total_steps or s.stopped_early) or not path.is_file():
            return None
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        finished = isinstance(result, dict) and result.get("status") in FINISHED
        return result if finished and result.get("step") == s.step else None

    def _kept_result(self, path: Path, resume: bool) -> dict[str, Any] | None:
        """The result of a finished run whose checkpoints are gone (the committed runs of results/
        keep none) when it was trained with this training config; with another one, or when not
        resuming, an error: training would replace the result."""
        if not path.is_file():
            return None
        try:
            result = json.loads(path.read_text())
            if result.get("status") not in FINISHED:
                return None
            theirs = _resumable(_json_canonical(RunConfig.from_dict(result["config"]).training_dict()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None  # unreadable, or of a config this lcsm no longer reads: trained anew
        where = f"out_dir: {str(self.out_dir)!r} holds the result of a finished run (result.json, no checkpoints)"
        if not resume:
            raise ValueError(f"{where}; resume it, or start over with --restart (deletes it) or another --out")
        changed = sorted(_diff_keys(theirs, _resumable(_json_canonical(self.config.training_dict()))))
        if changed:
            raise ValueError(
                f"{where} of a different training config (differs in {', '.join(changed)}); training would "
                "replace it. Train this one into another --out, or start over with --restart (deletes the run)"
            )
        return result

    def _nonfinite(self, step: int, loss: float, norm: float, lr: float, result_path: Path) -> None:
        """A step whose loss or gradient norm is nan or infinite (its update was not applied):
        skipped and counted, or the run stops as diverged, its last checkpoint the last good one."""
        s = self.state
        what = f"step {step}: loss {loss}, gradient norm {norm}"
        if self.config.run.on_nonfinite == "skip":
            s.skipped_steps += 1
            if self.dist.is_main:
                ckpt.warn(f"warning: {what}: not finite, step skipped ({s.skipped_steps} so far)")
            return
        self.progress.close()
        s.elapsed += time.perf_counter() - self._clock
        if self.dist.is_main:
            self.log.write("train", step, {"loss": loss, "lr": lr, "grad_norm": norm, "tokens": s.tokens})
            self.log.write_csv()
            result = {**self._result("diverged", None), "diverged_at_step": step}
            write_atomic(result_path, json.dumps(json_safe(result), indent=2, allow_nan=False))
        saved = ckpt.list_checkpoints(self.out_dir)
        kept = f"its newest checkpoint is of step {saved[-1][0]}" if saved else "it wrote no checkpoint"
        raise TrainingDiverged(
            f"{what}: not finite, the run diverged and stopped (result.json status 'diverged'; {kept}). "
            "Lower optim.lr or set optim.grad_clip, or set run.on_nonfinite: skip to skip such steps"
        )

    def final_test(self) -> dict[str, Any] | None:
        """The test split's metrics of the best checkpoint (the last weights without one), when the
        run selected on another split: the papers report test numbers of the model chosen on
        validation (LCSM Tables 4-9, ETSMLP Table 1). None when the run evaluated on test itself."""
        if self.eval_split == "test" or "test" not in self.task.splits:
            return None
        best = ckpt.checkpoint_dir(self.out_dir) / ckpt.BEST
        which = "last"
        if self.state.best_step is not None and best.is_dir():
            problem = ckpt.damage(best, trainer=False)
            problem = None if problem is None else f"is damaged: {problem}"
            held = ckpt.read_info(best).get("step") if problem is None else None
            if problem is None and held != self.state.best_step:
                # written by the steps after the checkpoint a run resumed from, which the resumed
                # run (on another machine or thread count: not bit for bit) did not repeat
                problem = f"holds step {held}, not the run's best step {self.state.best_step}"
            if problem is None:
                self._load_whole(best)
                which = "best"
            elif self.dist.is_main:
                ckpt.warn(f"warning: checkpoint {best} {problem}; testing the last weights instead")
        note = self._data_note(["test"])
        if note:
            self.progress.message(note)
        metrics = self.evaluate("test", gather=which == "last")
        self.progress.message(
            "test (" + which + " weights): " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "/" not in k)
        )
        return {
            "checkpoint": which,
            "step": self.state.best_step if which == "best" else self.state.step,
            "metrics": metrics,
        }

    def finish(self, result_path: Path) -> dict[str, Any]:
        """The final evaluation and result, after the last weights' checkpoint (``run``), so that
        nothing going wrong here (an error, Ctrl-C) loses trained steps: run again, the run
        evaluates afresh from that checkpoint."""
        s = self.state
        if s.last_eval_step != s.step:
            self.after_eval(self.evaluate())
        elif self.eval_split == "test" and self._examples is None:
            # Resumed after its final evaluation: the same weights again, for the examples of it
            # (not counted as another evaluation: early stopping has seen this one).
            self.evaluate()
        s.elapsed += time.perf_counter() - self._clock
        result = self._result("early_stopped" if s.stopped_early else "completed", self.final_test())
        if self.dist.is_main:
            if self._examples is not None and self._examples[0] == "test":
                write_examples(self.out_dir / EXAMPLES_FILE, self._examples[1])
            write_atomic(result_path, json.dumps(json_safe(result), indent=2, allow_nan=False))
            self.log.write_csv()
            self.log.close()
            self.progress.message(
                f"done: {result['status']} at step {s.step}; checkpoints in "
                f"{ckpt.checkpoint_dir(self.out_dir)}; result {result_path}"
            )
        return result

    def _result(self, status: str, test: dict[str, Any] | None) -> dict[str, Any]:
        s = self.state
        return {
            "status": status,
            "step": s.step,
            "epoch": s.epoch,
            "metrics": s.last_eval,
            "eval_split": self.eval_split,
            "best": (
                {"step": s.best_step, "metric": self.config.train.early_stop.metric, "value": s.best_value}
                if s.best_step is not None
                else None
            ),
            "wall_time_s": round(s.elapsed, 3),
            "tokens": s.tokens,
            "n_params": self.n_params,
            "test": test,
            "skipped_steps": s.skipped_steps,
            "machine": {**machine_info(), "device": device_name(self.device), "host_allocator": self.host_allocator},
            "git_commit": self.git_commit,
            "trained_on": s.trained_on,
            "task_data": self.task_data(),
            "model_revisions": self.config.model_revisions(),
            "config": self.config.to_dict(),
        }


def _resumable(training: dict[str, Any] | None) -> dict[str, Any] | None:
    """A training config without the keys a resumed run may change (``TrainConfig.RESUMABLE``)."""
    if not isinstance(training, dict) or not isinstance(training.get("train"), dict):
        return training
    train = {k: v for k, v in training["train"].items() if k not in TrainConfig.RESUMABLE}
    return {**training, "train": train}


def _diff_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k in set(a) | set(b):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += _diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            keys.append(f"{prefix}{k}")
    return keys


def discard_run(out_dir: Path) -> None:
    """Delete what a run wrote (checkpoints, metrics, result), nothing else of the directory."""
    for name in (ckpt.CHECKPOINTS, "tensorboard"):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in ("metrics.jsonl", "train.csv", "eval.csv", EXAMPLES_FILE, "result.json", "config.yaml"):
        (out_dir / name).unlink(missing_ok=True)


def train(config: RunConfig, *, resume: bool = True, restart: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Train the run ``config`` describes, resuming from the newest checkpoint in its out_dir
    (``resume=False``: fail if there is one; ``restart=True``: discard it first). Returns the
    result, also written to ``<out_dir>/result.json``. Under torchrun every process calls this."""
    dist = Distributed.setup(config.run.device)
    threads = torch.get_num_threads()
    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    # Rank 0 alone writes the directory, so it alone holds it; taken before any data or model is
    # built, so a directory in use or not writable fails at once.
    lock = DirectoryLock(config.out_dir, "lcsm train") if dist.is_main else None
    try:
        refused = None
        if lock is not None:
            try:
                lock.acquire()
            except (ValueError, OSError) as err:
                refused = err
        # Every rank stops with rank 0's refusal (the others would wait for it in the next collective).
        refused = dist.broadcast(refused)
        if refused is not None:
            raise refused
        if restart:
            if dist.is_main:
                discard_run(Path(config.out_dir))
            dist.barrier()
        result = Trainer(config, dist, quiet=quiet).run(resume=resume)
        # Rank 0 finishes later (final test, result.json): every rank waits for it, so none tears
        # down its group while a peer still has collectives to run with it.
        dist.barrier()
        return result
    finally:
        if lock is not None:
            lock.release()
        torch.set_num_threads(threads)
        dist.teardown()
