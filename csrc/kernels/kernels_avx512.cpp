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
#include "tier_scratch.h"

namespace zen5 {
namespace {

constexpr bool is_quant(int t) { return t == GGML_Q4_0 || t == GGML_Q4_1 || t == GGML_Q8_0; }
constexpr size_t blk_bytes(int t) { return t == GGML_Q4_0 ? 18 : t == GGML_Q4_1 ? 20 : 34; }

// Decode reads each weight once per token, a stream of ~100 MB that only just fits the cache
// share this VM gets. On the Xeon this tier was tuned on, the hardware prefetcher did not run far
// enough ahead of a GEMV doing 8 dependent vpdpbusd per block, so the kernel fetches ahead: first
// 8 KB into L1 (swept 1-32 KB; faster decode at 1 and 2 threads, commit 89db314), now
// kPrefetchBlocks blocks into L2 (8 KB of Q4_1, 16 KB of Q8_0): in alternating pairs against the
// former, Q8_0 decode faster at 1 and 2 threads, Q4_1 unchanged (commit 45261a4; 16 KB of Q4_1
// was slower). On an AMD Zen 4 the same prefetch makes Q8_0 slower: an 8192 x 8192 GEMV at 1
// thread read 23-27 GB/s without it and 17-19 GB/s with 2-16 KB of it, and DeepSeek V4's Q8_0
// attention projections decoded 22% faster at 1 thread and 11% at 2 without it (in-process
// alternation on the V4 bench model); Q4_0 (1.7B Llama decode, 2% faster at 1 thread) and
// MXFP4 (V4 experts, 3% faster than none or 64 blocks) keep it. So on AMD, Q8_0 streams with the
// hardware prefetchers alone (prefetch_blocks).
// Decode (one token) now streams two groups at once (matmul_int8_typed), which keeps twice the
// misses in flight, and fetches only kDecodePrefetchBlocks ahead: on the Xeon, a standalone GEMV
// over 400-750 MB of 4096/14336-wide matrices went from 13.5-15.1 GB/s (one group, 32 blocks) to
// 15.0-16.7 at 1 thread (the plain read roof: 16.3-16.8) and 26.1-29.7 -> 31.4-32.9 at 2 threads;
// 0, 16 or 32 blocks ahead, or four groups, were no better than 8 (medians of 5 alternations).
// A batch of at most kOnePassTokens tokens (a V4 expert's share of a prefill, ~12 tokens at V4
// Flash's 6 of 256; a prompt-lookup verification) runs as one token tile per row group, so its
// weights stream from memory once, paced by the tile's arithmetic, like decode's: it fetches
// kDecodePrefetchBlocks ahead too (group_tiles_one_pass).
// A pass's last kDecodePrefetchBlocks blocks fetch the start of the next pass (the groups G
// further on) instead of the blocks right after their own group's end, which the other stream
// of the pair reads or already read: with 2,048 columns (64 blocks per group) each pair of
// streams otherwise started cold. Xeon, 1 thread, GEMVs over 800 MB of copies, medians of 15
// alternations: 2048 x 2048 Q4_0 +4.4%, Q4_1 +6.5%, 8192 x 2048 Q4_0 +5.1%, Q4_1 +3.2%, Q8_0
// -1 to +2%, 8,192 columns unchanged; 1.7B Llama decode +1.8% (Q4_0) and +4.6% (Q8_0) at 1
// thread, +3.0% (Q4_0), +4.6% (Q4_1) and +0.6% (Q8_0) at 2 (12 alternations of 16 tokens).
// Q4 decode on AMD fetches into L1 instead (T0), kAmdQ4DecodeBlocks ahead shared among the
// streams: 16 blocks with one group per pass, 8 per group with two (decode_in_pairs). On a Zen 4,
// 1 thread, GEMVs from DRAM (GB/s, 8 blocks into L2 -> this): 2048 x 2048 Q4_0 26.2 -> 30.3,
// 2048 x 8192 Q4_0 24.0 -> 30.1, Q4_1 26.9 -> 29.8, 4096 x 4096 Q4_1 27.6 -> 29.9; with pairs,
// 4096 x 14336 Q4_0 22.7 -> 28.5, Q4_1 24.5 -> 28.5 (16 per group there: 27.0, 26.9). Q8_0 (no
// prefetch on AMD, above) lost 10-20% with any T0 prefetch, and MXFP4 gained nothing.
constexpr int kPrefetchBlocks = 32, kDecodePrefetchBlocks = 8, kOnePassTokens = 16, kAmdQ4DecodeBlocks = 16;
constexpr bool is_q4(int t) { return t == GGML_Q4_0 || t == GGML_Q4_1; }
bool amd_q4_decode(int type, int n) { return n == 1 && is_q4(type) && cpu_is_amd(); }
int prefetch_blocks(int type, int n, int groups) {
    if (amd_q4_decode(type, n)) return kAmdQ4DecodeBlocks / groups;
    return type == GGML_Q8_0 && cpu_is_amd() ? 0 : n <= kOnePassTokens ? kDecodePrefetchBlocks : kPrefetchBlocks;
}

// Decode on AMD reads one 16-row group per pass where a group's rows are short. A group's blocks
// are contiguous and the groups follow each other, so one group at a time reads a matrix as one
// sequential stream; two at a time read two streams a group apart that both jump a group ahead
// at every pass, and on a Zen 4 the hardware prefetchers lose time at every jump. Measured on an
// AMD EPYC Zen 4, 1 thread, GEMVs over 1.5 GB of copies of one matrix (rows x columns; medians
// of 3-5 alternations in one process, GB/s, two groups -> one): 2048 x 2048 Q4_0 19.9 -> 25.6;
// 4096 x 4096 Q4_0 20.8 -> 23.9, Q4_1 23.0 -> 26.1, Q8_0 29.1 -> 31.6; 4096 x 8192 Q4_0 22.6 ->
// 25.4, Q4_1 24.3 -> 27.5, Q8_0 29.2 -> 29.9; 4096 x 14336 Q4_0 21.9 -> 20.0, Q4_1 22.9 -> 22.0,
// Q8_0 31.0 -> 32.0; MXFP4 2048 x 4096 15.5 -> 17.8, 4096 x 2048 16.8 -> 27.7. So Q4 rows longer
// than 8192 columns keep the pairs (their unpacking makes the loop denser, and two streams then
// keep more misses in flight), and so does the Xeon, where pairs were faster (see above). A
// batch of 2-6 tokens keeps the pairs too: each broadcast then feeds two groups (4 tokens, 2048 x
// 2048: 17.8 GB/s with pairs, 16.5 without).
bool decode_in_pairs(int type, int64_t blocks) { return (is_q4(type) && blocks > 256) || !cpu_is_amd(); }

inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

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

// Quantized weights with float activations (the int8 matmul switched off): each block
// dequantized once for NT tokens.
template <int TYPE, int NT>
void row_tile(const WeightView& w, int64_t r, const float* x, int64_t ldx, float* y, int64_t ldy) {
    // Two accumulators per token (low and high half of each block) so consecutive FMAs do not
    // wait on each other; with NT = 8 that is 16 zmm accumulators, still within the 32 registers.
    __m512 lo[NT], hi[NT];
    for (int t = 0; t < NT; ++t) lo[t] = hi[t] = _mm512_setzero_ps();
    const uint8_t* row = w.row(r);
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
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[t], hi[t]));
}

// The float decode GEMV streams the panels in order (a band's steps are contiguous, and so are
// the bands of a slice) and fetches kPrefetchRow bytes ahead into L2. On the row layout this
// made BF16 decode faster than the hardware prefetchers alone (2 KB into L1 best; commit
// 10af0a5); on the panels, L2 at 2 / 4 / 8 KB beat L1 at 2 KB in 2-thread decode (commit
// c77fd7c; 1 thread about equal).
// On an AMD Zen 4, V4 Flash's BF16 head (1 GB) decoded 20% faster at 1 thread without it, and
// equally fast at 2 (in-process alternation), so there the panels stream with the hardware
// prefetchers alone (the AVX2 tier's finding on that machine too).
constexpr size_t kPrefetchRow = 4096;
// One band (64 rows, kernels.h: FloatPanels) x NT tokens: 4 x NT accumulators, one FMA chain
// per (row, token) over the columns in order, so every tile shape gives the same bits. Each
// weight vector is widened once for the NT tokens; each token's value is a broadcast from x.
template <int TYPE, int NT>
void panel_tile(const FloatPanels& w, int64_t band, const float* x, int64_t ldx, float* y, int64_t ldy,
                int64_t r_end) {
    __m512 a[4][NT];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g)
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) a[g][t] = _mm512_setzero_ps();
    const uint8_t* p = w.band(band);
    const size_t sb = 4 * w.group_bytes;  // bytes per step
    auto fma_col = [&](int g, __m512 wv, int64_t c) {
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) a[g][t] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[t * ldx + c]), a[g][t]);
    };
    static const bool ahead = !cpu_is_amd();
    auto prefetch = [&](const uint8_t* step) {
        if constexpr (NT == 1)  // decode: one stream, fetched ahead (see kPrefetchRow)
            if (ahead)
                for (size_t o = 0; o < sb; o += 64) _mm_prefetch((const char*)step + kPrefetchRow + o, _MM_HINT_T1);
    };
    if constexpr (TYPE == GGML_BF16) {
        const __m512i hi = _mm512_set1_epi32(int(0xFFFF0000u));
        const int64_t pairs = w.cols / 2;
        for (int64_t s = 0; s < pairs; ++s, p += sb) {
            prefetch(p);
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)  // column 2s: the low halves
                fma_col(g, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_load_si512(p + 64 * g), 16)), 2 * s);
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)  // column 2s + 1: the high halves
                fma_col(g, _mm512_castsi512_ps(_mm512_and_si512(_mm512_load_si512(p + 64 * g), hi)), 2 * s + 1);
        }
        if (w.cols % 2)  // the last column, paired with zeros
            for (int g = 0; g < 4; ++g)
                fma_col(g, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_load_si512(p + 64 * g), 16)), w.cols - 1);
    } else {
        for (int64_t c = 0; c < w.cols; ++c, p += sb) {
            prefetch(p);
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)
                fma_col(g, TYPE == GGML_F16 ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(p + 32 * g)))
                                            : _mm512_load_ps((const float*)(p + 64 * g)), c);
        }
    }
    const int64_t r0 = band * kPanelRows;
    for (int g = 0; g < 4 && r0 + 16 * g < r_end; ++g) {
        const __mmask16 m = tail_mask(r_end - r0 - 16 * g);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + t * ldy + r0 + 16 * g, m, a[g][t]);
    }
}

template <int TYPE>
void matmul_typed(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n,
                  int64_t ldx, float* y, int64_t ldy) {
    if constexpr (!is_quant(TYPE)) {
        if (!w.panels) return kernels_ref().matmul(w, r0, r1, x, n, ldx, y, ldy);  // (kernels.h)
        // bands outer: a band's weights (64 rows: 72 KB in BF16 at 576 columns) stay in L2
        // while every 6-token tile uses them
        for (int64_t b = r0 / kPanelRows; b * kPanelRows < r1; ++b)
            for (int t0 = 0; t0 < n; t0 += 6) {
                const float* xt = x + t0 * ldx;
                float* yt = y + t0 * ldy;
                switch (n - t0 >= 6 ? 6 : n - t0) {
                    case 1: panel_tile<TYPE, 1>(*w.panels, b, xt, ldx, yt, ldy, r1); break;
                    case 2: panel_tile<TYPE, 2>(*w.panels, b, xt, ldx, yt, ldy, r1); break;
                    case 3: panel_tile<TYPE, 3>(*w.panels, b, xt, ldx, yt, ldy, r1); break;
                    case 4: panel_tile<TYPE, 4>(*w.panels, b, xt, ldx, yt, ldy, r1); break;
                    case 5: panel_tile<TYPE, 5>(*w.panels, b, xt, ldx, yt, ldy, r1); break;
                    default: panel_tile<TYPE, 6>(*w.panels, b, xt, ldx, yt, ldy, r1); break;
                }
            }
        return;
    }
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

// Long-context attention is bound by reading the cache, and a head's data is not one stream (its
// key tiles are kv_dim x 16 values apart, its value rows kv_dim values apart), which the hardware
// prefetchers do not follow: without help, decode at 4k positions read its K/V far below the
// machine's read bandwidth (the roofs: README, Performance). The
// kernels fetch kTilesAhead key tiles or 2 x kRowsAhead value rows ahead into L2. A prefetch
// never faults, so reading past the cache's end is harmless.
constexpr int kRowsAhead = 32, kTilesAhead = 4;
inline void prefetch_bytes(const void* p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T1);
}

// 16 positions of one key channel (a tile row)
inline __m512 load_tile_row(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_tile_row(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Scores of G queries (channel d of query g at q[d * DS + g * QS]: either channel-major (hd, G),
// or as given, (G, 64), when the head size is 64; both reach every query value at a constant
// offset from one pointer) against the 16 x R positions of R consecutive key tiles (tile i0 / 16 on):
// G x R accumulators, one chain over the channels each; every tile row is loaded and converted
// once for the G queries. G x R <= 24, and for R > 1 also G x (R + 1) <= 31: GCC then keeps each
// query value broadcast in a register while the R tiles use it (6 x 4 spilled accumulators);
// with R = 1 the broadcast is the FMA's memory operand and takes no register.
template <typename T, int G, int R, int QS, int DS>
inline void score_tiles(const float* q, int hd, const T* k, int64_t tstride, float scale, float* out, int64_t ldo,
                        int i0, int n) {
    __m512 a[G][R];
#pragma GCC unroll 24
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) a[g][r] = _mm512_setzero_ps();
    // the tiles kTilesAhead further, a line at a time as the channels advance (a burst of
    // prefetches at the start of a pass filled the line-fill buffers and stalled the loop)
    const char* ahead = reinterpret_cast<const char*>(k + kTilesAhead * tstride);
    constexpr int kRowBytes = kKeyTile * sizeof(T);  // one channel of a tile: 32 or 64 bytes
#pragma GCC unroll 2
    for (int d = 0; d < hd; ++d) {
        if ((d * kRowBytes) % 64 == 0)
            for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (r * tstride + d * kKeyTile) * sizeof(T), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512 kv = load_tile_row(k + r * tstride + d * kKeyTile);
#pragma GCC unroll 24  // GCC's own heuristics left the 24-query loop rolled, accumulators in memory
            for (int g = 0; g < G; ++g) a[g][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[d * DS + g * QS]), kv, a[g][r]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
        const int i = i0 + r * kKeyTile;
        if (i >= n) break;
        const __mmask16 m = tail_mask(n - i);
#pragma GCC unroll 24
        for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(out + g * ldo + i, m, _mm512_mul_ps(a[g][r], s));
    }
}

// `left` tiles from tile t for G queries: R at a time, then the rest with smaller R.
// kDirect: the queries as given, (G, 64); otherwise channel-major (hd, G).
template <typename T, int G, int R, bool kDirect>
void score_run(const float* q, int hd, const T* k, int64_t tstride, float scale, float* out, int64_t ldo, int t,
               int left, int n) {
    constexpr int QS = kDirect ? 64 : 1, DS = kDirect ? 1 : G;
    for (; left >= R; t += R, left -= R)
        score_tiles<T, G, R, QS, DS>(q, hd, k + t * tstride, tstride, scale, out, ldo, t * kKeyTile, n);
    if constexpr (R > 1)
        if (left > 0) score_run<T, G, R / 2, kDirect>(q, hd, k, tstride, scale, out, ldo, t, left, n);
}

template <typename T, bool kDirect>
void score_group(int g, const float* q, int hd, const T* k, int64_t tstride, float scale, float* out, int64_t ldo,
                 int t0, int cnt, int n) {
    if (g == 24) score_run<T, 24, 1, kDirect>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else if (g == 12) score_run<T, 12, 1, kDirect>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else if (g == 6) score_run<T, 6, 3, kDirect>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else if (g == 3) score_run<T, 3, 8, kDirect>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else if (g == 2) score_run<T, 2, 8, kDirect>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else score_run<T, 1, 8, kDirect>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
}

template <typename T>
void attn_scores_t(const float* q, int nq, const T* k, int64_t tstride, int n, int hd, float scale, float* out,
                   int64_t ldo) {
    // Passes of 8 tiles, queries inner: a pass's tiles stay in L1 while every query uses them.
    // Only the grouping depends on nq; each score's arithmetic does not.
    constexpr int kPass = 8;
    auto group_of = [nq](int j) {
        const int left = nq - j;
        return left >= 24 ? 24 : left >= 12 ? 12 : left >= 6 ? 6 : left >= 3 ? 3 : left;
    };
    // A head size of 64 reads the queries as given (constant offsets); any other size first
    // copies each group channel-major. (The copy was a visible share of prefill at 8k
    // positions: it ran for every split.)
    const bool direct = hd == 64;
    thread_local Scratch scratch;
    float* qt = direct ? nullptr : scratch.get<float>(size_t(nq) * hd);  // each group's queries channel-major: (hd, g)
    if (!direct) {
        for (int j = 0, g; j < nq; j += g) {
            g = group_of(j);
            for (int i = 0; i < g; ++i)
                for (int d = 0; d < hd; ++d) qt[size_t(j) * hd + d * g + i] = q[(j + i) * hd + d];
        }
    }
    const int tiles = (n + kKeyTile - 1) / kKeyTile;
    for (int t0 = 0; t0 < tiles; t0 += kPass) {
        const int cnt = imin(kPass, tiles - t0);
        for (int j = 0; j < nq;) {
            const int g = group_of(j);
            const float* qj = (direct ? q : qt) + size_t(j) * hd;
            float* oj = out + j * ldo;
            if (direct) score_group<T, true>(g, qj, hd, k, tstride, scale, oj, ldo, t0, cnt, n);
            else score_group<T, false>(g, qj, hd, k, tstride, scale, oj, ldo, t0, cnt, n);
            j += g;
        }
    }
}

void attn_scores_avx512(const float* q, int nq, const float* k, int64_t tstride, int n, int hd, float scale,
                        float* out, int64_t ldo) {
    attn_scores_t(q, nq, k, tstride, n, hd, scale, out, ldo);
}
void attn_scores_h_avx512(const float* q, int nq, const uint16_t* k, int64_t tstride, int n, int hd, float scale,
                          float* out, int64_t ldo) {
    attn_scores_t(q, nq, k, tstride, n, hd, scale, out, ldo);
}

// 2^t: t = k + r with k = round(t) and r in [-0.5, 0.5] (exact), 2^r by a degree-5 polynomial
// (least squares on Chebyshev nodes, 1.8e-7 relative in fp32), 2^k applied by scalef. Softmax
// works in base 2 (kernels.h), so unlike exp512 there is no multiply by log2(e) and no two-step
// range reduction. The clamp maps -inf to 0 and keeps r finite.
inline __m512 exp2_512(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.3218674576e-03f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6717029810e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5508930236e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022237957e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314688444e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

float softmax_partial_avx512(float* x, int n, float* max) {
    // A score row is short (at most a split), so latency matters more than throughput: four
    // independent max chains (the max is exact in any order) and two interleaved exp/sum chains.
    __m512 mx4[4];
    for (int j = 0; j < 4; ++j) mx4[j] = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 64 <= n; i += 64)
        for (int j = 0; j < 4; ++j) mx4[j] = _mm512_max_ps(mx4[j], _mm512_loadu_ps(x + i + 16 * j));
    for (; i < n; i += 16)
        mx4[0] = _mm512_mask_max_ps(mx4[0], tail_mask(n - i), mx4[0], _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3])));
    const __m512 vmax = _mm512_set1_ps(m);
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (i = 0; i + 32 <= n; i += 32) {
        const __m512 e0 = exp2_512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmax));
        const __m512 e1 = exp2_512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vmax));
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
        _mm512_storeu_ps(x + i, e0);
        _mm512_storeu_ps(x + i + 16, e1);
    }
    for (; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 e = exp2_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vmax));
        s0 = _mm512_mask_add_ps(s0, k, s0, e);
        _mm512_mask_storeu_ps(x + i, k, e);
    }
    *max = m;
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

// out[g] += sum_i p[g][i] v[i] for G queries: each value row is loaded and converted once for
// all of them; one chain per output value, in position order, whatever G is. HD > 0 fixes the
// head size (64: no run-time lane checks in the loop); the arithmetic is the same either way.
template <typename T, int G, int HD, int NV = 4, int LDP = 0>
void values_group(const float* p, int64_t ldp_, const T* v, int64_t stride, int n, int hd_, float* out, int64_t ldo) {
    const int hd = HD ? HD : hd_;
    const int64_t ldp = LDP ? LDP : ldp_;
    constexpr int kW = 16 * NV;
    for (int d0 = 0; d0 < hd; d0 += kW) {  // up to 16 x NV output lanes stay in registers
        const int w = hd - d0 < kW ? hd - d0 : kW;
        __mmask16 m[NV];
        for (int j = 0; j < NV; ++j) m[j] = tail_mask(w - 16 * j);
        __m512 acc[G][NV];
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_maskz_loadu_ps(m[j], out + g * ldo + d0 + 16 * j);
        for (int i = 0; i < n; ++i) {
            const T* vi = v + i * stride + d0;
            if (d0 == 0) {
                if constexpr (HD > 0)
                    for (int o = 0; o < HD * int(sizeof(T)); o += 64) _mm_prefetch((const char*)(vi + 2 * kRowsAhead * stride) + o, _MM_HINT_T1);
                else prefetch_bytes(vi + 2 * kRowsAhead * stride, size_t(hd) * sizeof(T));
            }
            __m512 vv[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j)
                if (16 * j < w) vv[j] = HD ? load_kv(vi + 16 * j, __mmask16(0xFFFF)) : load_kv(vi + 16 * j, m[j]);
#pragma GCC unroll 16  // left to itself GCC kept the loops rolled, accumulators in memory
            for (int g = 0; g < G; ++g) {
                const __m512 pg = _mm512_set1_ps(p[g * ldp + i]);
#pragma GCC unroll 4
                for (int j = 0; j < NV; ++j)
                    if (16 * j < w) acc[g][j] = _mm512_fmadd_ps(pg, vv[j], acc[g][j]);
            }
        }
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j)
                if (16 * j < w) _mm512_mask_storeu_ps(out + g * ldo + d0 + 16 * j, m[j], acc[g][j]);
    }
}

template <typename T, int G>
void values_group(const float* p, int64_t ldp, const T* v, int64_t stride, int n, int hd, float* out, int64_t ldo) {
    if (hd == 64) values_group<T, G, 64>(p, ldp, v, stride, n, hd, out, ldo);
    else values_group<T, G, 0>(p, ldp, v, stride, n, hd, out, ldo);
}

template <typename T>
void attn_values_t(const float* p, int64_t ldp, int nq, const T* v, int64_t stride, int n, int hd, float* out,
                   int64_t ldo) {
    // Blocks of 32 rows, queries in groups of up to 6 (24 accumulators) inner: a block stays in
    // L1 while every group uses it. The partial sums go through `out` between blocks (exact).
    // fp16 rows of 64 channels take 12 queries over each half row instead (24 accumulators too):
    // half as many widenings per query, a faster kernel (commit 2e5eb71). (Widening a whole
    // fp16 block to fp32 once for all groups measured no faster in the engine.)
    constexpr int kBlock = 32;
    const bool halves = sizeof(T) == 2 && hd == 64;
    for (int i0 = 0; i0 < n; i0 += kBlock) {
        const int cnt = imin(kBlock, n - i0);
        const T* vb = v + i0 * stride;
        for (int j = 0; j < nq;) {
            const int g = halves && nq - j >= 12 ? 12 : nq - j >= 6 ? 6 : nq - j >= 4 ? 4 : nq - j;
            const float* pj = p + j * ldp + i0;
            float* oj = out + j * ldo;
            // the decoder's score rows are kAttnSplit floats apart: as a constant, the 12
            // broadcasts are offsets from one pointer (a run-time stride spilled registers)
            if (g == 12 && ldp == kAttnSplit) values_group<T, 12, 64, 2, kAttnSplit>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 12) values_group<T, 12, 64, 2>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 6) values_group<T, 6>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 4) values_group<T, 4>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 3) values_group<T, 3>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 2) values_group<T, 2>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else values_group<T, 1>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            j += g;
        }
    }
}

void attn_values_avx512(const float* p, int64_t ldp, int nq, const float* v, int64_t stride, int n, int hd,
                        float* out, int64_t ldo) {
    attn_values_t(p, ldp, nq, v, stride, n, hd, out, ldo);
}
void attn_values_h_avx512(const float* p, int64_t ldp, int nq, const uint16_t* v, int64_t stride, int n, int hd,
                          float* out, int64_t ldo) {
    attn_values_t(p, ldp, nq, v, stride, n, hd, out, ldo);
}

// ---- the q8_0 cache (kernels.h: key_q8_index, value_q8_index) ------------------------------
// Prefetch distances: 8 key tiles (the fp16 cache's kTilesAhead in bytes) and 32 value quads
// (128 positions). At 8k positions both 4 / 16 and 16 / 64 were slower (A/B in commit c5be4b9).
constexpr int kTilesAheadQ8 = 8, kQuadsAhead = 32;
// Scores of G quantized queries (qq: (G, hd / 4) dwords of 4 int8 channels; corr: 128 x their
// sums; qc: dq x scale) against R key tiles: one vpdpbusd per (query, tile, channel quad), the
// tile's 64 bytes loaded once for all queries and the query's dword broadcast from memory.
template <int G, int R>
inline void score_tiles_q8(const int32_t* qq, const int32_t* corr, const float* qc, int hd, const uint8_t* k,
                           int64_t tstride, float* out, int64_t ldo, int i0, int n, const float* ks) {
    __m512i a[G][R];
#pragma GCC unroll 24
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) a[g][r] = _mm512_setzero_si512();
    const char* ahead = reinterpret_cast<const char*>(k + kTilesAheadQ8 * tstride);
    const int quads = hd / 4;
#pragma GCC unroll 2
    for (int c = 0; c < quads; ++c) {
        for (int r = 0; r < R; ++r) _mm_prefetch(ahead + r * tstride + c * 64, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512i kv = _mm512_loadu_si512(k + r * tstride + c * 64);
#pragma GCC unroll 24
            for (int g = 0; g < G; ++g) a[g][r] = _mm512_dpbusd_epi32(a[g][r], kv, _mm512_set1_epi32(qq[g * quads + c]));
        }
    }
    for (int r = 0; r < R; ++r) {
        const int i = i0 + r * kKeyTile;
        if (i >= n) break;
        const __mmask16 m = tail_mask(n - i);
        const __m512 kd = _mm512_maskz_loadu_ps(m, ks + i);
#pragma GCC unroll 24
        for (int g = 0; g < G; ++g) {
            const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[g][r], _mm512_set1_epi32(corr[g])));
            _mm512_mask_storeu_ps(out + g * ldo + i, m, _mm512_mul_ps(_mm512_mul_ps(s, kd), _mm512_set1_ps(qc[g])));
        }
    }
}

// quantize_s8 (kernels.h) with the same arithmetic, so the same bits: the scalar one costs
// more than the scores of a 256-position split when run per split for 3 queries.
inline float quantize_s8_avx512(const float* x, int n, int8_t* q, int32_t* sum) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(n - i), x + i)));
    const float mx = _mm512_reduce_max_ps(amax);
    const float d = mx >= 1e-30f ? mx / 127.0f : 0.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m512i s = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), id));  // nearest even
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        s = _mm512_add_epi32(s, v);
        _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(v));
    }
    *sum = _mm512_reduce_add_epi32(s);
    return d;
}

template <int G, int R>
void score_run_q8(const int32_t* qq, const int32_t* corr, const float* qc, int hd, const uint8_t* k,
                  int64_t tstride, float* out, int64_t ldo, int t, int left, int n, const float* ks) {
    for (; left >= R; t += R, left -= R)
        score_tiles_q8<G, R>(qq, corr, qc, hd, k + t * tstride, tstride, out, ldo, t * kKeyTile, n, ks);
    if constexpr (R > 1)
        if (left > 0) score_run_q8<G, R / 2>(qq, corr, qc, hd, k, tstride, out, ldo, t, left, n, ks);
}

void attn_scores_q8_avx512(const float* q, int nq, const uint8_t* k, const float* ks, int64_t tstride, int n,
                           int hd, float scale, float* out, int64_t ldo) {
    // The float kernel's passes and query groups (attn_scores_t), over quantized queries.
    constexpr int kPass = 8;
    auto group_of = [nq](int j) {
        const int left = nq - j;
        return left >= 24 ? 24 : left >= 12 ? 12 : left >= 6 ? 6 : left >= 3 ? 3 : left;
    };
    const int quads = hd / 4;
    thread_local Scratch scratch;
    int32_t* qq = scratch.get<int32_t>(size_t(nq) * (quads + 2));  // then corr (nq), then qc (nq)
    int32_t* corr = qq + size_t(nq) * quads;
    float* qc = reinterpret_cast<float*>(corr + nq);
    for (int j = 0; j < nq; ++j) {
        int32_t sum;
        qc[j] = quantize_s8_avx512(q + j * hd, hd, reinterpret_cast<int8_t*>(qq + size_t(j) * quads), &sum) * scale;
        corr[j] = 128 * sum;
    }
    const int tiles = (n + kKeyTile - 1) / kKeyTile;
    for (int t0 = 0; t0 < tiles; t0 += kPass) {
        const int cnt = imin(kPass, tiles - t0);
        for (int j = 0; j < nq;) {
            const int g = group_of(j);
            const int32_t *qj = qq + size_t(j) * quads, *cj = corr + j;
            const float* sj = qc + j;
            float* oj = out + j * ldo;
            if (g == 24) score_run_q8<24, 1>(qj, cj, sj, hd, k, tstride, oj, ldo, t0, cnt, n, ks);
            else if (g == 12) score_run_q8<12, 1>(qj, cj, sj, hd, k, tstride, oj, ldo, t0, cnt, n, ks);
            else if (g == 6) score_run_q8<6, 3>(qj, cj, sj, hd, k, tstride, oj, ldo, t0, cnt, n, ks);
            else if (g == 3) score_run_q8<3, 8>(qj, cj, sj, hd, k, tstride, oj, ldo, t0, cnt, n, ks);
            else if (g == 2) score_run_q8<2, 8>(qj, cj, sj, hd, k, tstride, oj, ldo, t0, cnt, n, ks);
            else score_run_q8<1, 8>(qj, cj, sj, hd, k, tstride, oj, ldo, t0, cnt, n, ks);
            j += g;
        }
    }
}

// One block of up to 32 positions for G queries: the weights p x vs quantized to u8 per query,
// then per quad of positions one vpdpbusd per (query, 16 output channels); the integer sums are
// scaled into out once per block.
// kFull: a whole block (n = 32) of a 64-channel head, the common case, with the shape fixed at
// compile time so GCC unrolls the quads and keeps the 16 accumulators in registers (with run-time
// bounds it copied them between registers around every vpdpbusd; the timings: commit ae64352).
template <int G, bool kFull>
void values_block_q8(const float* p, int64_t ldp, const int8_t* v, const float* vs, int64_t qstride, int n_, int hd_,
                     float* out, int64_t ldo) {
    const int n = kFull ? 32 : n_, hd = kFull ? 64 : hd_;
    alignas(64) uint8_t u[G][32];
    float d[G];
    const __mmask16 m0 = tail_mask(n), m1 = tail_mask(n - 16);
    const __m512 s0 = _mm512_maskz_loadu_ps(m0, vs), s1 = _mm512_maskz_loadu_ps(m1, vs + 16);
    for (int g = 0; g < G; ++g) {
        const __m512 w0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, p + g * ldp), s0);
        const __m512 w1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, p + g * ldp + 16), s1);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(w0, w1));
        d[g] = mx / 255.0f;
        const __m512 id = _mm512_set1_ps(d[g] != 0.0f ? 1.0f / d[g] : 0.0f);
        const __m512i c255 = _mm512_set1_epi32(255);
        _mm_store_si128((__m128i*)u[g], _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(w0, id)), c255)));
        _mm_store_si128((__m128i*)(u[g] + 16), _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(w1, id)), c255)));
    }
    const int quads = (n + 3) / 4;
    for (int d0 = 0; d0 < hd; d0 += 64) {  // up to 64 output channels (4 zmm of lanes) at a time
        const int w = hd - d0 < 64 ? hd - d0 : 64;
        __m512i acc[G][4];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int qd = 0; qd < quads; ++qd) {
            const int8_t* vq = v + qd * qstride + d0 * 4;
            if (d0 == 0) prefetch_bytes(vq + kQuadsAhead * qstride, size_t(hd) * 4);
            __m512i pb[G];
#pragma GCC unroll 4
            for (int g = 0; g < G; ++g) {
                int32_t four;  // the query's weights of the quad's 4 positions
                std::memcpy(&four, u[g] + 4 * qd, 4);
                pb[g] = _mm512_set1_epi32(four);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                if (16 * j >= w) break;
                const __m512i vv = _mm512_maskz_loadu_epi32(tail_mask(w - 16 * j), vq + 64 * j);
#pragma GCC unroll 4
                for (int g = 0; g < G; ++g) acc[g][j] = _mm512_dpbusd_epi32(acc[g][j], pb[g], vv);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
            const __m512 dg = _mm512_set1_ps(d[g]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                if (16 * j >= w) break;
                const __mmask16 m = tail_mask(w - 16 * j);
                float* o = out + g * ldo + d0 + 16 * j;
                // a separate multiply and add, as the spec says: the explicitly rounded add
                // keeps GCC from contracting the two into an FMA (the bits must equal ref's)
                constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                const __m512 x = _mm512_mul_round_ps(_mm512_cvtepi32_ps(acc[g][j]), dg, kRound);
                _mm512_mask_storeu_ps(o, m, _mm512_add_round_ps(_mm512_maskz_loadu_ps(m, o), x, kRound));
            }
        }
    }
}

void attn_values_q8_avx512(const float* p, int64_t ldp, int nq, const int8_t* v, const float* vs, int64_t qstride,
                           int n, int hd, float* out, int64_t ldo) {
    // Blocks of 32 positions (8 quads: 32 x hd bytes stay in L1 while every group uses them),
    // queries in groups of up to 4 (16 accumulators, 4 broadcasts and a value vector in registers).
    for (int b = 0; b < n; b += 32) {
        const int cnt = imin(32, n - b);
        const bool full = cnt == 32 && hd == 64;
        const int8_t* vb = v + (b / 4) * qstride;
        for (int j = 0; j < nq;) {
            const int g = imin(4, nq - j);
            const float* pj = p + j * ldp + b;
            float* oj = out + j * ldo;
            if (g == 4 && full) values_block_q8<4, true>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 4) values_block_q8<4, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 3 && full) values_block_q8<3, true>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 3) values_block_q8<3, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 2) values_block_q8<2, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else values_block_q8<1, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            j += g;
        }
    }
}

void to_f16_avx512(const float* x, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(out + i, m, h);
    }
}

void quantize_act_avx512(const float* x, int n, int64_t cols, int64_t ld, int8_t* q, float* d, int32_t* c, float* ds) {
    const int64_t nb = cols / QK;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    for (int t = 0; t < n; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * QK;
            const int64_t i = b * ld + t;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            const __m512 vid = _mm512_set1_ps(id);
            // round to nearest even (the default MXCSR mode), as nearbyint in the reference
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
            q0 = _mm512_max_epi32(_mm512_min_epi32(q0, hi), lo);
            q1 = _mm512_max_epi32(_mm512_min_epi32(q1, hi), lo);
            _mm_storeu_si128((__m128i*)(q + i * QK), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i*)(q + i * QK + 16), _mm512_cvtepi32_epi8(q1));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            d[i] = db;
            c[i] = -128 * sum;
            ds[i] = db * float(sum);
        }
}

// 4 activation bytes broadcast to every lane, read through a type that may alias int8 data (GCC
// emits a vpbroadcastd from memory: a load-port uop, no vector ALU slot).
typedef int32_t i32_alias __attribute__((may_alias, aligned(1)));
inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const i32_alias*>(p)); }

// G groups of 16 rows against NT tokens: lane r of accumulator [h][t] is row (g+h)*16+r of
// token t0+t. Per block and step j (4 of the block's 32 columns) each vpdpbusd multiplies 4
// consecutive weights of 16 rows by the same 4 broadcast activation bytes; one broadcast feeds
// the G groups (prefill runs G = 2 x NT = 6: a broadcast per vpdpbusd bound the tile well below
// the VNNI peak, two per broadcast made Q8_0 prefill faster, commit 2c3f59a). The tile's tokens
// sit side by side in QuantAct's block-major layout, so every operand is a constant offset from
// one pointer per array (per-token pointers cost ~30 scalar instructions per token and block). The
// integer correction (Q8_0, MXFP4: -128 sum q) starts the accumulator; tiles of 4 or more tokens run one
// vpdpbusd chain per token (the tokens' chains overlap), smaller ones two. The per-token
// arithmetic is the same for every G and NT, so a batch gives the bits of the tokens one by one.
// Blocks [b0, b1) only (a column span, see matmul_int8_typed): unless b0 == 0 the sums start
// from part, and unless b1 is the last block they go back there instead of to y: part holds
// group g + h's token t at (h * np + t) * 16. Stored and reloaded, the float sums are the same,
// in the same order.
template <int TYPE, int G, int NT>
void group_tile(const PackedWeights& w, int64_t g, const QuantAct& x, int t0, float* y, int64_t ldy,
                __mmask16 last_rows, int64_t b0, int64_t b1, float* part, int64_t np) {
    constexpr int CH = NT >= 4 ? 1 : 2;
    __m512 f[G][NT];
    for (int h = 0; h < G; ++h)
        for (int t = 0; t < NT; ++t)
            f[h][t] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + (h * np + t0 + t) * 16);
    const __m512i m0f = _mm512_set1_epi8(15);
    // MXFP4: an e2m1 code -> twice its value plus 128, unsigned (vpdpbusd's unsigned operand), per
    // 128-bit lane for vpshufb. The 128 comes back out through the -128 sum q start of the
    // accumulator, QuantAct's c as stored, so like Q8_0 the start is a broadcast from memory (a
    // load, where an offset of 12 needed c / 32 * 3 in scalar code and a broadcast from a register,
    // one vector ALU uop per token and group of every block). vpdpbusd does not saturate: 4 x 140
    // x 127 fits an int32 lane with room to spare.
    const __m512i e2m1 = _mm512_broadcast_i32x4(
        _mm_setr_epi8(char(128), char(129), char(130), char(131), char(132), char(134), char(136), char(140),
                      char(128), 127, 126, 125, 124, 122, 120, 116));
    const int8_t* xq = x.q + (b0 * x.ld + t0) * QK;
    const float* xd = x.d + b0 * x.ld + t0;
    const int32_t* xc = x.c + b0 * x.ld + t0;
    const float* xds = x.ds + b0 * x.ld + t0;
    const int64_t qstep = x.ld * QK, gstep = w.blocks * w.block_bytes, sstep = w.blocks * w.scale_bytes;
    const int pf = prefetch_blocks(TYPE, np, G);
    const bool l1 = amd_q4_decode(TYPE, np);
    // Near the span's end the prefetches fetch the start of the next pass's span instead: the
    // group G further on, the same columns (see kDecodePrefetchBlocks on what it gains)
    const int64_t wrap = G * gstep - (b1 - b0) * int64_t(w.block_bytes);
    const int64_t swrap = G * sstep - (b1 - b0) * int64_t(w.scale_bytes);
    for (int64_t b = b0; b < b1; ++b, xq += qstep, xd += x.ld, xc += x.ld, xds += x.ld) {
        const uint8_t* blk = w.at(g, b);
        const uint8_t* sc = w.scale_at(g, b);
        if (t0 == 0 && pf) {  // the first token tile streams the weights (see kPrefetchBlocks); later ones find them in L1
            const bool tail = b + pf >= b1;
            const int64_t over = tail ? wrap : 0, sover = tail ? swrap : 0;
            for (int h = 0; h < G; ++h) {
                const char* ahead = (const char*)blk + h * gstep + pf * w.block_bytes + over;
                for (size_t o = 0; o < w.block_bytes; o += 64)
                    if (l1) _mm_prefetch(ahead + o, _MM_HINT_T0);
                    else _mm_prefetch(ahead + o, _MM_HINT_T1);
                _mm_prefetch((const char*)sc + h * sstep + pf * w.scale_bytes + sover, _MM_HINT_T1);
            }
        }
        // j outer, tokens inner: consecutive vpdpbusd belong to different tokens' chains, so the
        // 5-cycle latency is hidden in program order, and only step j's weights (loaded, or
        // unpacked from the Q4 nibbles, once per step) occupy registers
        __m512i acc[CH][G][NT];
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t)
            for (int h = 0; h < G; ++h) {
                acc[0][h][t] = TYPE == GGML_Q8_0 || TYPE == kTypeMXFP4 ? _mm512_set1_epi32(xc[t])  // -128 sum q
                               : TYPE == GGML_Q4_0 ? _mm512_srai_epi32(_mm512_set1_epi32(xc[t]), 4)       // -8 sum q
                                                   : _mm512_setzero_si512();
                if constexpr (CH == 2) acc[1][h][t] = _mm512_setzero_si512();
            }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m512i p[G];
            int o;
            for (int h = 0; h < G; ++h) {
                const uint8_t* pay = blk + h * gstep;
                if constexpr (TYPE == GGML_Q8_0) {
                    p[h] = _mm512_load_si512((const void*)(pay + 64 * j));  // elements 4j..4j+3
                    o = 4 * j;
                } else {
                    const __m512i raw = _mm512_load_si512((const void*)(pay + 64 * (j % 4)));
                    p[h] = j < 4 ? _mm512_and_si512(raw, m0f)                          // elements 4j..4j+3
                                 : _mm512_and_si512(_mm512_srli_epi16(raw, 4), m0f);   // 16+4(j-4)..
                    if constexpr (TYPE == kTypeMXFP4) p[h] = _mm512_shuffle_epi8(e2m1, p[h]);
                    o = j < 4 ? 4 * j : 16 + 4 * (j - 4);
                }
            }
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                const __m512i xb = bcast4(xq + t * QK + o);  // one broadcast feeds G groups
                for (int h = 0; h < G; ++h) acc[j % CH][h][t] = _mm512_dpbusd_epi32(acc[j % CH][h][t], p[h], xb);
            }
        }
        for (int h = 0; h < G; ++h) {
            __m512 wd;
            if constexpr (TYPE == kTypeMXFP4) {  // E8M0 bytes: (s - 1) << 23 = 2^(s - 128), half the scale
                const __m128i s8 = _mm_subs_epu8(_mm_loadu_si128((const __m128i*)(sc + h * sstep)), _mm_set1_epi8(1));
                wd = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(s8), 23));
            } else {
                wd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(sc + h * sstep)));
            }
            __m512 wm = _mm512_setzero_ps();
            if constexpr (TYPE == GGML_Q4_1) wm = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(sc + h * sstep + 32)));
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                __m512i sum = acc[0][h][t];
                if constexpr (CH == 2) sum = _mm512_add_epi32(acc[0][h][t], acc[1][h][t]);
                f[h][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(wd, _mm512_set1_ps(xd[t])), f[h][t]);
                if constexpr (TYPE == GGML_Q4_1) f[h][t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xds[t]), f[h][t]);
            }
        }
    }
    for (int h = 0; h < G; ++h)
        for (int t = 0; t < NT; ++t)
            if (b1 == w.blocks)
                _mm512_mask_storeu_ps(y + (t0 + t) * ldy + (g + h) * 16, h == G - 1 ? last_rows : __mmask16(0xFFFF), f[h][t]);
            else
                _mm512_store_ps(part + (h * np + t0 + t) * 16, f[h][t]);
}

constexpr int kTileTokens = 6, kTileGroups = 2;  // the prefill tile (swept: 1x8..14, 2x4..6)

template <int TYPE, int G>
void group_tiles(const PackedWeights& w, int64_t g, const QuantAct& x, int n, float* y, int64_t ldy, __mmask16 rows,
                 int64_t b0, int64_t b1, float* part) {
    int t0 = 0;
    for (; t0 + kTileTokens <= n; t0 += kTileTokens)
        group_tile<TYPE, G, kTileTokens>(w, g, x, t0, y, ldy, rows, b0, b1, part, n);
    for (; t0 + 4 <= n; t0 += 4) group_tile<TYPE, G, 4>(w, g, x, t0, y, ldy, rows, b0, b1, part, n);
    switch (n - t0) {
        case 3: group_tile<TYPE, G, 3>(w, g, x, t0, y, ldy, rows, b0, b1, part, n); break;
        case 2: group_tile<TYPE, G, 2>(w, g, x, t0, y, ldy, rows, b0, b1, part, n); break;
        case 1: group_tile<TYPE, G, 1>(w, g, x, t0, y, ldy, rows, b0, b1, part, n); break;
    }
}

// Batches of 7 to kOnePassTokens tokens, one group at a time with all the tokens in one tile (up
// to 16 tokens x 2 accumulators: some spill at 16, still faster). As pairs of groups they ran as
// tiles of 6 and a rest: the first tile waited on memory (it alone streamed the weights, at
// ~12 GB/s with its arithmetic, where the bound is 16.9), the later ones found the weights in
// cache and left the memory idle. Standalone, MXFP4 2048 x 4096 experts walked from DRAM on
// the Xeon, medians of 5 alternations, GOP/s: 10 tokens 309 -> 353, 12 326-343 -> 384-404,
// 14 341 -> 435, 16 346-364 -> 436-472; Q4_0 at 12 tokens 350 -> 396, Q8_0 239 -> 244. Fewer
// tokens were already one tile; at 17-32 tokens, two such passes were no faster than the tiles.
template <int TYPE>
void group_tiles_one_pass(const PackedWeights& w, int64_t g, const QuantAct& x, int n, float* y, int64_t ldy,
                          __mmask16 rows, int64_t b0, int64_t b1, float* part) {
    switch (n) {
#define ZEN5_ONE_PASS(N) \
    case N: return group_tile<TYPE, 1, N>(w, g, x, 0, y, ldy, rows, b0, b1, part, n);
        ZEN5_ONE_PASS(7) ZEN5_ONE_PASS(8) ZEN5_ONE_PASS(9) ZEN5_ONE_PASS(10) ZEN5_ONE_PASS(11)
        ZEN5_ONE_PASS(12) ZEN5_ONE_PASS(13) ZEN5_ONE_PASS(14) ZEN5_ONE_PASS(15) ZEN5_ONE_PASS(16)
#undef ZEN5_ONE_PASS
    }
}
static_assert(kOnePassTokens == 16, "group_tiles_one_pass has a case for each size up to kOnePassTokens");

template <int TYPE>
void matmul_int8_typed(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n,
                       float* y, int64_t ldy) {
    const int64_t g_begin = r0 / 16, g_end = (r1 + 15) / 16;
    const int64_t left = r1 - (g_end - 1) * 16;
    const __mmask16 last = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    // spans of columns over blocks of kSpanRows rows (kernels.h: int8_span_blocks)
    const int64_t span = int8_span_blocks(w.blocks, n), rg = span == w.blocks ? g_end - g_begin : kSpanRows / 16;
    thread_local Scratch scratch;
    float* part = span == w.blocks ? nullptr : scratch.get<float>(size_t(rg) * n * 16);
    const bool one_pass = n > kTileTokens && n <= kOnePassTokens;
    for (int64_t gb = g_begin; gb < g_end; gb += rg) {
        const int64_t ge = gb + rg < g_end ? gb + rg : g_end;
        const __mmask16 ge_last = ge == g_end ? last : __mmask16(0xFFFF);
        for (int64_t b0 = 0; b0 < w.blocks; b0 += span) {
            const int64_t b1 = b0 + span < w.blocks ? b0 + span : w.blocks;
            int64_t g = gb;
            float* pg = part;
            // pairs of groups (prefill: each broadcast feeds two; decode: two weight streams in
            // flight, see decode_in_pairs), except for the batches that run one group at a time
            // in one pass
            if (!one_pass && (n > 1 || decode_in_pairs(TYPE, w.blocks)))
                for (; g + kTileGroups <= ge; g += kTileGroups, pg += kTileGroups * n * 16)
                    group_tiles<TYPE, kTileGroups>(w, g, x, n, y, ldy,
                                                   g + kTileGroups == ge ? ge_last : __mmask16(0xFFFF), b0, b1, pg);
            for (; g < ge; ++g, pg += n * 16) {
                const __mmask16 rows = g + 1 == ge ? ge_last : __mmask16(0xFFFF);
                if (one_pass) group_tiles_one_pass<TYPE>(w, g, x, n, y, ldy, rows, b0, b1, pg);
                else group_tiles<TYPE, 1>(w, g, x, n, y, ldy, rows, b0, b1, pg);
            }
        }
    }
}

void matmul_int8_avx512(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n,
                        float* y, int64_t ldy) {
    switch (w.type) {
        case GGML_Q4_0: return matmul_int8_typed<GGML_Q4_0>(w, r0, r1, x, n, y, ldy);
        case GGML_Q4_1: return matmul_int8_typed<GGML_Q4_1>(w, r0, r1, x, n, y, ldy);
        case GGML_Q8_0: return matmul_int8_typed<GGML_Q8_0>(w, r0, r1, x, n, y, ldy);
        case kTypeMXFP4: return matmul_int8_typed<kTypeMXFP4>(w, r0, r1, x, n, y, ldy);
    }
}

}  // namespace

const Kernels* kernels_avx512() {
    static const Kernels k{"avx512", matmul_avx512, dequant_row_avx512, dot_avx512, axpy_avx512,
                           add_avx512, rmsnorm_avx512, swiglu_avx512, attn_scores_avx512,
                           quantize_act_avx512, matmul_int8_avx512, attn_scores_h_avx512,
                           attn_values_h_avx512, to_f16_avx512, softmax_partial_avx512, attn_values_avx512,
                           attn_scores_q8_avx512, attn_values_q8_avx512};
    return &k;
}

}  // namespace zen5
