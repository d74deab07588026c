"""Training a sweep's runs: each one ``lcsm train`` in a subprocess, N at a time, their output
prefixed with the run's id; SIGINT and SIGTERM stop the sweep after its running runs checkpoint,
and on Linux a sweep that dies (SIGKILL, out of memory) stops them too."""

from __future__ import annotations

import copy
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import yaml

from ..config import runtime_out_of_train
from ..lock import live_holder
from .grid import Run

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# How long a run's directory held by another process (the run of a sweep that was killed, still
# writing its checkpoint) is waited for before its ``lcsm train`` is started anyway (and refused).
LOCK_WAIT_S = 60.0


def _train_command(run: Run) -> list[str]:
    return [sys.executable, "-m", "lcsm", "train", str(run.out_dir / "config.yaml")]


def _stop_with(parent: int):
    """The ``preexec_fn`` that has a run get SIGTERM when the sweep dies, or None off Linux. SIGKILL
    of the sweep runs no handler of its own, and the run it left would train on, holding its
    directory; SIGTERM makes it checkpoint and exit (130) as when the sweep passes a signal on.
    The signal follows the thread that started the run, which ``execute`` keeps until its runs
    have ended. The function is looked up here: between fork and exec, beside the threads that
    pump the runs' output, the child only calls it (no import, no lock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM))
        if os.getppid() != parent:  # the sweep died before the call: no signal will come
            os._exit(128 + signal.SIGTERM)

    return preexec


def _wait_for_holder(run: Run, log) -> None:
    """Wait up to ``LOCK_WAIT_S`` while another process holds the run's directory."""
    holder = live_holder(run.out_dir)
    if holder is None:
        return
    log(
        f"--- run {run.id}: in use by {holder.get('command', 'another lcsm process')} (pid {holder.get('pid')}, "
        f"since {holder.get('started')}), a run of an earlier sweep still stopping? waiting up to "
        f"{LOCK_WAIT_S:.0f} s for it (if it is still training then, wait for it or stop it, and run the sweep again)"
    )
    deadline = time.monotonic() + LOCK_WAIT_S
    while live_holder(run.out_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.2)


def log_prefix(run_id: str, width: int = 48) -> str:
    """The tag of a run's lines in parallel output: ids share their leading labels (task, width, ...)
    and differ towards the end, so a long id keeps its tail (last labels and hash)."""
    return run_id if len(run_id) <= width else "..." + run_id[-(width - 3) :]


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        for part in line.replace("\r", "\n").splitlines():
            if part.strip():
                sink.write(f"[{prefix}] {part}\n")
                sink.flush()


class SweepStopped(KeyboardInterrupt):
    """SIGINT or SIGTERM (``signum``) stopped the sweep after its running runs checkpointed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise SweepStopped(signum)


def execute(runs: Sequence[Run], *, parallel: int = 1, log=print) -> dict[str, int]:
    """Run ``runs`` (N at a time), each ``lcsm train`` in a subprocess; returns exit codes by id.
    With N > 1 each run gets cores / N torch threads and its output is prefixed with its id."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // parallel)
    codes: dict[str, int] = {}
    pending = list(runs)
    active: list[tuple[Run, subprocess.Popen, list[threading.Thread]]] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    preexec = _stop_with(os.getpid())
    # SIGINT and SIGTERM stop the sweep as they stop each run (the trainer takes both whatever it
    # inherited): a shell's background job starts with SIGINT ignored, and the sweep would go on to
    # the next run; SIGTERM sent to the sweep alone would kill it and leave its runs training.
    main_thread = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in stops}
    try:
        while pending or active:
            while pending and len(active) < parallel:
                run = pending.pop(0)
                _wait_for_holder(run, log)
                run.out_dir.mkdir(parents=True, exist_ok=True)
                config = copy.deepcopy(runtime_out_of_train(run.config))
                if parallel > 1:
                    config["run"] = {**(config.get("run") or {}), "threads": threads}
                (run.out_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                log(f"--- run {run.id} ({len(codes) + len(active) + 1}/{len(codes) + len(active) + 1 + len(pending)})")
                if parallel == 1:
                    proc = subprocess.Popen(_train_command(run), env=env, preexec_fn=preexec)
                    pumps = []
                else:
                    proc = subprocess.Popen(
                        _train_command(run),
                        env=env,
                        preexec_fn=preexec,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        bufsize=1,
                    )
                    pumps = [
                        threading.Thread(target=_pump, args=(proc.stdout, log_prefix(run.id), sys.stdout), daemon=True)
                    ]
                    pumps[0].start()
                active.append((run, proc, pumps))
            for item in list(active):
                run, proc, pumps = item
                if proc.poll() is not None:
                    for t in pumps:
                        t.join()
                    codes[run.id] = proc.returncode
                    if proc.returncode != 0:
                        log(f"--- run {run.id} failed (exit {proc.returncode}); the other runs go on")
                    active.remove(item)
            time.sleep(0.05)
    except KeyboardInterrupt:
        # Ctrl-C reached the runs too (one process group), a SIGTERM to the sweep did not. SIGTERM
        # asks a run to stop after its step whether or not it was already asked; a second SIGINT
        # would stop it at once, without the checkpoint of that step.
        for _, proc, _ in active:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in active:
            proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return codes
