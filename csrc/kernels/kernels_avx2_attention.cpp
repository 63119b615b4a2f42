// AVX2 attention kernels (kernels_avx2.h): the AVX-512 tier's designs (kernels_avx512.cpp) on
// 8-lane ymm registers, 16 of them. Same contracts (kernels.h), and the same bits:
//  - scores: a key tile (16 positions) is two ymm; each score is one FMA chain over the channels
//    in order from 0, then times the scale, exactly as the AVX-512 kernel, so the two tiers agree
//    bit for bit whatever the query grouping;
//  - values: one FMA chain per output value in position order, starting from `out`;
//  - softmax: the AVX-512 exp2 polynomial, 2^k applied as two exact power-of-two multiplies
//    (equal to scalef, denormals and the -inf -> 0 clamp included);
//  - q8_0: the reference's integer sums and float steps (without VNNI through the sign trick for
//    the keys and int16 vpmaddwd for the values, which never saturate).
// Query groups are smaller than AVX-512's 24 so that accumulators, the row being used and a
// broadcast fit the 16 registers (objdump shows no spills in the hot loops).
//
// No standard-library templates in this file (kernels_avx2.h): scratch space is on the stack.
#include "kernels_avx2.h"

#include <cmath>
#include <cstring>

#include "tier_scratch.h"

namespace zen5 {
namespace ZEN5_TIER {
namespace {

// Hides a pointer's value from GCC's value numbering: loads through the returned copy are not
// merged with the same loads earlier in the loop. Used where GCC would otherwise keep G query
// broadcasts live across a loop over rows and run out of registers (no instruction is emitted).
template <typename P>
static inline P fresh(P p) {
    asm volatile("" : "+r"(p));
    return p;
}

// The AVX-512 tier's prefetch distances (its comments give the measurements).
constexpr int kRowsAhead = 32, kTilesAhead = 4, kTilesAheadQ8 = 8, kQuadsAhead = 32;

// 8 floats from fp32 or fp16
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
// the first `left` of them (all when left >= 8), the other lanes zero; reads nothing past them
static inline __m256 load8_part(const float* p, int left) { return _mm256_maskload_ps(p, tail_mask8(left)); }
static inline __m256 load8_part(const uint16_t* p, int left) {
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, size_t(left < 8 ? left : 8) * 2);
    return _mm256_cvtph_ps(_mm_load_si128((const __m128i*)t));
}
// stores the first `left` lanes (all when left >= 8)
static inline void store8_part(float* p, __m256 x, int left) {
    if (left >= 8) _mm256_storeu_ps(p, x);
    else _mm256_maskstore_ps(p, tail_mask8(left), x);
}

// ---- scores over fp32 / fp16 key tiles ---------------------------------------------------------
// Scores of G queries (query g's channel d at q[g * qs + d]; qs = QS, or hd when QS is 0) against
// the 16 x R positions of R consecutive key tiles: G x 2R accumulators, one chain over the
// channels each. Per channel and tile the two rows are loaded (fp16: widened) once for the G
// queries; the query value is a broadcast from memory per (tile, query), so the registers hold
// 2GR accumulators + 2 rows + 1 broadcast: G x R <= 6.
template <typename T, int G, int R, int QS>
static inline __attribute__((always_inline)) void score_tiles(const float* q, int hd_, const T* k, int64_t tstride,
                                                              float scale, float* out, int64_t ldo, int i0, int n) {
    const int hd = QS == 64 ? 64 : hd_;  // QS 64: the head size 64, queries as given
    const int64_t qs = QS ? QS : hd;
    __m256 a[G][2 * R];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
        for (int r = 0; r < 2 * R; ++r) a[g][r] = _mm256_setzero_ps();
    // the tiles kTilesAhead further, a line at a time as the channels advance
    const char* ahead = reinterpret_cast<const char*>(k + kTilesAhead * tstride);
    constexpr int kStep = 64 / int(kKeyTile * sizeof(T));  // channels per 64-byte line of a tile
#pragma GCC unroll 2
    for (int d = 0; d < hd; ++d) {
        if (d % kStep == 0)
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (r * tstride + int64_t(d) * kKeyTile) * sizeof(T), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const T* kr = k + r * tstride + int64_t(d) * kKeyTile;
            const __m256 k0 = load8(kr), k1 = load8(kr + 8);
            // a fresh query pointer per tile: the broadcasts are reloaded, not kept live
            const float* qd = (G > 1 && R > 1 ? fresh(q) : q) + d;
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) {
                const __m256 b = _mm256_broadcast_ss(qd + g * qs);
                a[g][2 * r] = _mm256_fmadd_ps(b, k0, a[g][2 * r]);
                a[g][2 * r + 1] = _mm256_fmadd_ps(b, k1, a[g][2 * r + 1]);
            }
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 8  // constant indices: the accumulators stay registers
    for (int r = 0; r < R; ++r) {
        const int i = i0 + r * kKeyTile;
        if (i >= n) break;
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) {
            store8_part(out + g * ldo + i, _mm256_mul_ps(a[g][2 * r], s), n - i);
            if (n - i > 8) store8_part(out + g * ldo + i + 8, _mm256_mul_ps(a[g][2 * r + 1], s), n - i - 8);
        }
    }
}

// `left` tiles from tile t for G queries: R at a time, then the rest with smaller R.
template <typename T, int G, int R, int QS>
static void score_run(const float* q, int hd, const T* k, int64_t tstride, float scale, float* out, int64_t ldo,
                      int t, int left, int n) {
    for (; left >= R; t += R, left -= R)
        score_tiles<T, G, R, QS>(q, hd, k + t * tstride, tstride, scale, out, ldo, t * kKeyTile, n);
    if constexpr (R > 1)
        if (left > 0) score_run<T, G, R / 2, QS>(q, hd, k, tstride, scale, out, ldo, t, left, n);
}

// queries per group: 6 (one tile at a time), 3 or 2 (two tiles), 1 (four tiles)
static inline int score_group_of(int left) { return left >= 6 ? 6 : left >= 3 ? 3 : left; }

template <typename T, int QS>
static void score_group(int g, const float* q, int hd, const T* k, int64_t tstride, float scale, float* out,
                        int64_t ldo, int t0, int cnt, int n) {
    if (g == 6) score_run<T, 6, 1, QS>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else if (g == 3) score_run<T, 3, 2, QS>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else if (g == 2) score_run<T, 2, 2, QS>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
    else score_run<T, 1, 4, QS>(q, hd, k, tstride, scale, out, ldo, t0, cnt, n);
}

template <typename T>
static void attn_scores_t(const float* q, int nq, const T* k, int64_t tstride, int n, int hd, float scale, float* out,
                          int64_t ldo) {
    // Passes of 8 tiles, queries inner: a pass's tiles stay in L1 while every query uses them.
    // Only the grouping depends on nq; each score's arithmetic does not. The queries are read in
    // place (a head size of 64 as a constant: the broadcasts are constant offsets of one pointer).
    constexpr int kPass = 8;
    const int tiles = (n + kKeyTile - 1) / kKeyTile;
    for (int t0 = 0; t0 < tiles; t0 += kPass) {
        const int cnt = imin(kPass, tiles - t0);
        for (int j = 0; j < nq;) {
            const int g = score_group_of(nq - j);
            const float* qj = q + int64_t(j) * hd;
            float* oj = out + j * ldo;
            if (hd == 64) score_group<T, 64>(g, qj, hd, k, tstride, scale, oj, ldo, t0, cnt, n);
            else score_group<T, 0>(g, qj, hd, k, tstride, scale, oj, ldo, t0, cnt, n);
            j += g;
        }
    }
}

// ---- values over fp32 / fp16 rows --------------------------------------------------------------
// out[g][0:w] += sum_i p[g][i] v[i][0:w] for G queries, w <= 8 x NV output channels (v and out
// at the chunk's first channel): each value row piece is loaded (widened) once for the G queries;
// one chain per output value in position order. Each weight is broadcast once per row; kReload:
// the row's vectors are then used one at a time (registers: G x NV accumulators + G + 1: 16 for
// decode's 3 x 4, no spills in objdump); otherwise the NV vectors stay in registers (G x NV +
// NV + 1). Broadcasting the G weights again for each vector instead (two registers fewer) ran
// the 3 x 4 fp16 chunk at 68 GFLOP/s from L2 against 91 on the Zen 3 (a standalone copy). kMask:
// w may be below 8 x NV (masked lanes, zero vectors past w); otherwise w = 8 x NV. PF: bytes of
// each row to prefetch 2 x kRowsAhead rows ahead (the whole row, from the first chunk), or 0.
template <typename T, int G, int NV, bool kReload, bool kMask>
static void values_chunk(const float* p, int64_t ldp, const T* v, int64_t stride, int n, int w_, float* out,
                         int64_t ldo, int pf) {
    const int w = kMask ? w_ : 8 * NV;
    __m256 acc[G][NV];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j)
            acc[g][j] = !kMask ? _mm256_loadu_ps(out + g * ldo + 8 * j)
                        : 8 * j < w ? load8_part(out + g * ldo + 8 * j, w - 8 * j) : _mm256_setzero_ps();
    for (int i = 0; i < n; ++i) {
        const T* vi = v + i * stride;
        if (pf == 64 * int(sizeof(T)))  // a 64-channel head: the line count fixed
#pragma GCC unroll 2
            for (int o = 0; o < 64 * int(sizeof(T)); o += 64)
                _mm_prefetch((const char*)(vi + 2 * kRowsAhead * stride) + o, _MM_HINT_T1);
        else if (pf) prefetch_bytes(vi + 2 * kRowsAhead * stride, size_t(pf));
        if constexpr (kReload) {
            __m256 b[G];
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) b[g] = _mm256_broadcast_ss(p + g * ldp + i);
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) {
                if (kMask && 8 * j >= w) break;
                const __m256 vv = !kMask ? load8(vi + 8 * j) : load8_part(vi + 8 * j, w - 8 * j);
#pragma GCC unroll 16
                for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(b[g], vv, acc[g][j]);
            }
        } else {
            __m256 vv[NV];
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j)
                vv[j] = !kMask ? load8(vi + 8 * j) : 8 * j < w ? load8_part(vi + 8 * j, w - 8 * j) : _mm256_setzero_ps();
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) {
                const __m256 b = _mm256_broadcast_ss(p + g * ldp + i);
#pragma GCC unroll 8
                for (int j = 0; j < NV; ++j) acc[g][j] = _mm256_fmadd_ps(b, vv[j], acc[g][j]);
            }
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) {
            if (!kMask) _mm256_storeu_ps(out + g * ldo + 8 * j, acc[g][j]);
            else if (8 * j < w) store8_part(out + g * ldo + 8 * j, acc[g][j], w - 8 * j);
        }
}

// A last chunk of w channels, w a multiple of 8 below 8 x NV: the same chunk kernel with fewer
// vectors and no masks (head sizes such as 80 = 2 x 32 + 16).
template <typename T, int G, int NV, bool kReload>
static void values_part(const float* p, int64_t ldp, const T* v, int64_t stride, int n, int w, float* out,
                        int64_t ldo, int pf) {
    if constexpr (NV > 1) {
        if (w < 8 * NV) return values_part<T, G, NV - 1, kReload>(p, ldp, v, stride, n, w, out, ldo, pf);
    }
    values_chunk<T, G, NV, kReload, false>(p, ldp, v, stride, n, w, out, ldo, pf);
}

template <typename T, int G, int NV, bool kReload>
static void values_group(const float* p, int64_t ldp, const T* v, int64_t stride, int n, int hd, float* out,
                         int64_t ldo) {
    constexpr int kW = 8 * NV;
    for (int d0 = 0; d0 < hd; d0 += kW) {
        const int w = hd - d0 < kW ? hd - d0 : kW;
        const int pf = d0 == 0 ? hd * int(sizeof(T)) : 0;
        if (w == kW) values_chunk<T, G, NV, kReload, false>(p, ldp, v + d0, stride, n, w, out + d0, ldo, pf);
        else if (w % 8 == 0) values_part<T, G, NV - 1, kReload>(p, ldp, v + d0, stride, n, w, out + d0, ldo, pf);
        else values_chunk<T, G, NV, kReload, true>(p, ldp, v + d0, stride, n, w, out + d0, ldo, pf);
    }
}

// values_chunk over a panel (below): G queries x the panel's 16 channels, the first w of them
// output channels; no prefetch (the panel is in L1).
template <int G>
static inline void panel_group(const float* p, int64_t ldp, const float* buf, int cnt, float* out, int64_t ldo, int w) {
    if (w == 16) values_chunk<float, G, 2, false, false>(p, ldp, buf, 16, cnt, 16, out, ldo, 0);
    else values_chunk<float, G, 2, false, true>(p, ldp, buf, 16, cnt, w, out, ldo, 0);
}

// Many queries over the same rows (DeepSeek V4's 64 heads share one K = V head; a prefill task's 24
// query vectors per kv head): per block of kPanelRows positions and 16 channels, the rows' pieces
// are first copied (fp16 widened) into a contiguous panel on the stack, which every query group
// then reads in order from L1. Read in place, a group's 16 channels of consecutive positions are a
// cache row apart (2 KB for V4's head of 512), and the sums ran at about half the scores' rate. The
// sums are values_chunk's, so the bits are the same. Zen 3, one thread, fp32 rows unless said: 64
// queries x 640 positions x 512 channels (V4's ratio-4 decode at depth 2048) 54 -> 78 GFLOP/s, 32
// queries 55 -> 72, fp16 71 -> 83; 24 queries of head 64 or 128 (a Llama prefill task) over 128 to
// 512 positions of rows 128 B to 8 KB apart: fp32 +2% to +47%, fp16 -11% to +35% (slower in 1 of 9
// shapes); 16 queries -10% to +27%; at 6 to 12 the copy is not paid back (up to 25% slower), hence
// kPanelQueries.
constexpr int kPanelQueries = 16;
template <typename T>
static void attn_values_panels(const float* p, int64_t ldp, int nq, const T* v, int64_t stride, int n, int hd,
                               float* out, int64_t ldo) {
    constexpr int kPanelRows = 128;
    alignas(32) float buf[kPanelRows * 16];
    for (int i0 = 0; i0 < n; i0 += kPanelRows) {
        const int cnt = imin(kPanelRows, n - i0);
        for (int d0 = 0; d0 < hd; d0 += 16) {
            const int w = imin(16, hd - d0);
            const T* src = v + int64_t(i0) * stride + d0;
            for (int i = 0; i < cnt; ++i, src += stride) {
                _mm256_store_ps(buf + 16 * i, w >= 8 ? load8(src) : load8_part(src, w));
                _mm256_store_ps(buf + 16 * i + 8, w >= 16 ? load8(src + 8) : w > 8 ? load8_part(src + 8, w - 8)
                                                                                   : _mm256_setzero_ps());
            }
            for (int j = 0; j < nq;) {
                const int left = nq - j, g = left >= 6 ? 6 : left >= 3 ? 3 : left;
                const float* pj = p + j * ldp + i0;
                float* oj = out + j * ldo + d0;
                if (g == 6) panel_group<6>(pj, ldp, buf, cnt, oj, ldo, w);
                else if (g == 3) panel_group<3>(pj, ldp, buf, cnt, oj, ldo, w);
                else if (g == 2) panel_group<2>(pj, ldp, buf, cnt, oj, ldo, w);
                else panel_group<1>(pj, ldp, buf, cnt, oj, ldo, w);
                j += g;
            }
        }
    }
}

template <typename T>
static void attn_values_t(const float* p, int64_t ldp, int nq, const T* v, int64_t stride, int n, int hd, float* out,
                          int64_t ldo) {
    if (nq >= kPanelQueries) return attn_values_panels(p, ldp, nq, v, stride, n, hd, out, ldo);
    // Fewer queries read the rows in place. Blocks of 32 rows, query groups inner: a block stays
    // in L1 while every group uses it. The partial sums go through `out` between blocks (exact).
    // Groups: 6 queries x 16 channels, 3 x 32 (decode's GQA group), 2 x 32, 1 x 64: 12, 12, 8
    // and 8 accumulators.
    constexpr int kBlock = 32;
    for (int i0 = 0; i0 < n; i0 += kBlock) {
        const int cnt = imin(kBlock, n - i0);
        const T* vb = v + i0 * stride;
        for (int j = 0; j < nq;) {
            const int left = nq - j, g = left >= 6 ? 6 : left >= 3 ? 3 : left;
            const float* pj = p + j * ldp + i0;
            float* oj = out + j * ldo;
            if (g == 6) values_group<T, 6, 2, false>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 3) values_group<T, 3, 4, true>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else if (g == 2) values_group<T, 2, 4, false>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            else values_group<T, 1, 8, true>(pj, ldp, vb, stride, cnt, hd, oj, ldo);
            j += g;
        }
    }
}

// ---- softmax ------------------------------------------------------------------------------------
// 2^t as the AVX-512 exp2_512: t clamped at -150 (so -inf gives 0), k = round(t), r = t - k, 2^r
// by the same degree-5 polynomial. scalef(p, k) = p x 2^k correctly rounded; without it, 2^k is
// applied as 2^(k1) x 2^(k - k1) with k1 = floor(k / 2), both normal for k in [-150, 0]: the first
// product is exact (p in [0.7, 1.42]), so the second is the one rounding, into the denormals
// where it must, and 2^-150 rounds to exactly 0. (t > 0 does not occur: t = x - max.)
static inline __m256 exp2_256(__m256 t) {
    t = _mm256_max_ps(t, _mm256_set1_ps(-150.0f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(t, k);
    __m256 p = _mm256_set1_ps(1.3218674576e-03f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6717029810e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5508930236e-02f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022237957e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314688444e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ki = _mm256_cvtps_epi32(k);
    const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

// ---- q8_0 scores ------------------------------------------------------------------------------------
// quantize_s8 (kernels_ref.cpp) with the same arithmetic, so the same bytes: x id rounded to
// nearest even (vcvtps2dq; the reference's 1.5 x 2^23 trick on the same rounded product).
static inline float quantize_s8_avx2(const float* x, int n, int8_t* q, int32_t* sum) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 xv = n - i >= 8 ? _mm256_loadu_ps(x + i) : load8_part(x + i, n - i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(xv, absm));
    }
    const float mx = hmax8(amax);
    const float d = mx >= 1e-30f ? mx / 127.0f : 0.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 8) {
        const __m256 xv = n - i >= 8 ? _mm256_loadu_ps(x + i) : load8_part(x + i, n - i);
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(xv, id));
        v = _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        s = _mm256_add_epi32(s, v);
        // 8 int32 -> 8 bytes: packs within each 128-bit lane, then the two lanes' first dwords
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256());
        const int64_t lo = _mm_cvtsi128_si32(_mm256_castsi256_si128(b));
        const int64_t hi = _mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1));
        const uint64_t eight = uint64_t(uint32_t(lo)) | (uint64_t(uint32_t(hi)) << 32);
        std::memcpy(q + i, &eight, size_t(imin(8, n - i)));
    }
    *sum = hsum8i(s);
    return d;
}

// Scores of G quantized queries (qq: (G, quads) dwords of 4 int8 channels; corr: 128 x their
// sums; qc: dq x scale) against R key tiles. A tile's quad of channels is 64 bytes: positions
// 0-7 in the first ymm, 8-15 in the second, 4 channels per lane.
//  VNNI: vpdpbusd on the stored bytes (k + 128), then - 128 sum q, as the AVX-512 tier.
//  Without: the stored bytes flipped back to k (xor 0x80), |k| as the unsigned operand and q
//  with k's sign (vpsignb): a product pair is at most 2 x 128 x 127, exact in int16; the sum is
//  sum(k q) itself, the reference's sum(uk q) - 128 sum q.
template <int G, int R>
static inline __attribute__((always_inline)) void score_tiles_q8(const int32_t* qq, int quads, const int32_t* corr,
                                                                 const float* qc, const uint8_t* k, int64_t tstride,
                                                                 float* out, int64_t ldo, int i0, int n,
                                                                 const float* ks) {
    __m256i a[G][2 * R];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
        for (int r = 0; r < 2 * R; ++r) a[g][r] = _mm256_setzero_si256();
    const char* ahead = reinterpret_cast<const char*>(k + kTilesAheadQ8 * tstride);
#pragma GCC unroll 2
    for (int c = 0; c < quads; ++c) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) _mm_prefetch(ahead + r * tstride + c * 64, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const uint8_t* kr = k + r * tstride + c * 64;
            const __m256i k0 = _mm256_loadu_si256((const __m256i*)kr);
            const __m256i k1 = _mm256_loadu_si256((const __m256i*)(kr + 32));
            const int32_t* qd = (G > 1 && R > 1 ? fresh(qq) : qq) + c;
#ifdef ZEN5_AVXVNNI
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) {
                const __m256i b = _mm256_set1_epi32(qd[g * quads]);
                a[g][2 * r] = _mm256_dpbusd_avx_epi32(a[g][2 * r], k0, b);
                a[g][2 * r + 1] = _mm256_dpbusd_avx_epi32(a[g][2 * r + 1], k1, b);
            }
#else
            const __m256i flip = _mm256_set1_epi8(char(0x80));
            const __m256i s0 = _mm256_xor_si256(k0, flip), s1 = _mm256_xor_si256(k1, flip);
            const __m256i u0 = _mm256_abs_epi8(s0), u1 = _mm256_abs_epi8(s1);
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) {
                const __m256i b = _mm256_set1_epi32(qd[g * quads]);
                a[g][2 * r] = dot4(a[g][2 * r], u0, _mm256_sign_epi8(b, s0));
                a[g][2 * r + 1] = dot4(a[g][2 * r + 1], u1, _mm256_sign_epi8(b, s1));
            }
#endif
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const int i = i0 + r * kKeyTile + 8 * h;
            if (i >= n) break;
            const __m256 kd = n - i >= 8 ? _mm256_loadu_ps(ks + i) : load8_part(ks + i, n - i);
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) {
#ifdef ZEN5_AVXVNNI
                const __m256i isum = _mm256_sub_epi32(a[g][2 * r + h], _mm256_set1_epi32(corr[g]));
#else
                const __m256i isum = a[g][2 * r + h];
#endif
                const __m256 sc = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), kd), _mm256_set1_ps(qc[g]));
                store8_part(out + g * ldo + i, sc, n - i);
            }
        }
    }
}

template <int G, int R>
static void score_run_q8(const int32_t* qq, int quads, const int32_t* corr, const float* qc, const uint8_t* k,
                         int64_t tstride, float* out, int64_t ldo, int t, int left, int n, const float* ks) {
    for (; left >= R; t += R, left -= R)
        score_tiles_q8<G, R>(qq, quads, corr, qc, k + t * tstride, tstride, out, ldo, t * kKeyTile, n, ks);
    if constexpr (R > 1)
        if (left > 0) score_run_q8<G, R / 2>(qq, quads, corr, qc, k, tstride, out, ldo, t, left, n, ks);
}

// At most this many queries are quantized per chunk of the scratch below (a chunk covers every
// key of the call before the next is quantized); hd is at most kMaxQ8Dim per query.
constexpr int kQ8Chunk = 48, kMaxQ8Dim = 512;

// ---- q8_0 values ----------------------------------------------------------------------------------
// One block of up to 32 positions for G queries: the weights p x vs quantized to u8 per query
// (the reference's steps), then per quad of positions and 8 output channels:
//  VNNI: one vpdpbusd per query (the 4 weights broadcast, 32 value bytes), 32 channels at a time;
//  without: the 32 value bytes widened to int16 in two halves (4 channels x 4 positions each)
//  and one vpmaddwd per half and query with the 4 weights as int16: exact (u <= 255, |v| <= 128),
//  unlike vpmaddubsw. Each int32 lane then holds half of a channel's sum (2 positions of the
//  quad); vphaddd joins the halves at the end of the block.
// The integer sums are scaled into out once per block: out + float(isum) x d, a separate
// multiply and add (kept apart from GCC's FMA contraction by an empty asm).
template <int G, bool kFull>
static void values_block_q8(const float* p, int64_t ldp, const int8_t* v, const float* vs, int64_t qstride, int n_,
                            int hd_, float* out, int64_t ldo) {
    const int n = kFull ? 32 : n_, hd = hd_;
#ifdef ZEN5_AVXVNNI
    alignas(32) uint8_t u[G][32];
#else
    alignas(32) int16_t u[G][32];
#endif
    float d[G];
    __m256 s[4];
    for (int j = 0; j < 4; ++j)
        s[j] = n - 8 * j >= 8 ? _mm256_loadu_ps(vs + 8 * j) : n > 8 * j ? load8_part(vs + 8 * j, n - 8 * j)
                                                                        : _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
        __m256 w[4];
        for (int j = 0; j < 4; ++j) {
            const float* pg = p + g * ldp + 8 * j;
            const __m256 pv = n - 8 * j >= 8 ? _mm256_loadu_ps(pg) : n > 8 * j ? load8_part(pg, n - 8 * j)
                                                                               : _mm256_setzero_ps();
            w[j] = _mm256_mul_ps(pv, s[j]);
        }
        // the reference's max starts at 0
        const float mx = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_max_ps(w[0], w[1]), _mm256_max_ps(w[2], w[3])),
                                             _mm256_setzero_ps()));
        d[g] = mx / 255.0f;
        const __m256 id = _mm256_set1_ps(d[g] != 0.0f ? 1.0f / d[g] : 0.0f);
        __m256i ui[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(w[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            ui[j] = _mm256_cvttps_epi32(_mm256_min_ps(r, _mm256_set1_ps(255.0f)));
        }
        // int32 -> int16 in position order (packs works per 128-bit lane: permute the quadwords)
        const __m256i h01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ui[0], ui[1]), 0xD8);
        const __m256i h23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ui[2], ui[3]), 0xD8);
#ifdef ZEN5_AVXVNNI
        _mm256_store_si256((__m256i*)u[g], _mm256_permute4x64_epi64(_mm256_packus_epi16(h01, h23), 0xD8));
#else
        _mm256_store_si256((__m256i*)u[g], h01);
        _mm256_store_si256((__m256i*)(u[g] + 16), h23);
#endif
    }
    const int quads = (n + 3) / 4;
#ifdef ZEN5_AVXVNNI
    constexpr int kW = 32;  // output channels per pass: 4 ymm of int32 sums per query
#else
    constexpr int kW = 8;  // 2 ymm of half sums per query
#endif
    for (int d0 = 0; d0 < hd; d0 += kW) {
        const int w = hd - d0 < kW ? hd - d0 : kW;
        const bool full = kFull || w == kW;
#ifdef ZEN5_AVXVNNI
        __m256i acc[G][4];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int qd = 0; qd < quads; ++qd) {
            const int8_t* vq = v + qd * qstride + d0 * 4;
            if (d0 == 0) prefetch_bytes(vq + kQuadsAhead * qstride, size_t(hd) * 4);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                if (!full && 8 * j >= w) break;
                const __m256i vv = full || w - 8 * j >= 8
                                       ? _mm256_loadu_si256((const __m256i*)(vq + 32 * j))
                                       : _mm256_maskload_epi32((const int*)(vq + 32 * j), tail_mask8(w - 8 * j));
                const uint8_t* uq = (G > 1 ? fresh(&u[0][0]) : &u[0][0]) + 4 * qd;
#pragma GCC unroll 4
                for (int g = 0; g < G; ++g) {
                    int32_t four;
                    std::memcpy(&four, uq + 32 * g, 4);
                    acc[g][j] = _mm256_dpbusd_avx_epi32(acc[g][j], _mm256_set1_epi32(four), vv);
                }
            }
        }
        constexpr int kVecs = 4;
        auto sum_of = [&](int g, int j) { return acc[g][j]; };
#else
        __m256i lo[G], hi[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int qd = 0; qd < quads; ++qd) {
            const int8_t* vq = v + qd * qstride + d0 * 4;
            if (d0 == 0) prefetch_bytes(vq + kQuadsAhead * qstride, size_t(hd) * 4);
            __m256i v0, v1;
            if (full) {
                v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)vq));
                v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(vq + 16)));
            } else {  // a head size that is not a multiple of 8: a channel is a dword, masked
                const __m256i x = _mm256_maskload_epi32((const int*)vq, tail_mask8(w));
                v0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x));
                v1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1));
            }
            // reloaded per chunk, not hoisted out of the chunk loop into spilled registers
            const int16_t* uq = fresh(&u[0][0]) + 4 * qd;
#pragma GCC unroll 4
            for (int g = 0; g < G; ++g) {
                int64_t four;  // the query's 4 weights of the quad, as int16
                std::memcpy(&four, uq + 32 * g, 8);
                const __m256i b = _mm256_set1_epi64x(four);
                lo[g] = _mm256_add_epi32(lo[g], _mm256_madd_epi16(v0, b));
                hi[g] = _mm256_add_epi32(hi[g], _mm256_madd_epi16(v1, b));
                // one running sum each: GCC reassociated the unrolled quads' adds into trees
                // whose partial products outnumbered the registers
                asm("" : "+x"(lo[g]), "+x"(hi[g]));
            }
        }
        constexpr int kVecs = 1;
        // lo: channels 0-3 (two half sums each), hi: 4-7; vphaddd gives 0 1 4 5 | 2 3 6 7
        auto sum_of = [&](int g, int) {
            return _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[g], hi[g]), 0xD8);
        };
#endif
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
            const __m256 dg = _mm256_set1_ps(d[g]);
#pragma GCC unroll 4
            for (int j = 0; j < kVecs; ++j) {
                if (!full && 8 * j >= w) break;
                float* o = out + g * ldo + d0 + 8 * j;
                __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(sum_of(g, j)), dg);
                asm("" : "+x"(x));  // no contraction into an FMA: the reference rounds the product
                const int left = full ? 8 : w - 8 * j;
                const __m256 ov = left >= 8 ? _mm256_loadu_ps(o) : load8_part(o, left);
                store8_part(o, _mm256_add_ps(ov, x), left);
            }
        }
    }
}

}  // namespace

void attn_scores(const float* q, int nq, const float* k, int64_t tstride, int n, int hd, float scale, float* out,
                 int64_t ldo) {
    attn_scores_t(q, nq, k, tstride, n, hd, scale, out, ldo);
}
void attn_scores_h(const float* q, int nq, const uint16_t* k, int64_t tstride, int n, int hd, float scale,
                   float* out, int64_t ldo) {
    attn_scores_t(q, nq, k, tstride, n, hd, scale, out, ldo);
}
void attn_values(const float* p, int64_t ldp, int nq, const float* v, int64_t stride, int n, int hd, float* out,
                 int64_t ldo) {
    attn_values_t(p, ldp, nq, v, stride, n, hd, out, ldo);
}
void attn_values_h(const float* p, int64_t ldp, int nq, const uint16_t* v, int64_t stride, int n, int hd,
                   float* out, int64_t ldo) {
    attn_values_t(p, ldp, nq, v, stride, n, hd, out, ldo);
}

float softmax_partial(float* x, int n, float* max) {
    // four independent max chains (exact in any order), then two interleaved exp/sum chains
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx4[4] = {ninf, ninf, ninf, ninf};
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) mx4[j] = _mm256_max_ps(mx4[j], _mm256_loadu_ps(x + i + 8 * j));
    for (; i < n; i += 8) {
        const __m256 m = _mm256_castsi256_ps(tail_mask8(n - i));
        mx4[0] = _mm256_max_ps(mx4[0], _mm256_blendv_ps(ninf, load8_part(x + i, n - i), m));
    }
    const float m = hmax8(_mm256_max_ps(_mm256_max_ps(mx4[0], mx4[1]), _mm256_max_ps(mx4[2], mx4[3])));
    const __m256 vmax = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m256 e0 = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
        const __m256 e1 = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vmax));
        s0 = _mm256_add_ps(s0, e0);
        s1 = _mm256_add_ps(s1, e1);
        _mm256_storeu_ps(x + i, e0);
        _mm256_storeu_ps(x + i + 8, e1);
    }
    for (; i < n; i += 8) {
        const __m256 e = exp2_256(_mm256_sub_ps(load8_part(x + i, n - i), vmax));
        s0 = _mm256_add_ps(s0, _mm256_and_ps(e, _mm256_castsi256_ps(tail_mask8(n - i))));
        store8_part(x + i, e, n - i);
    }
    *max = m;
    return hsum8(_mm256_add_ps(s0, s1));
}

void attn_scores_q8(const float* q, int nq, const uint8_t* k, const float* ks, int64_t tstride, int n, int hd,
                    float scale, float* out, int64_t ldo) {
    const int quads = hd / 4;
    if (hd > kMaxQ8Dim || hd % 4) {  // outside the scratch's bounds (no model has such heads)
        kernels_ref().attn_scores_q8(q, nq, k, ks, tstride, n, hd, scale, out, ldo);
        return;
    }
    // The float kernel's passes and query groups, over quantized queries, kQ8Chunk at a time.
    alignas(32) int32_t qq[kQ8Chunk * kMaxQ8Dim / 4];
    int32_t corr[kQ8Chunk];
    float qc[kQ8Chunk];
    constexpr int kPass = 8;
    const int tiles = (n + kKeyTile - 1) / kKeyTile;
    for (int c0 = 0; c0 < nq; c0 += kQ8Chunk) {
        const int cq = imin(kQ8Chunk, nq - c0);
        for (int j = 0; j < cq; ++j) {
            int32_t sum;
            qc[j] = quantize_s8_avx2(q + int64_t(c0 + j) * hd, hd, reinterpret_cast<int8_t*>(qq + j * quads), &sum) *
                    scale;
            corr[j] = 128 * sum;
        }
        for (int t0 = 0; t0 < tiles; t0 += kPass) {
            const int cnt = imin(kPass, tiles - t0);
            for (int j = 0; j < cq;) {
                const int left = cq - j;
#ifdef ZEN5_AVXVNNI
                const int g = left >= 6 ? 6 : left >= 3 ? 3 : left;
#else
                const int g = left >= 4 ? 4 : left;
#endif
                const int32_t *qj = qq + j * quads, *cj = corr + j;
                const float* sj = qc + j;
                float* oj = out + (c0 + j) * ldo;
#ifdef ZEN5_AVXVNNI
                if (g == 6) score_run_q8<6, 1>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
                else if (g == 3) score_run_q8<3, 2>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
                else if (g == 2) score_run_q8<2, 2>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
                else score_run_q8<1, 4>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
#else
                // the dot's accumulators add in one cycle: few are enough, and the registers go
                // to the tile's signed and absolute bytes
                if (g == 4) score_run_q8<4, 1>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
                else if (g == 3) score_run_q8<3, 1>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
                else if (g == 2) score_run_q8<2, 1>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
                else score_run_q8<1, 2>(qj, quads, cj, sj, k, tstride, oj, ldo, t0, cnt, n, ks);
#endif
                j += g;
            }
        }
    }
}

void attn_values_q8(const float* p, int64_t ldp, int nq, const int8_t* v, const float* vs, int64_t qstride, int n,
                    int hd, float* out, int64_t ldo) {
    // Blocks of 32 positions (8 quads: 32 x hd bytes stay in L1 while every group uses them).
    // Whole blocks of whole channel passes (kFull: the quads unrolled, no lane checks) take
    // groups of kG; a last partial block, or a head size off the pass width, groups of 3 or fewer.
#ifdef ZEN5_AVXVNNI
    constexpr int kG = 3, kW = 32;  // 12 accumulators, a value vector and a broadcast
#else
    constexpr int kG = 4, kW = 8;  // 8 accumulators, two widened halves, a broadcast and a product
#endif
    for (int b = 0; b < n; b += 32) {
        const int cnt = imin(32, n - b);
        const bool full = cnt == 32 && hd % kW == 0;
        const int8_t* vb = v + (b / 4) * qstride;
        for (int j = 0; j < nq;) {
            const int g = imin(full ? kG : 3, nq - j);
            const float* pj = p + j * ldp + b;
            float* oj = out + j * ldo;
            if (g == kG && full) values_block_q8<kG, true>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 3 && full) values_block_q8<3, true>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 3) values_block_q8<3, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 2 && full) values_block_q8<2, true>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (g == 2) values_block_q8<2, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else if (full) values_block_q8<1, true>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            else values_block_q8<1, false>(pj, ldp, vb, vs + b, qstride, cnt, hd, oj, ldo);
            j += g;
        }
    }
}

}  // namespace ZEN5_TIER
}  // namespace zen5
