"""The numpy QAT reference (tests/dsv4_qat.py) against hand-computed values.

Why: the engine's DeepSeek V4 FP8 KV and FP4 indexer simulations will be checked bit for bit
against this reference, so the reference itself must be right: power-of-two scales from the block
amax (with the official floors), round-half-to-even on the e4m3 / e2m1 grids, saturation instead
of NaN, zeros and sub-floor blocks, sign symmetry, and a Sylvester-ordered orthonormal Hadamard.
Every expected value below is worked out by hand in the comments, not produced by the code.
"""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_qat as Q


def _block(vals, n, fill=0.0, dtype=np.float32):
    b = np.full(n, fill, dtype=dtype)
    b[:len(vals)] = vals
    return b


# ---------------------------------------------------------------- grids


def test_e4m3_round_ties_to_even_and_saturates():
    # e4m3 steps: 0.125 in [1, 2), 0.25 in [2, 4), 32 in [256, 448]
    v = np.array([1.0625, 1.1875, 2.625, 2.875, 1.0625 + 2 ** -20, 3.0, 440.0, 448.0, 460.0, 500.0, 1e9,
                  -1.0625, -500.0, 0.0], np.float32)
    want = np.array([1.0, 1.25, 2.5, 3.0, 1.125, 3.0, 448.0, 448.0, 448.0, 448.0, 448.0,
                     -1.0, -448.0, 0.0], np.float32)
    np.testing.assert_array_equal(Q.e4m3_round(v), want)


def test_e4m3_round_subnormals():
    # subnormal e4m3 values are k * 2^-9 (k = 1..7); 2^-10 is a tie between 0 and 2^-9 -> 0 (even);
    # 3 * 2^-10 is a tie between 2^-9 (odd) and 2^-8 (even) -> 2^-8
    v = np.array([2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -9, 2.0 ** -12], np.float32)
    np.testing.assert_array_equal(Q.e4m3_round(v), np.array([0.0, 2.0 ** -8, 5 * 2.0 ** -9, 0.0], np.float32))


def test_e4m3_round_float64_rounds_once():
    # 1.0625 + 1e-12 is above the tie: a single rounding gives 1.125; going through float32 first
    # would land exactly on the tie and give 1.0
    got = Q.e4m3_round(np.array([1.0625 + 1e-12, 1.0625], np.float64))
    np.testing.assert_array_equal(got, [1.125, 1.0])
    assert got.dtype == np.float64


def test_e2m1_round_ties_to_even_and_saturates():
    # grid 0, .5, 1, 1.5, 2, 3, 4, 6; even codes: 0, 1, 2, 4 (and 6)
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 2.4, 5.1, 6.0, 7.0, 100.0,
                  -0.25, -0.75, -2.5, -5.0, -7.0], np.float32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 2.0, 6.0, 6.0, 6.0, 6.0,
                     -0.0, -1.0, -2.0, -4.0, -6.0], np.float32)
    np.testing.assert_array_equal(Q.e2m1_round(v), want)


# ---------------------------------------------------------------- FP8 block simulation


def test_fp8_scale_one_block_ties():
    # amax 448 -> scale 2^ceil(log2(1)) = 1: the values are rounded on the plain e4m3 grid;
    # 0.3 -> step 2^-5 in [0.25, 0.5): 9.6 steps -> 10 -> 0.3125
    x = _block([448.0, 1.0625, 1.1875, -2.625, 3.0, 0.3], 64)
    y = Q.fp8_sim(x)
    np.testing.assert_array_equal(y[:6], [448.0, 1.0, 1.25, -2.5, 3.0, 0.3125])
    assert not y[6:].any()


def test_fp8_scale_from_amax_one():
    # amax 1: 1/448 = 2^-8.81 -> scale 2^-8 = 1/256. 0.3 * 256 = 76.8 -> step 8 in [64, 128) -> 80,
    # 80 / 256 = 0.3125. 0.01 * 256 = 2.56 -> step 0.25 in [2, 4) -> 2.5 -> 2.5 / 256
    x = _block([1.0, 0.3, -0.01], 64)
    y = Q.fp8_sim(x)
    np.testing.assert_array_equal(y[:3], np.array([1.0, 0.3125, -2.5 / 256], np.float32))


@pytest.mark.parametrize("k", [-12, -3, 0, 1, 7])
def test_fp8_power_of_two_amax(k):
    # amax exactly 448 * 2^k -> scale exactly 2^k (not 2^(k+1)); amax one float32 ulp above
    # 448 * 2^k still rounds amax * f32(1/448) to 2^k in float32 (official bit trick) -> 2^k as well,
    # and the saturating clip keeps the top value at 448 * 2^k
    amax = np.float32(448.0 * 2.0 ** k)
    x = _block([amax, 2.0 ** k * 1.0625], 64)
    np.testing.assert_array_equal(Q.fp8_sim(x)[:2], np.array([amax, 2.0 ** k], np.float32))
    up = np.nextafter(amax, np.float32(np.inf))
    y = Q.fp8_sim(_block([up, 2.0 ** k * 1.0625], 64))
    np.testing.assert_array_equal(y[:2], np.array([amax, 2.0 ** k], np.float32))
    # a clearly larger amax moves to the next scale: 2^(k+1); 1.0625 * 2^k / 2^(k+1) = 0.53125,
    # step 2^-4 in [0.5, 1) -> tie between 0.5 and 0.5625 -> 0.5 (even) -> 2^k
    y = Q.fp8_sim(_block([amax * 1.01, 2.0 ** k * 1.0625], 64))
    assert y[1] == np.float32(2.0 ** k)


def test_fp8_zero_and_sub_floor_blocks():
    assert not Q.fp8_sim(np.zeros((3, 128), np.float32)).any()
    # amax 1e-6 < floor 1e-4: scale from 1e-4 / 448 = 2.23e-7 -> 2^-22 (2^-23 = 1.19e-7 is too small)
    # 1e-6 / 2^-22 = 4.194 -> step 0.5 in [4, 8) -> 4 -> 4 * 2^-22 = 2^-20
    # 3e-9 / 2^-22 = 0.01258 -> subnormal step 2^-9: 6.44 steps -> 6 * 2^-9 -> 6 * 2^-31
    x = _block([1e-6, -3e-9], 64)
    y = Q.fp8_sim(x)
    np.testing.assert_array_equal(y[:2], np.array([2.0 ** -20, -6 * 2.0 ** -31], np.float32))


def test_fp8_blocks_are_independent_and_sign_symmetric():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(64).astype(np.float32)
    b = a * np.float32(2.0 ** -7)
    x = np.concatenate([a, b])
    y = Q.fp8_sim(x)
    np.testing.assert_array_equal(y[64:], y[:64] * np.float32(2.0 ** -7))  # scale-equivariant per block
    np.testing.assert_array_equal(Q.fp8_sim(-x), -y)
    # at most 3 mantissa bits relative to the block scale: |y - x| <= half a step of the top binade
    assert np.all(np.abs(y[:64] - a) <= np.abs(a) * 2.0 ** -4 + 2.0 ** -9 * 2.0 ** -6)


def test_kv_fp8_sim_leaves_rope_tail():
    rng = np.random.default_rng(2)
    row = rng.standard_normal((5, 128)).astype(np.float32) * 3
    y = Q.kv_fp8_sim(row, rope_dim=64)
    np.testing.assert_array_equal(y[:, 64:], row[:, 64:])
    np.testing.assert_array_equal(y[:, :64], Q.fp8_sim(row[:, :64]))
    assert not np.array_equal(y[:, :64], row[:, :64])
    # real widths: 448 nope dims = 7 blocks of 64
    big = rng.standard_normal((2, 512)).astype(np.float32)
    y = Q.kv_fp8_sim(big, rope_dim=64)
    for b in range(7):
        np.testing.assert_array_equal(y[:, 64 * b:64 * (b + 1)], Q.fp8_sim(big[:, 64 * b:64 * (b + 1)]))
    np.testing.assert_array_equal(y[:, 448:], big[:, 448:])


def test_fp8_float64_input():
    # same scale rule; the float64 path rounds once (see test_e4m3_round_float64_rounds_once)
    x = _block([448.0, 1.0625 + 1e-12], 64, dtype=np.float64)
    np.testing.assert_array_equal(Q.fp8_sim(x)[:2], [448.0, 1.125])


# ---------------------------------------------------------------- FP4 block simulation


def test_fp4_scale_one_block_ties():
    # amax 6 -> 6 * f32(1/6) rounds to exactly 1.0 -> scale 1
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.26, 5.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -2.0, -4.0, 0.5, 6.0]
    y = Q.fp4_sim(_block(vals, 32))
    np.testing.assert_array_equal(y[:len(vals)], np.array(want, np.float32))
    assert not y[len(vals):].any()


def test_fp4_scale_rounds_up_past_amax():
    # amax 7: 7/6 = 1.17 -> scale 2; 7/2 = 3.5 is a tie between 3 (odd code) and 4 (even) -> 4 -> 8,
    # larger than the input: the dequantized block max can exceed amax by up to 4/3.5
    # 1 / 2 = 0.5 -> 0.5 -> 1; 2.9 / 2 = 1.45 -> 1.5 -> 3
    y = Q.fp4_sim(_block([7.0, 1.0, -2.9], 32))
    np.testing.assert_array_equal(y[:3], np.array([8.0, 1.0, -3.0], np.float32))


@pytest.mark.parametrize("k", [-100, -5, 0, 3, 60])
def test_fp4_power_of_two_amax(k):
    amax = np.float32(6.0 * 2.0 ** k)
    y = Q.fp4_sim(_block([amax, 2.0 ** k * 1.25, -(2.0 ** k) * 0.75], 32))
    # scale 2^k: 1.25 -> 1 (tie, even), 0.75 -> 1 (tie, even)
    np.testing.assert_array_equal(y[:3], np.array([amax, 2.0 ** k, -(2.0 ** k)], np.float32))


def test_fp4_zero_and_sub_floor_blocks():
    assert not Q.fp4_sim(np.zeros((2, 128), np.float32)).any()
    assert not np.isnan(Q.fp4_sim(np.zeros(32, np.float32))).any()
    # amax 3 * 2^-126 is below the floor 6 * 2^-126 -> scale 2^-126; 3 * 2^-126 / 2^-126 = 3 -> 3;
    # 2^-127 / 2^-126 = 0.5 -> 0.5; 1e-40 / 2^-126 = 0.0085 -> 0
    tiny = np.float32(2.0 ** -126)
    y = Q.fp4_sim(_block([3 * tiny, -tiny / 2, 1e-40], 32))
    np.testing.assert_array_equal(y[:3], np.array([3 * tiny, -tiny / 2, 0.0], np.float32))
    assert Q.FP4_AMAX_FLOOR == np.float32(7.052966104933725e-38)  # ds4's constant


def test_fp4_blocks_are_independent():
    x = np.concatenate([_block([6.0, 1.25], 32), _block([0.75, 0.1875], 32)])
    y = Q.fp4_sim(x)
    # second block: amax 0.75 -> 0.75 / 6 = 0.125 = 2^-3 exactly -> scale 2^-3; 0.75 / 0.125 = 6 -> 6,
    # 0.1875 / 0.125 = 1.5 -> 1.5
    np.testing.assert_array_equal(y[:2], [6.0, 1.0])
    np.testing.assert_array_equal(y[32:34], [0.75, 0.1875])


# ---------------------------------------------------------------- Hadamard


def test_hadamard_matrix_small():
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], float)
    np.testing.assert_array_equal(Q.hadamard_matrix(4), h4)
    x = np.array([1.0, 2.0, 3.0, 4.0])
    # (1+2+3+4, 1-2+3-4, 1+2-3-4, 1-2-3+4) / 2
    np.testing.assert_allclose(Q.hadamard(x), [5.0, -1.0, -2.0, 0.0], rtol=0, atol=1e-15)
    with pytest.raises(ValueError):
        Q.hadamard_matrix(96)


def test_hadamard_128_orthonormal_involution():
    n = 128
    e0 = np.zeros(n)
    e0[0] = 1
    np.testing.assert_allclose(Q.hadamard(e0), np.full(n, n ** -0.5), rtol=0, atol=1e-15)
    e1 = np.zeros(n)
    e1[1] = 1
    np.testing.assert_allclose(Q.hadamard(e1), np.tile([1.0, -1.0], n // 2) * n ** -0.5, rtol=0, atol=1e-15)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, n))
    np.testing.assert_allclose(Q.hadamard(Q.hadamard(x)), x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(Q.hadamard(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    assert Q.hadamard(x.astype(np.float32)).dtype == np.float32


def test_indexer_qat_is_hadamard_then_fp4():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    y = Q.indexer_qat(x)
    np.testing.assert_array_equal(y, Q.fp4_sim(Q.hadamard(x)))
    # every value is (grid value) * (block power of two)
    for b in range(4):
        blk = y[:, 32 * b:32 * (b + 1)]
        s = np.exp2(np.ceil(np.log2(np.abs(Q.hadamard(x)[:, 32 * b:32 * (b + 1)]).max(axis=1) / 6)))
        assert set(np.unique(np.abs(blk / s[:, None]))) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}
