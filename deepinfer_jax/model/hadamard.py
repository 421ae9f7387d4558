"""The orthonormal Walsh-Hadamard rotation of V4-Flash's indexer (spec §3.2).

Index queries and keys are both rotated (after RoPE, before their FP4 fake-quant) by H / sqrt(n), H the
Sylvester-order Hadamard matrix of size n = index_head_dim (natural order, as ``fast_hadamard_transform``).
Because H / sqrt(n) is orthonormal the exact scores q.k do not change; what the rotation changes is
what the FP4 quantizer sees (outliers spread over the block), so it matters only with fake_quant on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def hadamard_matrix(n: int) -> np.ndarray:
    """float64 [n, n] Sylvester Hadamard matrix scaled by n^-0.5 (orthonormal and symmetric)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotate(x: jax.Array) -> jax.Array:
    """x[..., n] @ H_n / sqrt(n) in fp32 (H symmetric, so row or column convention agree); result in x.dtype."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]), jnp.float32)
    y = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
