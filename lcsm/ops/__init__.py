"""The EOS operator in every form: recurrent reference, parallel, chunkwise, FFT, one-step decoding,
the rotating frame of a time-invariant rotation, and the matrix-oscillation (delta-rule) variant."""

from ._inputs import LogProduct
from .delta import eos_delta
from .eos import Plan, eos, eos_step, explain
from .rotating import eos_rotating

__all__ = ["LogProduct", "Plan", "eos", "eos_delta", "eos_rotating", "eos_step", "explain"]
