"""HiPPO matrices (Gu et al. 2020; S4, S4D, DSS, S5): LegS, its normal part's eigenvectors
and the skew part DSS initialises from."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def hippo_legs(N: int) -> tuple[Tensor, Tensor, Tensor]:
    """HiPPO-LegS (S4 paper eq. 2, sign included) in float64: A [N, N], B [N], and the rank-1
    correction P [N] with A + P P^T normal (S4 section 3.3, Theorem 1).

        A_nk = -sqrt(2n+1) sqrt(2k+1) (n > k),  -(n+1) (n = k),  0 (n < k);  B_n = sqrt(2n+1);
        P_n = sqrt(n + 1/2).
    """
    n = torch.arange(N, dtype=torch.float64)
    r = (2 * n + 1).sqrt()
    A = -(r[:, None] * r[None, :]).tril(-1) - torch.diag(n + 1)
    return A, r.clone(), (n + 0.5).sqrt()


def hippo_normal_eig(N: int) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of the normal part S = A + P P^T of HiPPO-LegS ("HiPPO-N", S5 section 4.1):
    S = -1/2 I + K with K skew-symmetric, so S = V diag(Lambda) V^* with Lambda = -1/2 + i omega and V
    unitary. Returns (Lambda [N] complex128, V [N, N]) ordered by ascending omega, so that the
    first N/2 columns hold one eigenvector of every conjugate pair (omega < 0 for even N)."""
    A, _, P = hippo_legs(N)
    S = A + P[:, None] * P[None, :]
    K = S - torch.diag(torch.diagonal(S))
    omega, V = torch.linalg.eigh(-1j * K.to(torch.complex128))  # -iK is Hermitian: K v = i omega v
    Lam = torch.complex(torch.diagonal(S).mean().expand(N), omega)
    return Lam, V


def hippo_skew_pos_imag(N: int) -> Tensor:
    """DSS init: eigenvalues of the skew-symmetric part of HiPPO-LegS of size 2N with positive
    imaginary part (largest first), minus 1/2; complex128 [N]."""
    A, _, _ = hippo_legs(2 * N)
    skew = (A - A.t()) / 2
    ev = torch.linalg.eigvals(skew)
    ev = ev[ev.imag.argsort(descending=True)][:N]
    return torch.complex(torch.full_like(ev.real, -0.5), ev.imag)
