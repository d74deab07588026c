"""The operators' first CPU call lets glibc keep freed blocks in its heap (``ops/_host_heap.py``),
so a library caller's process does not map and fault in the chunk kernel's buffers afresh on
every call, and nothing is set with mallopt."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from lcsm.ops import _host_heap, causal_fft_conv, eos

# Forward and backward of the chunk form at T 1024 (row decay): the median of the minor page faults
# of eight calls after two warm-up calls (a call now and then grows the heap; the median is the
# call that reuses it). "unprimed" marks the process as already asked, so the operator leaves
# glibc's thresholds where a small process keeps them.
FAULTS = """
import resource, statistics, sys, torch
from lcsm.ops import _host_heap, eos
if sys.argv[1] == "unprimed":
    _host_heap._state["primed"] = False
g = torch.Generator().manual_seed(0)
B, T, H, K, D = 1, 1024, 4, 64, 64
x = [torch.randn(B, T, H, n, generator=g).requires_grad_() for n in (D, K, K)]
log_o = (-torch.rand(B, T, H, K, 1, generator=g) / 16).requires_grad_()
def call():
    y = eos(*x, log_o, mode="chunk")[0]
    y.backward(torch.ones_like(y))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = [call() for _ in range(11)][2:]
print(_host_heap._state["primed"])
print(statistics.median(b - a for a, b in zip(counts, counts[1:])))
"""


def faults_per_call(how: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.check_output([sys.executable, "-c", FAULTS, how], text=True, timeout=120, env=env)
    primed, faults = out.split("\n")[:2]
    return primed, float(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's dynamic mmap threshold")
def test_first_cpu_call_keeps_the_kernels_buffers_in_the_heap():
    # The fewest of three processes each way: on some machines a process's count swings from 0 to
    # ~500 whether primed or not (a 2-core AMD EPYC: primed 0-121, unprimed 0-543), where a single
    # pair failed now and then with nothing to remove.
    unprimed = [faults_per_call("unprimed")]
    if unprimed[0][1] > 500:
        unprimed += [faults_per_call("unprimed") for _ in range(2)]
    without = min(f for _, f in unprimed)
    assert {p for p, _ in unprimed} == {"False"}
    if without <= 500:  # 3,000-4,500 a call on others: the buffers mapped and faulted in again each time
        pytest.skip(f"without the priming this malloc faults in {without:.0f} pages a call: nothing to remove")
    primed = [faults_per_call("primed") for _ in range(3)]
    assert {p for p, _ in primed} == {"True"}
    assert min(f for _, f in primed) < without / 10


def test_priming_waits_for_a_cpu_tensor(monkeypatch):
    monkeypatch.setitem(_host_heap._state, "primed", None)
    assert _host_heap.prime_host_heap("not a tensor") is None
    assert _host_heap.prime_host_heap(torch.empty(0, device="meta")) is None
    expected = platform.libc_ver()[0] == "glibc"
    assert _host_heap.prime_host_heap(torch.zeros(1)) is expected
    assert _host_heap._state["primed"] is expected


def test_the_long_convolution_primes_too(monkeypatch):
    """causal_fft_conv (S4, S4D, CES, TNN) primes on its first CPU call, as eos does."""
    monkeypatch.setitem(_host_heap._state, "primed", None)
    causal_fft_conv(torch.randn(3, 5), torch.randn(2, 3, 5), -1)
    assert _host_heap._state["primed"] is (platform.libc_ver()[0] == "glibc")


def test_no_operator_call_sets_mallopt(monkeypatch):
    """The priming only mallocs and frees: no malloc setting of the caller's is changed."""
    monkeypatch.setitem(_host_heap._state, "primed", None)
    calls = []
    real = _host_heap.ctypes.CDLL

    class Recorder:
        def __init__(self, *args, **kwargs):
            self._lib = real(*args, **kwargs)

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self._lib, name)

    monkeypatch.setattr(_host_heap.ctypes, "CDLL", Recorder)
    x = torch.randn(1, 8, 1, 4)
    eos(x, x, x, mode="chunk")
    assert "mallopt" not in calls
    assert set(calls) == ({"malloc", "free"} if platform.libc_ver()[0] == "glibc" else set())
