"""Every kernel of each SIMD table this machine runs (avx2, avx2vnni, avx512, amx: the `fast_isa`
fixture) against the scalar reference on random inputs.

Sizes are deliberately not multiples of the vector width (8 or 16 floats) where the type allows, so
masked tails are exercised. Each comparison prints the worst element. Quantized weights are
random bytes with sane block scales, written in GGUF's block layouts.
"""
import os

import numpy as np
import pytest

from tiers import FAST_TIERS
from zen5._native import testing

TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "BF16": 30}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}



def random_weights(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    if kind == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8).ravel()
    if kind == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8).ravel()
    if kind == "BF16":
        bits = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).ravel()
    nb = rows * cols // 32
    blocks = rng.integers(0, 256, size=(nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks[:, 0:2] = (rng.uniform(0.001, 0.05, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
    if kind == "Q4_1":
        blocks[:, 2:4] = (rng.uniform(-0.1, 0.1, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
    return blocks.ravel()


def report(name, a, b):
    err = np.abs(a.astype(np.float64) - b.astype(np.float64))
    i = int(np.argmax(err))
    rel = err.flat[i] / max(1e-30, abs(float(a.flat[i])))
    print(f"{name}: worst |ref-fast| = {err.flat[i]:.3g} at {i} (ref {a.flat[i]:.6g}, rel {rel:.2g})")
    return err


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("n_tok", [1, 3, 8, 13])
def test_matmul_matches_reference(fast_isa, kind, n_tok):
    rng = np.random.default_rng([n_tok, *kind.encode()])  # the same draw every run (hash() of a str is salted)
    rows = 37
    cols = 96 if kind in BLOCK_BYTES else 83  # float types: a ragged tail of 3
    w = random_weights(kind, rows, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    ref = testing.kernel_matmul("ref", TYPES[kind], w, rows, cols, x)
    fast = testing.kernel_matmul(fast_isa, TYPES[kind], w, rows, cols, x)
    # the independent check: dequantize with the reference and multiply in float64
    dq = np.stack([testing.kernel_dequant_row("ref", TYPES[kind], w.reshape(rows, -1)[r], cols)
                   for r in range(rows)])
    exact = x.astype(np.float64) @ dq.astype(np.float64).T
    scale = np.abs(x).max() * np.abs(dq).max() * np.sqrt(cols)
    assert report(f"matmul {kind} n={n_tok}", ref, fast).max() <= 1e-5 * scale
    assert np.abs(ref - exact).max() <= 1e-5 * scale


@pytest.mark.parametrize("kind", ["Q4_1", "F32", "F16", "BF16"])
def test_matmul_batch_equals_one_by_one(fast_isa, kind):
    """A token's result must not depend on how many tokens share the call (prefill = decode).
    Float types: 150 rows end inside a 64-row band (and inside a 16-row group) of the AVX-512
    panel layout, 83 columns leave BF16's last column pair half empty, and 11 tokens run as
    tiles of 6 and 5 against 1."""
    rng = np.random.default_rng(1)
    rows, cols = (64, 128) if kind == "Q4_1" else (150, 83)
    w = random_weights(kind, rows, cols, rng)
    x = rng.standard_normal((11, cols)).astype(np.float32)
    for isa in ("ref", fast_isa):
        batch = testing.kernel_matmul(isa, TYPES[kind], w, rows, cols, x)
        single = np.concatenate([testing.kernel_matmul(isa, TYPES[kind], w, rows, cols, x[i:i + 1])
                                 for i in range(11)])
        assert np.array_equal(batch, single), isa
        assert np.isfinite(batch).all()


@pytest.mark.parametrize("kind", list(TYPES))
def test_dequant_row_is_exact(fast_isa, kind):
    rng = np.random.default_rng(7)
    n = 160 if kind in BLOCK_BYTES else 77
    w = random_weights(kind, 1, n, rng)
    ref = testing.kernel_dequant_row("ref", TYPES[kind], w, n)
    fast = testing.kernel_dequant_row(fast_isa, TYPES[kind], w, n)
    report(f"dequant {kind}", ref, fast)
    assert np.array_equal(ref, fast)  # same roundings on both paths


def test_dequant_matches_gguf_package():
    """Independent oracle for the block layouts: the gguf package's numpy dequantizers."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(3)
    for kind in ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16"):
        w = random_weights(kind, 4, 64, rng)
        ours = np.concatenate([testing.kernel_dequant_row("ref", TYPES[kind], row, 64)
                               for row in w.reshape(4, -1)])
        theirs = dequantize(w.reshape(4, -1), GGMLQuantizationType[kind]).ravel()
        assert np.array_equal(ours, theirs.astype(np.float32)), kind


@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 191, 576])
def test_vector_kernels(fast_isa, n):
    rng = np.random.default_rng(n)
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    d_ref, d_fast = testing.kernel_dot("ref", a, b), testing.kernel_dot(fast_isa, a, b)
    assert abs(d_ref - d_fast) <= 1e-5 * np.sqrt(n) * (1 + abs(d_ref))
    for name, args in [("axpy", (0.37, a, b)), ("add", (a, b)), ("rmsnorm", (a, w, 1e-5)),
                       ("swiglu", (a * 8, b))]:
        fn = getattr(testing, f"kernel_{name}")
        r, f = fn("ref", *args), fn(fast_isa, *args)
        err = report(f"{name} n={n}", r, f)
        assert err.max() <= 2e-6 * (1 + np.abs(r).max()), name


def test_swiglu_extremes(fast_isa):
    g = np.array([-200, -88, -20, -1e-3, 0, 1e-3, 20, 88, 200] * 2, np.float32)
    u = np.ones_like(g)
    r, f = testing.kernel_swiglu("ref", g, u), testing.kernel_swiglu(fast_isa, g, u)
    assert np.all(np.isfinite(f))
    assert np.allclose(r, f, rtol=1e-6, atol=1e-30)



def test_softmax_exp2_over_its_whole_range(fast_isa):
    """The partial softmax is base 2 (the decoder folds log2(e) into the score scale). Every
    fraction of [-0.5, 0.5] after the max, values that underflow to denormals or to zero, and a
    -inf score (it must give exactly 0, not NaN), on both ISAs and with a 17-lane tail."""
    frac = np.linspace(-0.5, 0.5, 33, dtype=np.float32)
    tail = [-20.25, -120.3, -146.6, -149.7, -150.5, -400, -np.inf]
    x = np.concatenate([[3.0], 3.0 - frac - 1, tail]).astype(np.float32)
    exact = 2.0 ** (x.astype(np.float64) - 3.0)
    exact /= exact.sum()
    for isa in ("ref", fast_isa):
        p = testing.kernel_softmax(isa, x)
        assert np.all(np.isfinite(p)) and p[-1] == 0.0 and p[-2] == 0.0, isa
        assert np.allclose(p, exact, rtol=1e-6, atol=1e-45), (isa, np.abs(p / np.where(exact > 0, exact, 1) - 1).max())

@pytest.mark.parametrize("n,hd,stride", [(1, 64, 192), (7, 64, 64), (33, 32, 96), (130, 80, 80), (5, 128, 384)])
def test_attention_kernels(fast_isa, n, hd, stride):
    rng = np.random.default_rng(n * hd)
    q = rng.standard_normal(hd).astype(np.float32)
    k = rng.standard_normal((n, stride)).astype(np.float32)
    v = rng.standard_normal((n, stride)).astype(np.float32)
    scale = 1 / np.sqrt(hd)
    exact = (k[:, :hd].astype(np.float64) @ q) * scale
    for isa in ("ref", fast_isa):
        sc = testing.kernel_attn_scores(isa, q, k, hd, scale)
        assert np.allclose(sc, exact, atol=1e-5, rtol=1e-5), isa
    ref_sc = testing.kernel_attn_scores("ref", q, k, hd, scale)
    report(f"attn_scores n={n} hd={hd}", ref_sc, testing.kernel_attn_scores(fast_isa, q, k, hd, scale))
    p_ref, p_fast = testing.kernel_softmax("ref", ref_sc * 4), testing.kernel_softmax(fast_isa, ref_sc * 4)
    assert report(f"softmax n={n}", p_ref, p_fast).max() <= 1e-6
    e2 = 2.0 ** (ref_sc.astype(np.float64) * 4 - (ref_sc * 4).max())  # the kernel's softmax is base 2
    assert np.allclose(p_fast, e2 / e2.sum(), rtol=1e-6, atol=1e-7)
    assert abs(p_fast.sum() - 1) < 1e-5
    o_ref, o_fast = testing.kernel_attn_values("ref", p_ref, v, hd), testing.kernel_attn_values(fast_isa, p_ref, v, hd)
    assert report(f"attn_values n={n} hd={hd}", o_ref, o_fast).max() <= 1e-5
    assert np.allclose(o_ref, p_ref.astype(np.float64) @ v[:, :hd], atol=1e-5)


def fma_chains(a, b):
    """out[j, i] = the fp32 chain acc = fma(a[j, d], b[i, d], acc) over d in order, from zero:
    each step's product is exact in float64 and the sum rounds once to fp32 (through float64, a
    double rounding that can differ from one only at ties, not hit by these seeds)."""
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for d in range(a.shape[1]):
        acc = (acc.astype(np.float64) + a64[:, d:d + 1] * b64[None, :, d]).astype(np.float32)
    return acc


@pytest.mark.parametrize("nq,n,hd", [(7, 75, 512), (7, 19, 160), (7, 40, 64), (20, 75, 512), (22, 203, 68)])
def test_attention_kernels_are_the_documented_fma_chains(fast_isa, nq, n, hd):
    """The SIMD tiers' contract, checked bit for bit against an independent model: a score is one
    fp32 FMA chain over the channels in order from 0, then times the scale; an output value is
    one FMA chain over the positions in order. Whatever a tier's blocking, the bits are these, so
    the tiers agree with each other (checked here on every SIMD tier this CPU has, where
    test_simd_tiers_give_the_same_bits needs two). 20 and 22 queries: the AVX2 values kernel's
    copied panels (every query group size; 203 x 68: a ragged last block and last channels)."""
    rng = np.random.default_rng(hd + n)
    scale = np.float32(1 / np.sqrt(hd))
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    k = rng.standard_normal((n, hd)).astype(np.float32)
    p = rng.random((nq, n)).astype(np.float32)
    expect = (fma_chains(q, k).astype(np.float64) * np.float64(scale)).astype(np.float32)
    assert np.array_equal(testing.kernel_attn_scores(fast_isa, q, k, hd, float(scale)), expect)
    k16 = k.astype(np.float16)
    expect = (fma_chains(q, k16.astype(np.float32)).astype(np.float64) * np.float64(scale)).astype(np.float32)
    assert np.array_equal(testing.kernel_attn_scores_h(fast_isa, q, k16.view(np.uint16), hd, float(scale)), expect)
    # values: out[j, c] = chain over positions i of fma(p[j, i], v[i, c], acc)
    assert np.array_equal(testing.kernel_attn_values(fast_isa, p, k, hd), fma_chains(p, k.T))
    assert np.array_equal(testing.kernel_attn_values_h(fast_isa, p, k16.view(np.uint16), hd),
                          fma_chains(p, k16.astype(np.float32).T))


def emulate_int8(kind, w, rows, cols, x):
    """Independent numpy model of the int8 path: quantize x per 32-block (d = amax/127,
    q = round-half-even(x / d)), integer dot with the integer weights, then the two scales."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    bb = BLOCK_BYTES[kind]
    blocks = w.reshape(rows, cols // 32, bb)
    d_w = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)       # (rows, nb)
    vals = dequantize(w.reshape(rows, -1), GGMLQuantizationType[kind]).reshape(rows, cols // 32, 32)
    if kind == "Q4_1":
        m_w = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        ints = np.rint((vals - m_w[..., None]) / d_w[..., None])
    else:
        ints = np.rint(vals / np.where(d_w == 0, 1, d_w)[..., None])
    out, q, d_x = int8_product(ints, d_w, x)
    if kind == "Q4_1":
        out += (m_w[None] * (d_x * q.sum(axis=2))[:, None, :]).sum(axis=2)
    return out


def int8_product(ints, d_w, x):
    """The int8 path for integer weights ints (rows, blocks, 32) with scales d_w (rows, blocks):
    x quantized per 32-block (d = amax/127, q = round-half-even(x * (1/d))), the exact integer
    dots, then both scales. Returns (out (n, rows), q, d_x)."""
    n, cols = x.shape
    xb = x.reshape(n, cols // 32, 32)
    d_x = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d_x != 0, np.float32(1) / np.where(d_x == 0, 1, d_x), 0).astype(np.float32)
    q = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127)
    dots = np.einsum("rbj,tbj->trb", ints, q)                                    # exact integers
    return (dots * (d_w[None] * d_x[:, None, :]).astype(np.float64)).sum(axis=2), q, d_x


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows,n_tok", [(16, 1), (37, 3), (64, 4), (50, 9), (83, 16), (40, 17)])
def test_matmul_int8(fast_isa, kind, rows, n_tok):
    rng = np.random.default_rng(rows * 7 + n_tok)
    cols = 128
    w = random_weights(kind, rows, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    ref = testing.kernel_matmul_int8("ref", TYPES[kind], w, rows, cols, x)
    fast = testing.kernel_matmul_int8(fast_isa, TYPES[kind], w, rows, cols, x)
    exact = emulate_int8(kind, w, rows, cols, x)
    scale = np.abs(exact).max()
    assert report(f"int8 {kind} rows={rows} n={n_tok}", ref, fast).max() <= 1e-5 * scale
    assert np.abs(ref - exact).max() <= 1e-5 * scale
    # and the int8 path stays close to the fp32 one (the documented cost of int8 activations)
    f32 = testing.kernel_matmul("ref", TYPES[kind], w, rows, cols, x)
    assert np.abs(ref - f32).max() <= 2e-2 * np.abs(f32).max()


def packed_layout_spec(kind: str, w: np.ndarray, rows: int, cols: int) -> bytes:
    """The int8 layout of kernels.h built in numpy: per (16-row group, 32-column block) a payload
    of 64-byte chunks (chunk j: each row's bytes 4j..4j+3 of its quants; Q8_0's plus 128), then,
    in a second array, the 16 rows' fp16 d (and Q4_1's m); padding rows zero."""
    nb, groups = cols // 32, -(-rows // 16)
    blocks = np.zeros((groups * 16, nb, BLOCK_BYTES[kind]), np.uint8)
    blocks[:rows] = w.reshape(rows, nb, BLOCK_BYTES[kind])
    blocks = blocks.reshape(groups, 16, nb, -1).transpose(0, 2, 1, 3)  # (group, block, lane, bytes)
    head = 4 if kind == "Q4_1" else 2
    q = blocks[..., head:].copy()
    if kind == "Q8_0":  # u = q + 128 for the rows; padding rows stay zero
        real = (16 * np.arange(groups)[:, None] + np.arange(16)) < rows
        q[real.nonzero()[0], :, real.nonzero()[1]] ^= 0x80
    words = q.reshape(groups, nb, 16, -1, 4).transpose(0, 1, 3, 2, 4)  # (group, block, chunk, lane, 4)
    scales = blocks[..., :head].reshape(groups, nb, 16, -1, 2).transpose(0, 1, 3, 2, 4)  # d (and m) of 16 lanes
    return np.ascontiguousarray(words).tobytes() + np.ascontiguousarray(scales).tobytes()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [16, 48, 61])
def test_packed_layout_is_the_documented_one_whole_groups_or_row_by_row(kind, rows):
    """A load packs whole 16-row groups by word transposes and a partial group's rows one by one:
    both give the layout of kernels.h byte for byte, however the rows are split into calls."""
    rng = np.random.default_rng(rows)
    w = random_weights(kind, rows, 96, rng)
    want = packed_layout_spec(kind, w, rows, 96)
    for piece in (1, 16, 32, rows):
        assert testing.pack_layout(TYPES[kind], w, rows, 96, piece) == want, piece


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("n", [6, 7, 12, 16, 17])
def test_matmul_int8_batch_equals_one_by_one(fast_isa, kind, n):
    """Every token tile shape (pairs of groups in tiles of 6 and the rest; one tile of 7-16
    tokens per group) gives each token the bits it gets alone."""
    rng = np.random.default_rng(5 + n)
    w = random_weights(kind, 80, 96, rng)
    x = rng.standard_normal((n, 96)).astype(np.float32)
    for isa in ("ref", fast_isa):
        batch = testing.kernel_matmul_int8(isa, TYPES[kind], w, 80, 96, x)
        single = np.concatenate([testing.kernel_matmul_int8(isa, TYPES[kind], w, 80, 96, x[i:i + 1])
                                 for i in range(n)])
        assert np.array_equal(batch, single), isa


def test_f16_conversion_matches_numpy_bit_for_bit(fast_isa):
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(1000) * 10 ** rng.uniform(-9, 5, 1000),
                        [0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, np.inf, -np.inf],
                        np.float16(np.arange(-2048, 2048)).astype(np.float32) + np.float32(2 ** -12)]
                       ).astype(np.float32)
    expect = x.astype(np.float16).view(np.uint16)
    for isa in ("ref", fast_isa):
        assert np.array_equal(testing.kernel_to_f16(isa, x), expect), isa


@pytest.mark.parametrize("nq", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,hd,stride", [(1, 64, 192), (8, 64, 192), (23, 64, 64), (70, 32, 96), (17, 80, 80),
                                         (75, 512, 512), (19, 160, 168)])
def test_attention_kernels_for_a_query_group(fast_isa, nq, n, hd, stride):
    """A GQA group's queries scored and summed in one call (each cache row loaded once) match
    the exact result and the reference, for fp32 and fp16 caches, ragged row counts included;
    and wide heads (DeepSeek V4's 512, whose key tiles outgrow L1, and 160)."""
    rng = np.random.default_rng(nq * 1000 + n)
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    k = rng.standard_normal((n, stride)).astype(np.float16)
    v = rng.standard_normal((n, stride)).astype(np.float16)
    p = rng.random((nq, n)).astype(np.float32)
    scale = 1 / np.sqrt(hd)
    exact = q.astype(np.float64) @ k[:, :hd].astype(np.float64).T * scale
    exact_o = p.astype(np.float64) @ v[:, :hd].astype(np.float64)
    for isa in ("ref", fast_isa):
        assert np.allclose(testing.kernel_attn_scores_h(isa, q, k.view(np.uint16), hd, scale), exact, atol=1e-5), isa
        assert np.allclose(testing.kernel_attn_scores(isa, q, k.astype(np.float32), hd, scale), exact, atol=1e-5), isa
        assert np.allclose(testing.kernel_attn_values_h(isa, p, v.view(np.uint16), hd), exact_o, atol=1e-4), isa
        assert np.allclose(testing.kernel_attn_values(isa, p, v.astype(np.float32), hd), exact_o, atol=1e-4), isa
    # one query at a time gives the same bits as the group: a query's arithmetic does not depend
    # on which queries share the call (what makes a prefill batch equal the tokens one by one)
    for isa in ("ref", fast_isa):
        one = np.stack([testing.kernel_attn_scores_h(isa, q[j], k.view(np.uint16), hd, scale) for j in range(nq)])
        assert np.array_equal(one, testing.kernel_attn_scores_h(isa, q, k.view(np.uint16), hd, scale)), isa
        one = np.stack([testing.kernel_attn_values_h(isa, p[j], v.view(np.uint16), hd) for j in range(nq)])
        assert np.array_equal(one, testing.kernel_attn_values_h(isa, p, v.view(np.uint16), hd)), isa


@pytest.mark.parametrize("n", [203, 512])
@pytest.mark.parametrize("nq", [1, 3, 24, 30, 51])
def test_attention_kernels_wide_query_groups(fast_isa, nq, n):
    """Prefill scores a kv head's queries of several tokens together (groups of up to 24 per key
    tile, positions in the lanes, the queries read in place; values in groups of 12 per half row
    block, or 6 per whole row): exact against float64, and each query's bits equal its own
    single-query call. 203: a ragged last key tile and value block; 512: the decoder's score-row
    stride, which the values kernel specializes."""
    rng = np.random.default_rng(nq)
    hd = 64
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    k = rng.standard_normal((n, 192)).astype(np.float16)
    v = rng.standard_normal((n, 192)).astype(np.float16)
    p = rng.random((nq, n)).astype(np.float32)
    scale = 1 / np.sqrt(hd)
    sc = testing.kernel_attn_scores_h(fast_isa, q, k.view(np.uint16), hd, scale).reshape(nq, n)
    assert np.allclose(sc, q.astype(np.float64) @ k[:, :hd].astype(np.float64).T * scale, atol=1e-5)
    o = testing.kernel_attn_values_h(fast_isa, p, v.view(np.uint16), hd).reshape(nq, hd)
    assert np.allclose(o, p.astype(np.float64) @ v[:, :hd].astype(np.float64), atol=1e-4)
    for j in range(nq):
        assert np.array_equal(sc[j], testing.kernel_attn_scores_h(fast_isa, q[j], k.view(np.uint16), hd, scale))
        assert np.array_equal(o[j], testing.kernel_attn_values_h(fast_isa, p[j], v.view(np.uint16), hd))


@pytest.mark.parametrize("n,hd,stride", [(1, 64, 192), (9, 64, 64), (70, 32, 96)])
def test_attention_kernels_f16_cache(fast_isa, n, hd, stride):
    rng = np.random.default_rng(n)
    q = rng.standard_normal(hd).astype(np.float32)
    k = rng.standard_normal((n, stride)).astype(np.float16)
    v = rng.standard_normal((n, stride)).astype(np.float16)
    scale = 1 / np.sqrt(hd)
    exact = k[:, :hd].astype(np.float64) @ q * scale
    p = np.exp(exact - exact.max())
    p = (p / p.sum()).astype(np.float32)
    for isa in ("ref", fast_isa):
        sc = testing.kernel_attn_scores_h(isa, q, k.view(np.uint16), hd, scale)
        assert np.allclose(sc, exact, atol=1e-5, rtol=1e-5), isa
        out = testing.kernel_attn_values_h(isa, p, v.view(np.uint16), hd)
        assert np.allclose(out, p.astype(np.float64) @ v[:, :hd].astype(np.float64), atol=1e-5), isa


def _quantize_s8(x: np.ndarray) -> tuple[np.ndarray, np.float32, int]:
    """kernels.h quantize_s8 in numpy: d = max|x| / 127, q = round(x / d) half to even."""
    amax = np.float32(np.abs(x).max())
    d = amax / np.float32(127) if amax >= np.float32(1e-30) else np.float32(0)  # tiny counts as zero
    inv = np.float32(1) / d if d != 0 else np.float32(0)
    q = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
    return q, d, int(q.astype(np.int64).sum())


def test_quantize_s8_matches_numpy():
    rng = np.random.default_rng(5)
    for x in [rng.standard_normal(64).astype(np.float32), np.zeros(64, np.float32),
              (np.arange(64, dtype=np.float32) - 31.5) / 2,   # exact halves: ties go to even
              np.array([3e-40, -1e-39] * 32, np.float32),    # subnormals: zero
              np.array([1e-29, 0.0] * 32, np.float32)]:
        q, d, s = testing.kernel_quantize_s8(x)
        eq, ed, es = _quantize_s8(x)
        assert np.array_equal(q, eq) and np.float32(d) == ed and s == es


def _scores_q8_spec(q, k, ks, scale):
    """attn_scores_q8 as kernels.h states it, in numpy: integer sums exact, float steps in order."""
    out = np.empty((len(q), len(k)), np.float32)
    for j, qj in enumerate(q):
        qq, dq, s = _quantize_s8(qj)
        c = np.float32(dq * np.float32(scale))
        isum = (k.astype(np.int64) + 128) @ qq.astype(np.int64) - 128 * s
        out[j] = (isum.astype(np.float32) * ks) * c
    return out


def _values_q8_spec(p, v, vs):
    out = np.zeros((len(p), v.shape[1]), np.float32)
    for j, pj in enumerate(p):
        for b in range(0, len(v), 32):
            w = pj[b:b + 32] * vs[b:b + 32]
            d = np.float32(w.max()) / np.float32(255)
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            u = np.minimum(np.rint(w * inv), 255).astype(np.int64)
            out[j] = out[j] + (u @ v[b:b + 32].astype(np.int64)).astype(np.float32) * d
    return out


@pytest.mark.parametrize("nq", [1, 3, 9, 24, 51])
@pytest.mark.parametrize("n,hd,stride", [(1, 64, 192), (23, 64, 64), (203, 64, 192), (70, 32, 96), (17, 80, 80)])
def test_attention_kernels_q8_cache(fast_isa, nq, n, hd, stride):
    """The q8_0 cache's integer kernels (queries quantized to int8, weights to u8 per 32
    positions, vpdpbusd) equal their spec computed in numpy bit for bit, in both ISAs; the
    dequantized float64 result within what that quantization costs; and a query's bits do not
    depend on the other queries of the call, nor on a cut of the positions at a multiple of 32
    (what keeps a prefill batch equal to the tokens one by one)."""
    rng = np.random.default_rng(nq * 1000 + n)
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    k = rng.integers(-127, 128, (n, stride), dtype=np.int8)
    v = rng.integers(-127, 128, (n, stride), dtype=np.int8)
    ks = (rng.random(n) * 0.05).astype(np.float32)
    vs = (rng.random(n) * 0.05).astype(np.float32)
    p = rng.random((nq, n)).astype(np.float32)
    scale = 1 / np.sqrt(hd)
    spec_s = _scores_q8_spec(q, k[:, :hd], ks, scale)
    spec_o = _values_q8_spec(p, v[:, :hd], vs)
    exact = q.astype(np.float64) @ (k[:, :hd] * ks[:, None].astype(np.float64)).T * scale
    exact_o = p.astype(np.float64) @ (v[:, :hd] * vs[:, None].astype(np.float64))
    for isa in ("ref", fast_isa):
        sc = testing.kernel_attn_scores_q8(isa, q, k, ks, hd, scale).reshape(nq, n)
        o = testing.kernel_attn_values_q8(isa, p, v, vs, hd).reshape(nq, hd)
        assert np.array_equal(sc, spec_s), isa
        assert np.array_equal(o, spec_o), isa
        # the queries' int8 rounding: |error| <= (max|q| / 254) x sum|k| per score
        bound = (np.abs(q).max(1, keepdims=True) / 254) @ (np.abs(k[:, :hd]) * ks[:, None]).sum(1, keepdims=True).T
        assert (np.abs(sc - exact) <= bound * scale + 1e-5).all(), isa
        # the weights' u8 rounding: each weight within half a step (max / 510) of its block
        assert np.allclose(o, exact_o, rtol=0.02, atol=0.02 * np.abs(exact_o).max()), isa
        for j in range(nq):
            assert np.array_equal(sc[j], testing.kernel_attn_scores_q8(isa, q[j], k, ks, hd, scale)), isa
            assert np.array_equal(o[j], testing.kernel_attn_values_q8(isa, p[j], v, vs, hd)), isa


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_matmul_int8_at_the_int16_limits(fast_isa, kind):
    """Without VNNI the AVX2 tier sums byte products in int16 (vpmaddubsw), which saturates
    instead of overflowing: weights at the extremes of their range (Q8_0 bytes -128 and 127, every
    nibble 15 or 0) against activations whose blocks all quantize to +-127 must still give the
    exact integer sums (the numpy emulation) on every tier."""
    rng = np.random.default_rng(17)
    rows, cols, n = 48, 256, 7
    nb = rows * cols // 32
    blocks = np.zeros((nb, BLOCK_BYTES[kind]), np.uint8)
    payload = rng.choice(np.array([0x80, 0x7F, 0x81] if kind == "Q8_0" else [0xFF, 0x00, 0xF0, 0x0F], np.uint8),
                         size=(nb, BLOCK_BYTES[kind] - (4 if kind == "Q4_1" else 2)))
    blocks[:, 4 if kind == "Q4_1" else 2:] = payload
    blocks[:, 0:2] = np.full(nb, 0.01, np.float16).view(np.uint8).reshape(nb, 2)
    if kind == "Q4_1":
        blocks[:, 2:4] = np.full(nb, -0.05, np.float16).view(np.uint8).reshape(nb, 2)
    w = blocks.ravel()
    signs = np.where(rng.random((n, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
    x = signs * rng.uniform(0.5, 2, (n, 1)).astype(np.float32)
    exact = emulate_int8(kind, w, rows, cols, x)
    fast = testing.kernel_matmul_int8(fast_isa, TYPES[kind], w, rows, cols, x)
    ref = testing.kernel_matmul_int8("ref", TYPES[kind], w, rows, cols, x)
    assert np.abs(ref - exact).max() <= 1e-5 * np.abs(exact).max()
    assert report(f"int8 limits {kind}", ref, fast).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_matmul_int8_long_rows(kind):
    """Rows longer than the blocks a prefill kernel prepares at a time (the AVX2 tier's Q8_0
    path prepares 32 blocks of an octet, then carries the float sums over to the next 32): every
    SIMD tier gives the same bits as the others and batch = token by token, near the numpy
    emulation, for token counts that use every tile width."""
    rng = np.random.default_rng(23)
    rows, cols = 37, 33 * 32 + 64
    w = random_weights(kind, rows, cols, rng)
    x = rng.standard_normal((13, cols)).astype(np.float32)
    exact = emulate_int8(kind, w, rows, cols, x)
    outs = []
    for isa in FAST_TIERS:
        batch = testing.kernel_matmul_int8(isa, TYPES[kind], w, rows, cols, x)
        single = np.concatenate([testing.kernel_matmul_int8(isa, TYPES[kind], w, rows, cols, x[i:i + 1])
                                 for i in range(len(x))])
        assert np.array_equal(batch, single), isa
        assert np.abs(batch - exact).max() <= 1e-5 * np.abs(exact).max(), isa
        outs.append(batch)
    for isa, o in zip(FAST_TIERS[1:], outs[1:]):
        assert np.array_equal(o, outs[0]), (isa, FAST_TIERS[0])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_matmul_int8_column_spans(kind):
    """A prefill whose quantized activations outgrow half the L2 (kernels_avx512.cpp:
    span_blocks) runs in column spans over blocks of 16 row groups, the sums waiting in a
    scratch buffer between spans: the bits are still every token's own (checked on tokens from
    every tile width), the same on every SIMD tier, and near the numpy emulation. 277 rows: a
    block of 16 groups, then 2 groups whose last has 5 rows."""
    rng = np.random.default_rng(29)
    rows, cols, n = 277, 4096, 403
    l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE") if "SC_LEVEL2_CACHE_SIZE" in os.sysconf_names else 0
    assert n * (cols // 32) * (32 + 12) > (l2 if l2 > 0 else 1 << 20) / 2, "the shape must need spans here"
    w = random_weights(kind, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    exact = emulate_int8(kind, w, rows, cols, x)
    outs = []
    for isa in FAST_TIERS:
        batch = testing.kernel_matmul_int8(isa, TYPES[kind], w, rows, cols, x)
        for i in (0, 1, 5, 6, 395, 399, 400, 402):
            single = testing.kernel_matmul_int8(isa, TYPES[kind], w, rows, cols, x[i:i + 1])[0]
            assert np.array_equal(batch[i], single), (isa, i)
        assert np.abs(batch - exact).max() <= 1e-5 * np.abs(exact).max(), isa
        outs.append(batch)
    for isa, o in zip(FAST_TIERS[1:], outs[1:]):
        assert np.array_equal(o, outs[0]), (isa, FAST_TIERS[0])


def _mxfp4_weights(rows: int, cols: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random e2m1 pairs and E8M0 scales near 2^0 (kernels.h: kTypeMXFP4)."""
    return (rng.integers(0, 256, rows * cols // 2, dtype=np.uint8),
            rng.integers(118, 136, rows * cols // 32, dtype=np.uint8))


@pytest.mark.skipif("amx" not in FAST_TIERS, reason="no AMX tier on this machine")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "MXFP4"])
def test_amx_tiles_give_the_avx512_bits(kind):
    """The AMX tier's prefill computes the integer sums of whole 16-token tiles on the tile unit
    and applies the same float steps as the AVX-512 tile, so it gives the AVX-512 tier's bits for
    every token count: whole tiles (32, 48), tiles plus AVX-512's rest (33, 45), batches under 32
    tokens that run the AVX-512 kernel whole (16, 17), one span of blocks or several (4,096 and
    14,336 columns at 200 tokens), and groups cut short (rows % 16).
    The reference check (within 1e-5 of the numpy emulation) covers the tiles again through
    test_matmul_int8_column_spans' 403 tokens."""
    rng = np.random.default_rng(list(kind.encode()))
    for rows, cols, counts in ((48, 128, (16, 17, 32, 33, 45, 48)), (37, 4096, (16, 200)), (20, 14336, (200,))):
        if kind == "MXFP4":
            w, scales = _mxfp4_weights(rows, cols, rng)
            type_id = 1001
        else:
            w, scales, type_id = random_weights(kind, rows, cols, rng), np.zeros(0, np.uint8), TYPES[kind]
        for n in counts:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            amx = testing.kernel_matmul_int8("amx", type_id, w, rows, cols, x, scales)
            avx512 = testing.kernel_matmul_int8("avx512", type_id, w, rows, cols, x, scales)
            assert np.array_equal(amx.view(np.uint32), avx512.view(np.uint32)), (rows, cols, n)
            assert np.all(np.isfinite(amx)) and np.abs(amx).max() > 0


@pytest.mark.skipif(len(FAST_TIERS) < 2, reason="needs two SIMD tiers on this machine")
@pytest.mark.parametrize("kind", list(TYPES))
def test_simd_tiers_give_the_same_bits(kind):
    """The AVX2 tiers do the AVX-512 tier's integer sums and float steps in the same order per
    (row, token), so the int8 and float-panel matmuls, and the attention kernels over fp32 and
    fp16 caches, agree bit for bit across the SIMD tiers (a model's logits do not depend on the
    CPU it runs on, beyond the reference)."""
    rng = np.random.default_rng(list(kind.encode()))
    rows, cols = (150, 96) if kind in BLOCK_BYTES else (150, 83)
    w = random_weights(kind, rows, cols, rng)
    base = FAST_TIERS[-1]
    for n in (1, 2, 3, 5, 13):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        for isa in FAST_TIERS[:-1]:
            if kind in BLOCK_BYTES:
                assert np.array_equal(testing.kernel_matmul_int8(isa, TYPES[kind], w, rows, cols, x),
                                      testing.kernel_matmul_int8(base, TYPES[kind], w, rows, cols, x)), (isa, n)
            else:
                assert np.array_equal(testing.kernel_matmul(isa, TYPES[kind], w, rows, cols, x),
                                      testing.kernel_matmul(base, TYPES[kind], w, rows, cols, x)), (isa, n)
    for hd, n, stride in ((64, 203, 192), (512, 75, 512)):
        q = rng.standard_normal((7, hd)).astype(np.float32)
        k = rng.standard_normal((n, stride)).astype(np.float16)
        v = rng.standard_normal((n, stride)).astype(np.float16)
        p = rng.random((7, n)).astype(np.float32)
        for isa in FAST_TIERS[:-1]:
            for fn, args in ((testing.kernel_attn_scores_h, (q, k.view(np.uint16), hd, 0.125)),
                             (testing.kernel_attn_scores, (q, k.astype(np.float32), hd, 0.125)),
                             (testing.kernel_attn_values_h, (p, v.view(np.uint16), hd)),
                             (testing.kernel_attn_values, (p, v.astype(np.float32), hd))):
                assert np.array_equal(fn(isa, *args), fn(base, *args)), (isa, hd, fn.__name__)
