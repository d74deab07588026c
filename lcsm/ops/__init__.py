"""The EOS operator in every form: recurrent reference, parallel, chunkwise, FFT, one-step decoding,
the rotating frame of a time-invariant rotation, and the matrix-oscillation (delta-rule) variant.

Beside the operators: their mode names (``MODES`` of ``eos``, ``DELTA_MODES`` of ``eos_delta``),
the types of an oscillation argument (``LogO``, ``LogProduct``), the fused data-dependent decay
``log_sigmoid_product`` and ``autocast_off``, the context the operators run their float32 kernels
in, for layers with kernels of their own (the SSMs' FFT convolutions)."""

from ._inputs import MODES, LogProduct, autocast_off
from .decay import log_sigmoid_product
from .delta import DELTA_MODES, eos_delta
from .eos import LogO, Plan, eos, eos_step, explain
from .rotating import eos_rotating

__all__ = [
    "DELTA_MODES",
    "MODES",
    "LogO",
    "LogProduct",
    "Plan",
    "autocast_off",
    "eos",
    "eos_delta",
    "eos_rotating",
    "eos_step",
    "explain",
    "log_sigmoid_product",
]
