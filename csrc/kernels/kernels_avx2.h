// Internal to the AVX2 tier: what its translation units (kernels_avx2.cpp, the table and the
// matmuls; kernels_avx2_attention.cpp) share. Every file of the tier is compiled twice, once with
// -mavx2 -mfma -mf16c (namespace zen5::avx2) and once more with -mavxvnni (ZEN5_AVXVNNI defined,
// namespace zen5::avx2vnni), so the two builds never share a symbol. Helpers here have internal
// linkage (static inline): nothing compiled with these flags may become a weak symbol that the
// linker could keep for code outside the tier (tests/test_isa_tiers.py).
#pragma once
#include <immintrin.h>

#include "kernels.h"

#ifdef ZEN5_AVXVNNI
#define ZEN5_TIER avx2vnni
#else
#define ZEN5_TIER avx2
#endif

namespace zen5 {
namespace ZEN5_TIER {

// The attention kernels (kernels_avx2_attention.cpp), same contracts as the table's entries.
void attn_scores(const float* q, int nq, const float* k, int64_t tstride, int n, int hd, float scale, float* out,
                 int64_t ldo);
void attn_scores_h(const float* q, int nq, const uint16_t* k, int64_t tstride, int n, int hd, float scale,
                   float* out, int64_t ldo);
void attn_values(const float* p, int64_t ldp, int nq, const float* v, int64_t stride, int n, int hd, float* out,
                 int64_t ldo);
void attn_values_h(const float* p, int64_t ldp, int nq, const uint16_t* v, int64_t stride, int n, int hd,
                   float* out, int64_t ldo);
float softmax_partial(float* x, int n, float* max);
void attn_scores_q8(const float* q, int nq, const uint8_t* k, const float* ks, int64_t tstride, int n, int hd,
                    float scale, float* out, int64_t ldo);
void attn_values_q8(const float* p, int64_t ldp, int nq, const int8_t* v, const float* vs, int64_t qstride, int n,
                    int hd, float* out, int64_t ldo);

// Every 64-byte line of [p, p + bytes) into L2 (the matmuls' decode and the attention kernels).
static inline void prefetch_bytes(const void* p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T1);
}

// Lanes [0, left) set (all when left >= 8): the mask for a partial vector of 8 floats.
static inline __m256i tail_mask8(int64_t left) {
    const int l = left >= 8 ? 8 : left <= 0 ? 0 : int(left);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(l), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline float hmax8(__m256 v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static inline int32_t hsum8i(__m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i h = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

// Sum over each 32-bit lane of the 4 products u8 x s8 (vpdpbusd's contract, without its
// accumulator). With AVX-VNNI it is one instruction; without, vpmaddubsw pairs them into int16
// (exact: callers keep |u| <= 128 and |s| <= 127, so a pair is at most 32,512) and vpmaddwd by 1
// sums the pairs.
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef ZEN5_AVXVNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

}  // namespace ZEN5_TIER
}  // namespace zen5
