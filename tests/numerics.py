"""Tolerances for two fp32 computations of one value, derived from fp32 rounding, not from a run.

Two fp32 evaluations of the same mathematical quantity (chunked vs full log-softmax, packed vs
padded rows) differ only by rounding, and the order in which a CPU accumulates (AVX2 vs AVX-512
vector width, thread count, chunk boundaries) decides which roundings happen. Higham, "Accuracy
and Stability of Numerical Algorithms" (2nd ed., 2002), Lemma 3.1 and eq. (3.5): a sum of n terms
computed in floating point in any order is within gamma_n * sum(|terms|) of the exact sum, with
gamma_n = n*u / (1 - n*u) and u = 2**-24 the fp32 unit roundoff. A chain of reductions (a
log-softmax over the vocabulary, then matmuls over hidden and intermediate sizes, then a sum
over tokens for a weight gradient) composes to gamma_N with N the sum of the reduction lengths
along the chain (Higham Lemma 3.3: gamma_a + gamma_b + gamma_a*gamma_b <= gamma_{a+b}).

Each implementation is within gamma_N * S of the exact value, so the two are within 2*gamma_N*S
of each other. S, the sum of |terms| behind an element, is bounded here by the largest |value|
of the tensor compared (the terms of one gradient tensor share a scale), so
atol = 2 * gamma_N * max|want|. A real defect (a chunk dropped, a bias ignored, a wrong mask)
moves values by 1e-3 relative or more, orders of magnitude above this bound at N <= 10^4.
"""

from __future__ import annotations

import torch

FP32_UNIT_ROUNDOFF = 2.0**-24  # IEEE 754 binary32: 24-bit significand, round to nearest


def gamma(n: int, u: float = FP32_UNIT_ROUNDOFF) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error bound of an n-term fp sum."""
    assert n * u < 1, "bound undefined for n*u >= 1"
    return n * u / (1 - n * u)


def assert_close_fp32(got: torch.Tensor, want: torch.Tensor, reduction_length: int, msg: str = "") -> None:
    """`got` equals `want` up to the rounding of two fp32 evaluations with reductions of total
    length `reduction_length` along the longest chain (see the module docstring)."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    atol = 2 * gamma(reduction_length) * scale
    torch.testing.assert_close(
        got, want, rtol=0.0, atol=atol, msg=lambda m: f"{msg}: {m} (fp32 bound N={reduction_length})"
    )
