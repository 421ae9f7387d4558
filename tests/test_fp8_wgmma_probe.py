"""The bit move behind NOTES item -21 (benchmarks/fp8_wgmma_probe.py): an E2M1 code becomes the E4M3 byte
whose value is the E2M1 value times 2^-6, for all 16 codes, signed zero and subnormals included."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fp8_wgmma_probe import e2m1_codes_as_e4m3  # noqa: E402


def test_e2m1_to_e4m3_bit_move_is_exact_with_a_fixed_power_of_two():
    codes = np.arange(16, dtype=np.uint8)
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)   # ml_dtypes' own decoding
    moved = e2m1_codes_as_e4m3(codes).astype(np.float64)
    np.testing.assert_array_equal(moved, e2m1 * 2.0 ** -6)
    np.testing.assert_array_equal(np.signbit(moved), np.signbit(e2m1))   # code 8 is -0
    # a wrong placement (mantissa bit one place lower) must fail the same check
    s, e, m = (codes >> 3) & 1, (codes >> 1) & 3, codes & 1
    shifted = ((s << 7) | (e << 3) | (m << 1)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert not np.array_equal(shifted, e2m1 * 2.0 ** -6)
