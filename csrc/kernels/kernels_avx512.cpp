// AVX-512 kernels (F/BW/VL/DQ + F16C + FMA). This is the only file compiled with AVX-512 flags;
// it is reached only through the kernel table after cpu_features.cpp has checked CPUID and
// XCR0, so a machine without AVX-512 never executes an instruction from it.
//
// The matmul dequantizes each 32-value weight block once into two zmm registers and multiplies
// it into up to 8 tokens at a time (prefill), so dequantization is amortized over the batch
// while a token's own accumulation order stays independent of the batch size. Dequantization
// rounds exactly like the reference (multiply, then add), so the two paths differ only by the
// order of the float sums.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels.h"

namespace zen5 {
namespace {

constexpr bool is_quant(int t) { return t == GGML_Q4_0 || t == GGML_Q4_1 || t == GGML_Q8_0; }
constexpr size_t blk_bytes(int t) { return t == GGML_Q4_0 ? 18 : t == GGML_Q4_1 ? 20 : 34; }

inline float half(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return _cvtsh_ss(v); }

// Dequantize one 32-value block into w0 (values 0..15) and w1 (16..31).
template <int TYPE>
inline void deq_block(const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(half(b));
    if constexpr (TYPE == GGML_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i*)(b + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i*)(b + 18));
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    } else {
        const uint8_t* qs = b + (TYPE == GGML_Q4_1 ? 4 : 2);
        const __m128i q = _mm_loadu_si128((const __m128i*)qs);
        const __m128i mask = _mm_set1_epi8(15);
        __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, mask));
        __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
        if constexpr (TYPE == GGML_Q4_0) {
            const __m512i eight = _mm512_set1_epi32(8);
            w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)), d);
            w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)), d);
        } else {
            const __m512 m = _mm512_set1_ps(half(b + 2));
            w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), m);
            w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d), m);
        }
    }
}

// 16 float weights from column c of an F32/F16/BF16 row; lanes outside `m` are zero.
template <int TYPE>
inline __m512 load_w16(const uint8_t* row, int64_t c, __mmask16 m) {
    if constexpr (TYPE == GGML_F32) {
        return _mm512_maskz_loadu_ps(m, (const float*)row + c);
    } else if constexpr (TYPE == GGML_F16) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t*)row + c));
    } else {  // BF16: the high half of an fp32
        const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)row + c);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

template <int TYPE, int NT>
void row_tile(const WeightView& w, int64_t r, const float* x, int64_t ldx, float* y, int64_t ldy) {
    // Two accumulators per token (low and high half of each block) so consecutive FMAs do not
    // wait on each other; with NT = 8 that is 16 zmm accumulators, still within the 32 registers.
    __m512 lo[NT], hi[NT];
    for (int t = 0; t < NT; ++t) lo[t] = hi[t] = _mm512_setzero_ps();
    const uint8_t* row = w.row(r);
    if constexpr (is_quant(TYPE)) {
        const int64_t nb = w.cols / QK;
        for (int64_t b = 0; b < nb; ++b) {
            __m512 w0, w1;
            deq_block<TYPE>(row + b * blk_bytes(TYPE), w0, w1);
            for (int t = 0; t < NT; ++t) {
                const float* xt = x + t * ldx + b * QK;
                lo[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), lo[t]);
                hi[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), hi[t]);
            }
        }
    } else {
        int64_t c = 0;
        for (; c + 32 <= w.cols; c += 32) {
            const __m512 w0 = load_w16<TYPE>(row, c, 0xFFFF), w1 = load_w16<TYPE>(row, c + 16, 0xFFFF);
            for (int t = 0; t < NT; ++t) {
                lo[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * ldx + c), lo[t]);
                hi[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * ldx + c + 16), hi[t]);
            }
        }
        for (; c < w.cols; c += 16) {  // ragged tail, masked
            const __mmask16 m = w.cols - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (w.cols - c)) - 1);
            const __m512 wv = load_w16<TYPE>(row, c, m);
            for (int t = 0; t < NT; ++t)
                lo[t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + t * ldx + c), lo[t]);
        }
    }
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[t], hi[t]));
}

template <int TYPE>
void matmul_typed(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n,
                  int64_t ldx, float* y, int64_t ldy) {
    for (int64_t r = r0; r < r1; ++r) {
        for (int t0 = 0; t0 < n; t0 += 8) {
            const float* xt = x + t0 * ldx;
            float* yt = y + t0 * ldy;
            switch (n - t0 >= 8 ? 8 : n - t0) {
                case 1: row_tile<TYPE, 1>(w, r, xt, ldx, yt, ldy); break;
                case 2: row_tile<TYPE, 2>(w, r, xt, ldx, yt, ldy); break;
                case 3: row_tile<TYPE, 3>(w, r, xt, ldx, yt, ldy); break;
                case 4: row_tile<TYPE, 4>(w, r, xt, ldx, yt, ldy); break;
                case 5: row_tile<TYPE, 5>(w, r, xt, ldx, yt, ldy); break;
                case 6: row_tile<TYPE, 6>(w, r, xt, ldx, yt, ldy); break;
                case 7: row_tile<TYPE, 7>(w, r, xt, ldx, yt, ldy); break;
                default: row_tile<TYPE, 8>(w, r, xt, ldx, yt, ldy); break;
            }
        }
    }
}

void matmul_avx512(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n,
                   int64_t ldx, float* y, int64_t ldy) {
    switch (w.type) {
        case GGML_F32: return matmul_typed<GGML_F32>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_F16: return matmul_typed<GGML_F16>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_BF16: return matmul_typed<GGML_BF16>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_Q4_0: return matmul_typed<GGML_Q4_0>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_Q4_1: return matmul_typed<GGML_Q4_1>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_Q8_0: return matmul_typed<GGML_Q8_0>(w, r0, r1, x, n, ldx, y, ldy);
    }
}

template <int TYPE>
void dequant_typed(const uint8_t* src, int64_t n, float* dst) {
    if constexpr (is_quant(TYPE)) {
        for (int64_t b = 0; b < n / QK; ++b) {
            __m512 w0, w1;
            deq_block<TYPE>(src + b * blk_bytes(TYPE), w0, w1);
            _mm512_storeu_ps(dst + b * QK, w0);
            _mm512_storeu_ps(dst + b * QK + 16, w1);
        }
    } else {
        for (int64_t c = 0; c < n; c += 16) {
            const __mmask16 m = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
            _mm512_mask_storeu_ps(dst + c, m, load_w16<TYPE>(src, c, m));
        }
    }
}

void dequant_row_avx512(int type, const uint8_t* src, int64_t n, float* dst) {
    switch (type) {
        case GGML_F32: return dequant_typed<GGML_F32>(src, n, dst);
        case GGML_F16: return dequant_typed<GGML_F16>(src, n, dst);
        case GGML_BF16: return dequant_typed<GGML_BF16>(src, n, dst);
        case GGML_Q4_0: return dequant_typed<GGML_Q4_0>(src, n, dst);
        case GGML_Q4_1: return dequant_typed<GGML_Q4_1>(src, n, dst);
        case GGML_Q8_0: return dequant_typed<GGML_Q8_0>(src, n, dst);
    }
}

inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

float dot_avx512(const float* a, const float* b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void axpy_avx512(float a, const float* x, float* y, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

void add_avx512(float* y, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(y + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), _mm512_maskz_loadu_ps(m, x + i)));
    }
}

void rmsnorm_avx512(const float* x, const float* w, int64_t n, float eps, float* out) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), scale),
                                       _mm512_maskz_loadu_ps(m, w + i));
        _mm512_mask_storeu_ps(out + i, m, v);
    }
}

// exp(x) for x in [-87, 88]: 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and a degree-6
// polynomial (Cephes coefficients), about 2 ulp; scalef applies 2^k without integer tricks.
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}

void swiglu_avx512(const float* g, const float* u, int64_t n, float* out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

// 16 cache values from fp32 or fp16 rows; lanes outside m are zero
inline __m512 load_kv(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_kv(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

template <typename T>
void attn_scores_t(const float* q, const T* k, int64_t stride, int n, int hd, float scale, float* out) {
    // Four rows per step: independent accumulators hide the FMA latency.
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const T* k0 = k + i * stride;
        for (int d = 0; d < hd; d += 16) {
            const __mmask16 m = tail_mask(hd - d);
            const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
            a0 = _mm512_fmadd_ps(qv, load_kv(k0 + d, m), a0);
            a1 = _mm512_fmadd_ps(qv, load_kv(k0 + stride + d, m), a1);
            a2 = _mm512_fmadd_ps(qv, load_kv(k0 + 2 * stride + d, m), a2);
            a3 = _mm512_fmadd_ps(qv, load_kv(k0 + 3 * stride + d, m), a3);
        }
        out[i] = _mm512_reduce_add_ps(a0) * scale;
        out[i + 1] = _mm512_reduce_add_ps(a1) * scale;
        out[i + 2] = _mm512_reduce_add_ps(a2) * scale;
        out[i + 3] = _mm512_reduce_add_ps(a3) * scale;
    }
    for (; i < n; ++i) {
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 16) {
            const __mmask16 m = tail_mask(hd - d);
            a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), load_kv(k + i * stride + d, m), a);
        }
        out[i] = _mm512_reduce_add_ps(a) * scale;
    }
}

void attn_scores_avx512(const float* q, const float* k, int64_t stride, int n, int hd, float scale, float* out) {
    attn_scores_t(q, k, stride, n, hd, scale, out);
}
void attn_scores_h_avx512(const float* q, const uint16_t* k, int64_t stride, int n, int hd, float scale, float* out) {
    attn_scores_t(q, k, stride, n, hd, scale, out);
}

void softmax_avx512(float* x, int n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 16)
        mx = _mm512_mask_max_ps(mx, tail_mask(n - i), mx, _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vmax));
        sum = _mm512_mask_add_ps(sum, m, sum, e);
        _mm512_mask_storeu_ps(x + i, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
    }
}

template <typename T>
void attn_values_t(const float* p, const T* v, int64_t stride, int n, int hd, float* out) {
    for (int d0 = 0; d0 < hd; d0 += 64) {  // up to 64 output lanes stay in registers
        const int w = hd - d0 < 64 ? hd - d0 : 64;
        const __mmask16 m0 = tail_mask(w), m1 = tail_mask(w - 16), m2 = tail_mask(w - 32), m3 = tail_mask(w - 48);
        __m512 o0 = _mm512_maskz_loadu_ps(m0, out + d0), o1 = _mm512_maskz_loadu_ps(m1, out + d0 + 16);
        __m512 o2 = _mm512_maskz_loadu_ps(m2, out + d0 + 32), o3 = _mm512_maskz_loadu_ps(m3, out + d0 + 48);
        for (int i = 0; i < n; ++i) {
            const __m512 pi = _mm512_set1_ps(p[i]);
            const T* vi = v + i * stride + d0;
            o0 = _mm512_fmadd_ps(pi, load_kv(vi, m0), o0);
            if (w > 16) o1 = _mm512_fmadd_ps(pi, load_kv(vi + 16, m1), o1);
            if (w > 32) o2 = _mm512_fmadd_ps(pi, load_kv(vi + 32, m2), o2);
            if (w > 48) o3 = _mm512_fmadd_ps(pi, load_kv(vi + 48, m3), o3);
        }
        _mm512_mask_storeu_ps(out + d0, m0, o0);
        if (w > 16) _mm512_mask_storeu_ps(out + d0 + 16, m1, o1);
        if (w > 32) _mm512_mask_storeu_ps(out + d0 + 32, m2, o2);
        if (w > 48) _mm512_mask_storeu_ps(out + d0 + 48, m3, o3);
    }
}

void attn_values_avx512(const float* p, const float* v, int64_t stride, int n, int hd, float* out) {
    attn_values_t(p, v, stride, n, hd, out);
}
void attn_values_h_avx512(const float* p, const uint16_t* v, int64_t stride, int n, int hd, float* out) {
    attn_values_t(p, v, stride, n, hd, out);
}

void to_f16_avx512(const float* x, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(out + i, m, h);
    }
}

void quantize_act_avx512(const float* x, int n, int64_t cols, int8_t* q, float* d, int32_t* s) {
    const int64_t nb = cols / QK;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    for (int t = 0; t < n; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * QK;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            const __m512 vid = _mm512_set1_ps(id);
            // round to nearest even (the default MXCSR mode), as nearbyint in the reference
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
            q0 = _mm512_max_epi32(_mm512_min_epi32(q0, hi), lo);
            q1 = _mm512_max_epi32(_mm512_min_epi32(q1, hi), lo);
            _mm_storeu_si128((__m128i*)(q + t * cols + b * QK), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i*)(q + t * cols + b * QK + 16), _mm512_cvtepi32_epi8(q1));
            d[t * nb + b] = db;
            s[t * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}

inline int32_t load_i32(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// One group of 16 rows against NT tokens: lane r of each accumulator is row g*16+r. Per block
// the 16 rows' unsigned weights sit in 4 (Q4) or 8 (Q8) registers, each vpdpbusd multiplies
// 4 consecutive weights of every row by the same 4 broadcast activation bytes.
template <int TYPE, int NT>
void group_tile(const PackedWeights& w, int64_t g, const QuantAct& x, int t0, float* y, int64_t ldy,
                __mmask16 rows) {
    __m512 f[NT];
    for (int t = 0; t < NT; ++t) f[t] = _mm512_setzero_ps();
    const __m512i m0f = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* blk = w.at(g, b);
        const __m512 wd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)blk));
        __m512i p[8];
        if constexpr (TYPE == GGML_Q8_0) {
            for (int j = 0; j < 8; ++j) p[j] = _mm512_load_si512((const void*)(blk + 64 + 64 * j));
        } else {
            for (int j = 0; j < 4; ++j) {
                const __m512i raw = _mm512_load_si512((const void*)(blk + 64 + 64 * j));
                p[j] = _mm512_and_si512(raw, m0f);                          // elements 4j..4j+3
                p[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m0f);  // elements 16+4j..
            }
        }
        for (int t = 0; t < NT; ++t) {
            const int64_t tt = t0 + t;
            const int8_t* xq = x.q + tt * x.cols + b * QK;
            __m512i acc = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j) {
                const int off = TYPE == GGML_Q8_0 ? 4 * j : (j < 4 ? 4 * j : 16 + 4 * (j - 4));
                acc = _mm512_dpbusd_epi32(acc, p[j], _mm512_set1_epi32(load_i32(xq + off)));
            }
            const int32_t sx = x.s[tt * w.blocks + b];
            if constexpr (TYPE == GGML_Q4_0) acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(8 * sx));
            if constexpr (TYPE == GGML_Q8_0) acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * sx));
            const float dx = x.d[tt * w.blocks + b];
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(wd, _mm512_set1_ps(dx)), f[t]);
            if constexpr (TYPE == GGML_Q4_1) {
                const __m512 wm = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(blk + 32)));
                f[t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(dx * float(sx)), f[t]);
            }
        }
    }
    for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + g * 16, rows, f[t]);
}

template <int TYPE>
void matmul_int8_typed(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n,
                       float* y, int64_t ldy) {
    for (int64_t g = r0 / 16; g * 16 < r1; ++g) {
        const int64_t left = r1 - g * 16;
        const __mmask16 rows = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        int t0 = 0;
        for (; t0 + 4 <= n; t0 += 4) group_tile<TYPE, 4>(w, g, x, t0, y, ldy, rows);
        switch (n - t0) {
            case 3: group_tile<TYPE, 3>(w, g, x, t0, y, ldy, rows); break;
            case 2: group_tile<TYPE, 2>(w, g, x, t0, y, ldy, rows); break;
            case 1: group_tile<TYPE, 1>(w, g, x, t0, y, ldy, rows); break;
        }
    }
}

void matmul_int8_avx512(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n,
                        float* y, int64_t ldy) {
    switch (w.type) {
        case GGML_Q4_0: return matmul_int8_typed<GGML_Q4_0>(w, r0, r1, x, n, y, ldy);
        case GGML_Q4_1: return matmul_int8_typed<GGML_Q4_1>(w, r0, r1, x, n, y, ldy);
        case GGML_Q8_0: return matmul_int8_typed<GGML_Q8_0>(w, r0, r1, x, n, y, ldy);
    }
}

}  // namespace

const Kernels* kernels_avx512() {
    static const Kernels k{"avx512", matmul_avx512, dequant_row_avx512, dot_avx512, axpy_avx512,
                           add_avx512, rmsnorm_avx512, swiglu_avx512, attn_scores_avx512,
                           quantize_act_avx512, matmul_int8_avx512, attn_scores_h_avx512,
                           attn_values_h_avx512, to_f16_avx512, softmax_avx512, attn_values_avx512};
    return &k;
}

}  // namespace zen5
