"""Efficiency benchmark (ETSMLP Fig. 3, MetaLA Fig. A2): causal LMs of one size
with different token mixers, side by side in one run, on the CPU (default) or a CUDA device.

    training   forward + backward tokens/s of one step (batch 1, cross-entropy on random tokens, no
               optimizer step) against sequence length T; the ratio to the Transformer at each T
    memory     peak extra memory of that step per (model, T): on the CPU the resident set, each in a
               fresh process; on CUDA the caching allocator's peak of allocated device memory
    decoding   per-token latency of one-step decoding (the call ``CausalLM.generate`` makes per
               token: recurrent state, or the KV cache for attention) after a prefill of length P,
               on one thread, the streams of every (model, P) stepped in turns, in a new random order
               each turn

Host memory for the timed parts is kept as lcsm's training processes keep it (``--allocator``,
``run.host_allocator``); the memory workers use glibc's mmap for large blocks instead, so their
resident set follows the live tensors.

Models (same d_model, depth and vocabulary; a SwiGLU channel mixer wherever the architecture has
one): transformer (softmax attention with rotary positions, head width 64), s4 (built for each
length, ``model_config``), etsmlp (CES inside
the element-wise MLP block, no channel mixer), gla, mamba, metala (the MetaLA Transformer preset),
mamba2, mlstm, and hybrid (Samba's pattern: mamba2 and sliding-window attention, window 512,
alternating).
Run from the repository root:

    lcsm bench efficiency [--out FILE] [--quick] [--repeats N] [--threads N] [--allocator retain|system]
                          [--device cpu|cuda[:N]|auto]

On CUDA every timer waits for the device (``torch.cuda.synchronize``) before it starts and stops.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import Check, proc_status_kib, provenance_header, run_memory_worker, write_out
from lcsm._provenance import device_name
from lcsm.engine.distributed import resolve_device
from lcsm.engine.host_memory import HOST_ALLOCATORS, use_host_allocator
from lcsm.engine.monitor import write_atomic
from lcsm.engine.stats import ratio_interval
from lcsm.models import HeadConfig, ModelConfig, build_model, preset

BASELINE = "transformer"
LINEAR = ("s4", "etsmlp", "gla", "mamba", "metala", "mamba2", "mlstm", "hybrid")
MODELS = (BASELINE,) + LINEAR
# The targets the checks hold the linear mixers to (set for a 2-core CPU): training speedup over
# the Transformer at the longest T, and growth of decoding latency from the shortest to the longest
# prefill.
TRAIN_SPEEDUP = 3.0
HYBRID_WINDOW = 512
DECODE_GROWTH = 1.2
# ETSMLP's block has no channel mixer: its MLP hidden width carries the parameters. 6 d gives the
# block 2 * d * 6d = 12 d^2 weights, those of an attention + SwiGLU block (4 d^2 + 3 * d * 8d/3),
# so the models are of comparable size, as in ETSMLP Fig. 3 (both about 30M parameters there).
ETSMLP_HIDDEN = 6
DECODE_BURST = 4  # decoding steps per stream per turn (see run)


@dataclass(frozen=True)
class Sizes:
    d_model: int
    n_layers: int
    vocab: int
    train: tuple[int, ...]  # sequence lengths of the training and memory sweeps
    memory: tuple[int, ...]
    decode: tuple[int, ...]  # prefill (context) lengths of the decoding sweep
    decode_steps: int  # timed one-token steps per context, a multiple of DECODE_BURST
    repeats: int  # rounds of timed training steps, one per (model, T) each


FULL = Sizes(
    d_model=128,
    n_layers=2,
    vocab=256,
    train=(512, 1024, 2048, 4096, 8192, 16384),
    memory=(512, 1024, 2048, 4096, 8192, 16384),
    decode=(1024, 2048, 4096, 8192, 16384),
    decode_steps=64,
    repeats=5,
)
QUICK = Sizes(
    d_model=32, n_layers=1, vocab=64, train=(64, 128), memory=(128,), decode=(64, 128), decode_steps=8, repeats=2
)


def model_config(name: str, z: Sizes, length: int | None = None) -> ModelConfig:
    """The model ``name`` at sizes z. S4 is built for ``length`` (default: the longest training
    length), the sequence length it trains at or the context it decodes after: ``l_max``, as the
    official code sets it to the task's length, in which the parameter is C~ for that length and the
    kernel needs no power of A_bar (lcsm's default forms C~ from C by a matrix power at every step,
    for any T; the step loop still runs past l_max)."""
    common = dict(d_model=z.d_model, n_layers=z.n_layers, vocab_size=z.vocab, head=HeadConfig(kind="lm"))
    if name == "s4":
        return ModelConfig(mixer="s4", mixer_options=dict(l_max=length or max(z.train)), **common)
    if name == "transformer":
        return ModelConfig(
            mixer="attention", mixer_options=dict(heads=max(1, z.d_model // 64), positions="rotary"), **common
        )
    if name == "etsmlp":
        return ModelConfig(mixer="ces", mixer_hidden=ETSMLP_HIDDEN * z.d_model, channel_mixer="none", **common)
    if name == "metala":
        # The preset's LM head is untied (a 50K vocabulary); tied here like every other model.
        return preset("metala_transformer", mixer_options=dict(heads=4, conv_size=4), tie_embeddings=True, **common)
    if name == "hybrid":
        attention = dict(heads=max(1, z.d_model // 64), positions="rotary", window=HYBRID_WINDOW)
        # --quick's single layer could not hold both mixers: there the hybrid has two.
        common["n_layers"] = max(2, z.n_layers)
        return ModelConfig(
            mixer={"default": "mamba2", "every": {"k": 2, "mixer": "attention"}},
            mixer_options={"attention": attention},
            **common,
        )
    return ModelConfig(mixer=name, **common)


def describe(name: str, cfg: ModelConfig) -> str:
    # S4's l_max follows the length it is built for (model_config): named, not given a number.
    opts = ", ".join(f"{k}={'T' if k == 'l_max' else v}" for k, v in cfg.mixer_options.items())
    block = f"mixer {cfg.mixer}" + (f"({opts})" if opts else "")
    if cfg.mixer_hidden is not None:
        block += f" inside Linear(d, {cfg.mixer_hidden}) ... Linear({cfg.mixer_hidden}, d)"
    block += ", no channel mixer" if cfg.channel_mixer == "none" else f", {cfg.channel_mixer} channel mixer"
    return block


def tokens(T: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (1, T + 1), generator=torch.Generator().manual_seed(seed)).to(device)


def train_step(model, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=False)
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).backward()


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels: CUDA calls return before their work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


class Decoder:
    """One (model, context) decoding stream: a random prompt of ``context`` tokens prefilled with
    state, then greedy one-token steps, each the forward-with-state call ``CausalLM.generate``
    makes per token (the recurrent state, or the KV cache for attention)."""

    @torch.no_grad()
    def __init__(self, model, context: int, vocab: int, device: torch.device):
        self.model, self.device = model.eval(), device
        prompt = tokens(context - 1, vocab, seed=context, device=device)

        def prefill() -> None:
            self.logits, self.state = model(prompt, return_state=True)

        self.prefill = timed(prefill, device)
        self.times: list[float] = []

    def _next(self) -> None:
        self.logits, self.state = self.model(
            self.logits[:, -1].argmax(-1, keepdim=True), state=self.state, return_state=True
        )

    @torch.no_grad()
    def step(self, record: bool = True) -> None:
        elapsed = timed(self._next, self.device)
        if record:
            self.times.append(elapsed)


# ----------------------------------------------------------------------------- peak memory


def primed_step(z: Sizes, name: str, T: int, device: torch.device):
    """(model, ids) for measuring one training step's memory: a small step first allocates the
    parameter gradients and loads lazily initialised kernels, so the measured step's extra memory
    is its activations and temporaries alone."""
    torch.manual_seed(0)
    model = build_model(model_config(name, z, T), verbose=False).to(device)
    train_step(model, tokens(min(64, T), z.vocab, seed=1, device=device))
    return model, tokens(T, z.vocab, seed=2, device=device)


def memory_worker(spec: dict) -> dict:
    """In a fresh process: the peak resident set above its pre-step baseline of one training step
    of one (model, T) (``primed_step``)."""
    z = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["sizes"].items()})
    torch.set_num_threads(spec["threads"])
    model, ids = primed_step(z, spec["model"], spec["T"], torch.device("cpu"))
    gc.collect()
    base = proc_status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    train_step(model, ids)
    return {"peak_bytes": (proc_status_kib("VmHWM") - base) * 1024}


def cuda_peak_memory(z: Sizes, name: str, T: int, device: torch.device):
    """Bytes above the pre-step allocation of one training step on a CUDA device (the caching
    allocator's peak: what the step's tensors held, not what the allocator reserved), or a string
    saying why not. In this process: the allocator's counters are per device, not per process."""
    try:
        model, ids = primed_step(z, name, T, device)
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, ids)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError among them: a note, not an abort
        return f"{type(exc).__name__}: {exc}".splitlines()[0]


def peak_memory(z: Sizes, name: str, T: int, threads: int):
    """Bytes, or a string saying why not."""
    peak = run_memory_worker(
        "bench.efficiency_bench", {"sizes": asdict(z), "model": name, "T": T, "threads": threads}, timeout=900
    )
    return peak if isinstance(peak, str) else int(peak)


# ----------------------------------------------------------------------------- the run


@dataclass
class Results:
    params: dict[str, int]
    configs: dict[str, str]
    train: dict[tuple[str, int], list[float]]  # step seconds, one per round
    memory: dict[tuple[str, int], object]  # bytes or a reason
    prefill: dict[tuple[str, int], float]
    decode: dict[tuple[str, int], float]  # seconds per token
    decode_turns: dict[tuple[str, int], list[float]]  # seconds per token, mean of each turn's burst
    notes: list[str]
    device: torch.device


def run(
    z: Sizes,
    threads: int,
    device: torch.device,
    log: Callable[[str], None],
    done: Callable[[Results, str], None] = lambda r, stage: None,
) -> Results:
    """Every measurement of ``z``; ``done(r, stage)`` after each stage (a training length, the
    decoding, the memory), so that a run cut off (a GPU loan's time) keeps what it measured."""
    r = Results({}, {}, {}, {}, {}, {}, {}, [], device)
    models = {}
    for name in MODELS:
        torch.manual_seed(0)
        cfg = model_config(name, z)
        models[name] = build_model(cfg, verbose=False).to(device)
        r.params[name] = models[name].num_parameters()
        r.configs[name] = describe(name, cfg)
        log(f"built {name}: {r.params[name]:,} parameters")
        # warm-up: lazy initialisation, the allocator's first blocks, CUDA's kernel loading
        train_step(models[name], tokens(z.train[0], z.vocab, seed=0, device=device))

    # All models at one T before the next T, and in rounds: round k times every model once (in
    # turn forwards, then backwards), so the k-th timings of two models are taken seconds apart and
    # their ratio is paired against the machine's drift (``ratio_interval``).
    for T in z.train:
        ids = tokens(T, z.vocab, seed=T, device=device)
        # S4 is built for the length it trains at (``model_config``), as the official code sets
        # l_max to the task's length: one model per T, from the same seed.
        torch.manual_seed(0)
        models["s4"] = build_model(model_config("s4", z, T), verbose=False).to(device)
        running = []
        for name in MODELS:
            try:
                # one untimed step at each length: a model's first step at a new length pays for
                # new allocation sizes and page faults (GLA: 20-30% slower than the next ones)
                train_step(models[name], ids)
                running.append(name)
            except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
                r.notes.append(f"training {name} T={T} failed: {type(exc).__name__}: {exc}")
        for k in range(z.repeats):
            for name in list(running if k % 2 == 0 else running[::-1]):
                try:
                    r.train.setdefault((name, T), []).append(timed(partial(train_step, models[name], ids), device))
                except (RuntimeError, MemoryError) as exc:
                    r.notes.append(f"training {name} T={T} failed in round {k}: {type(exc).__name__}: {exc}")
                    r.train.pop((name, T))
                    running.remove(name)
        for name in running:
            log(f"train {name:11s} T={T:6d}: {T / statistics.median(r.train[name, T]):9.0f} tokens/s")
        models_grad_free(models)
        done(r, f"training at T={T}")

    # Every stream is prefilled first, then all are stepped in turns, a few steps each: the 1K and
    # 16K contexts of a model are timed interleaved, minutes apart at most, so a change in the
    # machine's load shifts both alike instead of bending the latency ratio. One thread: at batch 1
    # every op is tiny and OpenMP workers waiting on each other on a shared machine dominate.
    # The order is shuffled every turn: in a fixed order a stream always follows the same
    # neighbours, and the linear mixers' latency seemed to grow with P (measurements in CHANGELOG.md,
    # 2026-12-03), likely because the Transformer's P-sized KV cache, read a few streams before,
    # leaves less of their weights in the CPU cache.
    torch.set_num_threads(1)
    streams = {}
    for P in z.decode:
        torch.manual_seed(0)
        models["s4"] = build_model(model_config("s4", z, P), verbose=False).to(device)  # for its context
        for name in MODELS:
            try:
                streams[name, P] = Decoder(models[name], P, z.vocab, device)
                streams[name, P].step(record=False)  # the first call at new shapes pays one-off costs
            except (RuntimeError, MemoryError) as exc:
                r.notes.append(f"decoding {name} context {P} failed: {type(exc).__name__}: {exc}")
    order, rng = list(streams.values()), random.Random(0)
    for _ in range(z.decode_steps // DECODE_BURST):
        rng.shuffle(order)
        for stream in order:
            for _ in range(DECODE_BURST):
                stream.step()
    for (name, P), stream in streams.items():
        r.prefill[name, P], r.decode[name, P] = stream.prefill, statistics.median(stream.times)
        r.decode_turns[name, P] = [
            statistics.fmean(stream.times[k : k + DECODE_BURST]) for k in range(0, len(stream.times), DECODE_BURST)
        ]
        log(f"decode {name:11s} P={P:6d}: {r.decode[name, P] * 1e3:8.2f} ms/token")
    done(r, "decoding")
    torch.set_num_threads(threads)
    del streams
    del models

    cells = [(name, T) for T in z.memory for name in MODELS]
    if device.type == "cuda":
        # One cell at a time in this process: the allocator's peak counter is per device.
        gc.collect()
        torch.cuda.empty_cache()
        measure, workers = (lambda c: cuda_peak_memory(z, c[0], c[1], device)), 1
    else:
        # Two workers at once on 1 thread each: peak RSS is per process, so they cannot disturb
        # each other's numbers, and nothing is being timed any more.
        measure, workers = (lambda c: peak_memory(z, c[0], c[1], 1)), 2
    with ThreadPoolExecutor(workers) as pool:
        for (name, T), value in zip(cells, pool.map(measure, cells), strict=False):
            r.memory[name, T] = value
            shown = f"{value / 2**20:.1f} MiB" if isinstance(value, int) else value
            log(f"memory {name:11s} T={T:6d}: {shown}")
    return r


def models_grad_free(models) -> None:
    """Drop the gradients between lengths, so the next length's timings start from the same heap."""
    for m in models.values():
        m.zero_grad(set_to_none=True)
    gc.collect()


# ----------------------------------------------------------------------------- checks and output


def tps(r: Results, name: str, T: int) -> float | None:
    times = r.train.get((name, T))
    return T / statistics.median(times) if times else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speedup_interval(r: Results, name: str, T: int) -> tuple[float, float, float] | None:
    """The model's training tokens/s over the Transformer's at T, paired by round, with its 95%
    interval (``ratio_interval``); None with fewer than two rounds of both."""
    base, own = r.train.get((BASELINE, T)), r.train.get((name, T))
    if not base or not own or len(base) != len(own) or len(own) < 2:
        return None
    return ratio_interval(base, own)


def growth_interval(r: Results, name: str, P0: int, P1: int, against: str | None = None):
    """Decoding latency at context P1 over P0, paired by turn, with its 95% interval; with
    ``against``, that model's growth over this one's (how much faster its latency grows)."""
    turns = [r.decode_turns.get((n, P)) for n in (name, against or name) for P in (P0, P1)]
    if any(not t for t in turns) or len({len(t) for t in turns}) != 1 or len(turns[0]) < 2:
        return None
    if against is None:
        return ratio_interval(turns[1], turns[0])
    own = [b / a for a, b in zip(turns[0], turns[1], strict=True)]
    return ratio_interval([b / a for a, b in zip(turns[2], turns[3], strict=True)], own)


def _with_interval(x: tuple[float, float, float] | None) -> str:
    return "—" if x is None else f"{x[0]:.2f} [{x[1]:.2f}, {x[2]:.2f}]"


def checks(r: Results, z: Sizes) -> list[Check]:
    T, P0, P1 = z.train[-1], z.decode[0], z.decode[-1]
    out = []
    speedups = {n: ratio(tps(r, n, T), tps(r, BASELINE, T)) for n in LINEAR}
    growth = {n: ratio(r.decode.get((n, P1)), r.decode.get((n, P0))) for n in MODELS}
    for n in LINEAR:
        out.append(
            Check(f"{n} / transformer training tokens/s, T={T}", speedups[n], ">=", TRAIN_SPEEDUP, "not measured")
        )
    for n in LINEAR:
        out.append(Check(f"{n} decoding latency, context {P1} / {P0}", growth[n], "<=", DECODE_GROWTH, "not measured"))
    measured = {n: v for n, v in speedups.items() if v is not None}
    if measured:
        best = max(measured, key=measured.get)
        out.append(
            Check(
                f"must-show: best linear mixer ({best}) / transformer training tokens/s, T={T}",
                measured[best],
                ">=",
                TRAIN_SPEEDUP,
            )
        )
        flat = [n for n in LINEAR if growth[n] is not None]
        if flat:
            worst = max(flat, key=growth.get)
            out.append(
                Check(
                    f"must-show: decoding latency growth {P0} -> {P1}, worst linear mixer ({worst})",
                    growth[worst],
                    "<=",
                    DECODE_GROWTH,
                )
            )
    return out


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def render(r: Results, z: Sizes, header: dict[str, str]) -> str:
    L = ["# lcsm efficiency benchmark (training throughput, peak memory, decoding latency)", ""]
    L += [f"- {k}: {v}" for k, v in header.items()]
    L += [
        "",
        f"Causal LMs, d_model {z.d_model}, {z.n_layers} layers, vocabulary {z.vocab}, float32, batch 1, "
        f"on {r.device} "
        f"(so tokens per batch = T). Training: forward + backward of the cross-entropy on random tokens, "
        f"median of {z.repeats} timed steps after an untimed one of each model at each length, in {z.repeats} "
        f"rounds that time every model once (forwards, then backwards); no optimizer "
        f"step. Decoding: median of {z.decode_steps} one-token steps (after one warm-up step) following a "
        f"prefill of P tokens, greedy, no gradients, 1 CPU thread; the streams of all (model, P) are stepped "
        f"in turns, {DECODE_BURST} steps each, in a new random order each turn, so that every latency ratio "
        f"compares steps taken side by side.",
        "",
        "## Models",
        "",
        "| model | block | parameters |",
        "| --- | --- | ---: |",
    ]
    L += [f"| {n} | {r.configs[n]} | {r.params[n]:,} |" for n in MODELS]

    L += ["", "## Checks", ""]
    if r.device.type != "cpu":
        L += [f"The targets are set for a 2-core CPU; on {r.device.type} they are shown for comparison.", ""]
    L += ["| check | measured | target | result |", "| --- | --- | --- | --- |"]
    L += [f"| {c.name} | {_f(c.measured, '.2f')}x | {c.op} {c.target:g}x | {c.result} |" for c in checks(r, z)]

    cols = " | ".join(f"T={T}" for T in z.train)
    bar = "| --- |" + " ---: |" * len(z.train)
    L += ["", "## Training throughput (tokens/s, forward + backward)", "", f"| model | {cols} |", bar]
    L += [f"| {n} | " + " | ".join(_f(tps(r, n, T), ".0f") for T in z.train) + " |" for n in MODELS]
    L += ["", "Ratio to the Transformer at the same T (> 1: faster):", "", f"| model | {cols} |", bar]
    L += [
        f"| {n} | " + " | ".join(_f(ratio(tps(r, n, T), tps(r, BASELINE, T)), ".2f") for T in z.train) + " |"
        for n in LINEAR
    ]
    L += [
        "",
        f"The same ratio paired by round, with its 95% interval (geometric mean of the {z.repeats} rounds' "
        "ratios, Student's t over their logs; `lcsm.engine.stats.ratio_interval`):",
        "",
        f"| model | {cols} |",
        bar,
    ]
    L += [f"| {n} | " + " | ".join(_with_interval(speedup_interval(r, n, T)) for T in z.train) + " |" for n in LINEAR]
    L += ["", "Spread of the timed steps, (max - min) / median, in % (a noise gauge):", "", f"| model | {cols} |", bar]
    L += [
        f"| {n} | "
        + " | ".join(
            _f(
                100 * (max(r.train[n, T]) - min(r.train[n, T])) / statistics.median(r.train[n, T])
                if (n, T) in r.train
                else None,
                ".0f",
            )
            for T in z.train
        )
        + " |"
        for n in MODELS
    ]

    mcols = " | ".join(f"T={T}" for T in z.memory)
    mbar = "| --- |" + " ---: |" * len(z.memory)

    def mib(v):
        return f"{v / 2**20:.1f}" if isinstance(v, int) else "n/a"

    how = (
        "above the pre-step allocation, the CUDA caching allocator's peak"
        if r.device.type == "cuda"
        else "above the pre-step resident set; fresh process per cell, 1 thread"
    )
    L += [
        "",
        f"## Peak memory of one training step (MiB {how})",
        "",
        f"| model | {mcols} | bytes / token at T={z.memory[-1]} |",
        mbar + " ---: |",
    ]
    for n in MODELS:
        last = r.memory.get((n, z.memory[-1]))
        per_tok = f"{last / z.memory[-1]:.0f}" if isinstance(last, int) else "n/a"
        L.append(f"| {n} | " + " | ".join(mib(r.memory.get((n, T))) for T in z.memory) + f" | {per_tok} |")
    L += [f"- {n} T={T}: {v}" for (n, T), v in r.memory.items() if not isinstance(v, int)]

    dcols = " | ".join(f"P={P}" for P in z.decode)
    dbar = "| --- |" + " ---: |" * len(z.decode)
    P0, P1 = z.decode[0], z.decode[-1]
    L += [
        "",
        "## Decoding (ms per token after a prefill of P tokens; tokens/s = 1000 / ms at batch 1)",
        "",
        f"| model | {dcols} | latency P={P1} / P={P0} | tokens/s at P={P1} |",
        dbar + " ---: | ---: |",
    ]
    for n in MODELS:
        lat = [r.decode.get((n, P)) for P in z.decode]
        L.append(
            f"| {n} | "
            + " | ".join(_f(x and x * 1e3, ".2f") for x in lat)
            + f" | {_f(ratio(lat[-1], lat[0]), '.2f')}x | {_f(lat[-1] and 1 / lat[-1], '.0f')} |"
        )
    L += [
        "",
        f"Latency growth P={P1} / P={P0} paired by turn (each turn's {DECODE_BURST} steps averaged), with its 95% "
        f"interval over the {z.decode_steps // DECODE_BURST} turns; and the Transformer's growth over the model's:",
        "",
        f"| model | growth P={P1} / P={P0} | the Transformer's growth / the model's |",
        "| --- | ---: | ---: |",
    ]
    L += [
        f"| {n} | {_with_interval(growth_interval(r, n, P0, P1))} | "
        + ("itself" if n == BASELINE else _with_interval(growth_interval(r, n, P0, P1, against=BASELINE)))
        + " |"
        for n in MODELS
    ]
    L += ["", "Prefill (one forward with state, seconds):", "", f"| model | {dcols} |", dbar]
    L += [f"| {n} | " + " | ".join(_f(r.prefill.get((n, P)), ".3f") for P in z.decode) + " |" for n in MODELS]
    if r.notes:
        L += ["", "## Notes", ""] + [f"- {n}" for n in r.notes]
    return "\n".join(L) + "\n"


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="lcsm bench efficiency", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, two rounds (the smoke test)")
    p.add_argument(
        "--repeats", type=int, default=None, help="rounds of timed training steps, one step per cell (default 5)"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads for training (default 2; decoding runs on 1)"
    )
    p.add_argument("--out", default=None, help="also write the markdown report to this file")
    p.add_argument(
        "--allocator",
        choices=HOST_ALLOCATORS,
        default="retain",
        help="host memory of the timed runs, as run.host_allocator: retain (default, what lcsm's training "
        "processes use: no page faults on reused memory) or system (glibc's own mmap rules)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda, cuda:N or auto; on CUDA every timer synchronises with the device and "
        "peak memory is the caching allocator's",
    )
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_worker is not None:
        print(json.dumps(memory_worker(json.loads(args.memory_worker))))
        return 0
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    if args.threads < 1:
        p.error(f"--threads: expected an integer >= 1, got {args.threads}")
    try:
        device = resolve_device(args.device, "--device")
    except ValueError as exc:
        p.error(str(exc))
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device: got {args.device!r}, but this process sees {torch.cuda.device_count()} CUDA device(s)")
    z = QUICK if args.quick else FULL
    if args.repeats is not None:
        z = Sizes(**{**asdict(z), "repeats": args.repeats})

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    allocator = use_host_allocator(args.allocator)
    start = time.perf_counter()

    def log(msg):
        return print(f"[efficiency {time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    header = provenance_header(p.prog, argv, args.threads, out=args.out)
    header["allocator"] = allocator
    header["device"] = device_name(device)
    load_before = _load()

    def flush(r: Results, stage: str) -> None:
        # rewritten whole after each stage (renamed into place): cut off, the file keeps what was measured
        if args.out:
            text = render(r, z, {**header, "partial report": f"written after {stage}; the run did not reach its end"})
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(Path(args.out), text)

    try:
        results = run(z, args.threads, device, log, flush)
    finally:
        torch.set_num_threads(threads)
    header["load average (1/5/15 min) at start / end"] = f"{load_before}  /  {_load()}"
    header["wall time"] = f"{time.perf_counter() - start:.0f} s"
    text = render(results, z, header)
    print(text, end="")
    write_out(text, args.out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
