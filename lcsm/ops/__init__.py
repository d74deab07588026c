"""The EOS operator in every form: recurrent reference, parallel, chunkwise, FFT, one-step decoding,
and the matrix-oscillation (delta-rule) variant."""
from .delta import eos_delta
from .eos import Plan, eos, eos_step, explain

__all__ = ["Plan", "eos", "eos_delta", "eos_step", "explain"]
