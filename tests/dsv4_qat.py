"""numpy reference for DeepSeek V4's quantization-aware-training simulations (spec 1.4, 1.5, 3.2).

Why: transformers' DeepseekV4ForCausalLM omits them, yet the current official revision runs them
inside the attention state, so honest outputs need them and the engine must match them bit for bit
on designed inputs. Three routines:

- FP8 KV simulation (`fp8_sim`, `kv_fp8_sim`): the raw and compressed KV rows' first
  head_dim - rope_dim values, in blocks of 64, are rounded to e4m3 with a power-of-two block scale.
- FP4 indexer simulation (`fp4_sim`): indexer q and k rows, after a 128-point Hadamard rotation
  (`hadamard`), in blocks of 32, rounded to e2m1 with a power-of-two block scale.

Semantics, from the official `inference/kernel.py` (tilelang `act_quant_kernel` with
`round_scale`/`inplace`, and `fp4_quant_kernel`; mirror Mockingjay1316/deepseek-v4-flash-spark,
commit 1795ef7) and antirez/ds4 `ds4.c` (`dsv4_fp8_kv_quantize_row_inplace_cpu`,
`dsv4_fp4_act_quantize_row_inplace_cpu`), which agree:

- amax = max |x| over the block, floored: FP8 at 1e-4, FP4 at 6 * 2^-126 (= 7.052966e-38, the
  smallest amax whose scale is the smallest normal float32, 2^-126; so an all-zero block gets a
  finite scale and stays zero instead of producing 0/0).
- scale = 2^ceil(log2(amax / qmax)), qmax = 448 (e4m3) or 6 (e2m1). The official kernel computes
  the f32 product amax * f32(1/qmax) and takes ceil(log2) exactly from its bits (exponent, +1 if
  any mantissa bit is set); that is what `_pow2_scale` does. ds4 uses log2f(amax / qmax), which can
  differ only when amax / qmax is within an ulp of a power of two.
- y = round_to_nearest_even(clip(x / scale, -qmax, qmax)) * scale. The clip matters: ml_dtypes
  (like a plain cast) maps out-of-range values to NaN for float8_e4m3fn.

Tests: tests/test_dsv4_qat_reference.py (hand-computed expected values). Must not import zen5.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # official kernel.py: T.max(amax, 6 * (2**-126)); ds4: 7.052966104933725e-38f
FP8_BLOCK = 64
FP4_BLOCK = 32


def _pow2_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """2^ceil(log2(f32(amax) * f32(1/qmax))), exactly as the official kernel's bit trick (float32)."""
    y = amax.astype(np.float32) * np.float32(1.0 / qmax)
    m, e = np.frexp(y)  # y = m * 2^e, m in [0.5, 1): ceil(log2 y) = e - 1 when m == 0.5, else e
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round to the float8 e4m3fn grid, nearest-even, saturating at +-448 (no NaN)."""
    v = np.clip(np.asarray(v), -FP8_MAX, FP8_MAX)
    return v.astype(ml_dtypes.float8_e4m3fn).astype(v.dtype)


def e2m1_round(v: np.ndarray) -> np.ndarray:
    """Round to the float4 e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, nearest-even, saturating at +-6."""
    v = np.clip(np.asarray(v), -FP4_MAX, FP4_MAX)
    return v.astype(ml_dtypes.float4_e2m1fn).astype(v.dtype)


def _block_sim(x, block: int, qmax: float, floor: float, rnd) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the block {block}")
    xb = x.reshape(*x.shape[:-1], d // block, block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), floor)
    scale = _pow2_scale(amax, qmax).astype(x.dtype)
    return (rnd(xb / scale) * scale).reshape(x.shape)


def fp8_sim(x, block: int = FP8_BLOCK) -> np.ndarray:
    """FP8 (e4m3) quantize-dequantize in blocks of `block` along the last dim (dtype kept)."""
    return _block_sim(x, block, FP8_MAX, FP8_AMAX_FLOOR, e4m3_round)


def fp4_sim(x, block: int = FP4_BLOCK) -> np.ndarray:
    """FP4 (e2m1) quantize-dequantize in blocks of `block` along the last dim (dtype kept)."""
    return _block_sim(x, block, FP4_MAX, FP4_AMAX_FLOOR, e2m1_round)


def kv_fp8_sim(row, rope_dim: int = 64, block: int = FP8_BLOCK) -> np.ndarray:
    """The KV-row simulation: fp8_sim on the first head_dim - rope_dim values (the "nope" part);
    the RoPE tail is left at full precision."""
    row = np.asarray(row)
    out = row.copy()
    nope = row.shape[-1] - rope_dim
    out[..., :nope] = fp8_sim(row[..., :nope], block)
    return out


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix H_n (entries +-1, natural order), H_2n = [[H, H], [H, -H]]."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(x) -> np.ndarray:
    """Hadamard rotation over the last dim, scaled 1/sqrt(n) (orthonormal; its own inverse)."""
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    n = x.shape[-1]
    h = hadamard_matrix(n).astype(x.dtype)
    return (x @ h) * x.dtype.type(1.0 / np.sqrt(n))


def indexer_qat(x) -> np.ndarray:
    """What the indexer does to its q heads and compressed k rows: Hadamard, then fp4_sim."""
    return fp4_sim(hadamard(x))
