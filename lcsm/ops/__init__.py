"""The EOS operator in every form: recurrent reference, parallel, chunkwise, FFT, one-step decoding,
the rotating frame of a time-invariant rotation, the matrix-oscillation (delta-rule) variant and
its diagonal-plus-low-rank generalisation.

Beside the operators: their mode names (``MODES`` of ``eos``, ``DELTA_MODES`` of ``eos_delta``,
``DPLR_MODES`` of ``eos_dplr``), the types of an oscillation argument (``LogO``, ``LogProduct``),
the fused data-dependent decay ``log_sigmoid_product``, ``autocast_off``, the context the operators
run their float32 kernels in, for layers with kernels of their own (the SSMs' FFT convolutions),
``packed_bounds``, the check of ``cu_seqlens`` they share with the layers, and
``causal_fft_conv``, the FFT form's long convolution, for layers that build their kernels
themselves (S4), with ``fft_length``, the fast FFT lengths it and S4's kernel take; the native CPU
kernels layers call for their own forms (``native_s4_kernel``: S4's kernel spectrum from its
parameters, ``native_s4_spectrum`` its sums and combination;
``native_diag_scan``: CES's recurrence; ``native_block_diag``: mLSTM's block-diagonal
projections; ``native_mlstm_readout``: mLSTM's readout; ``native_causal_conv``: the short
depthwise causal convolutions; ``native_gated_rms_norm``: Mamba-2's gated RMSNorm;
``native_silu_mul``: SwiGLU's gate),
``native_serves``, whether they take a tensor's
computation, and ``native_unavailable``, why they cannot run here; ``first_order``, the mark of a
layer's own hand-written backward pass (second-order gradients through it refused)."""

from ._autograd import first_order
from ._inputs import MODES, LogProduct, autocast_off, packed_bounds
from .decay import log_sigmoid_product
from .delta import DELTA_MODES, eos_delta
from .dplr import DPLR_MODES, eos_dplr, explain_dplr
from .eos import LogO, Plan, eos, eos_step, explain
from .fft import causal_fft_conv, fft_length
from .native_scan import (
    native_block_diag,
    native_causal_conv,
    native_diag_scan,
    native_gated_rms_norm,
    native_mlstm_readout,
    native_s4_kernel,
    native_s4_spectrum,
    native_serves,
    native_silu_mul,
    native_unavailable,
)
from .rotating import eos_rotating

__all__ = [
    "DELTA_MODES",
    "DPLR_MODES",
    "MODES",
    "LogO",
    "LogProduct",
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
]
