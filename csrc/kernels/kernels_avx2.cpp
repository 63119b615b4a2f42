// AVX2 kernels (AVX2 + FMA + F16C; and, built a second time with ZEN5_AVXVNNI, AVX-VNNI): the
// tier for x86-64 CPUs without AVX-512 VNNI (Zen 2/3, Haswell to today's Intel client chips,
// Skylake-X). Reached only through the kernel table after cpu_features.cpp has checked CPUID and
// XCR0. Same contracts as the AVX-512 tier (kernels.h), on the same packed layouts: a zmm lane
// per row there is a ymm lane per row here, so a 16-row group is two octets of rows (the first and
// second 32 bytes of each 64-byte chunk). The int8 and float-panel matmuls do the same integer
// sums and the same float operations in the same order per (row, token) as the AVX-512 tier, so
// the two give the same bits (tests/test_kernels.py checks it where both run).
//
// No standard-library templates in this file (kernels_avx2.h): scratch space is on the stack or
// tier_scratch.h's.
#include "kernels_avx2.h"
#include "tier_scratch.h"

#include <cmath>
#include <cstring>

namespace zen5 {
namespace ZEN5_TIER {
namespace {

// Decode prefetches the weight stream kDecodePrefetch bytes ahead into L2. On an AMD EPYC Zen 3
// (the AVX2-only CPU this tier is for), alternating in one process, 1 KB ahead made decode of
// SmolLM2-135M faster than the hardware prefetchers alone: Q8_0 +12-16% (1 and 2 threads), Q4_1
// +7-9%, BF16 +7-15%; 512 bytes gained nothing, and into L1 instead of L2 the same. The 4-bit
// types (a 16-row block of 256 payload bytes, half Q8_0's) go 2 KB ahead: 1.7B random Llama tg32
// at 1 thread, 1 KB -> 2 KB, Q4_0 16.7 -> 17.4 tok/s (faster in 11 of 12 alternating rounds),
// Q4_1 16.7 -> 17.3 (7 of 10), at 2 threads Q4_0 26.0 -> 26.7 (7 of 12); DeepSeek V4's MXFP4
// expert halves 2-7% faster per token; SmolLM2-135M Q4_1 the same either way (5 of 10); Q8_0 and
// the V4 layers' 8-bit projections 1-6% slower at 2 KB, so they stay at 1 KB. (On a Zen 4, 8 KB
// into L1 and 16 KB into L2 had measured at best equal to no prefetch, commit 11c95ce.)
constexpr size_t kDecodePrefetch = 1024;
template <int TYPE>
constexpr size_t decode_prefetch() { return TYPE == GGML_Q8_0 ? kDecodePrefetch : 2 * kDecodePrefetch; }

static inline float half(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return _cvtsh_ss(v); }

// 4 activation bytes broadcast to every lane, read through a type that may alias int8 data.
typedef int32_t i32_alias __attribute__((may_alias, aligned(1)));
static inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const i32_alias*>(p)); }

// ---- int8 matmuls over PackedWeights (kernels.h) ---------------------------------------------
//
// O octets of rows (8 rows, one ymm lane each) x NT tokens. Per block the integer sum of each
// (row, token) is built in registers, then f += float(isum) * (d_w * d_x) (and, Q4_1,
// f += m_w * (d_x sum q)): the AVX-512 tier's float steps, so the same bits.
//
// Without VNNI the dot products are vpmaddubsw + vpmaddwd, which saturate at int16 for an
// unsigned operand near 255 (x86-tiers.md), so each type takes the form that stays exact:
//  Q4_0/Q4_1  the nibbles (0..15) are the unsigned operand; a pair is at most 2 x 15 x 127 and
//             a block's 8 pairs per int16 lane at most 30,480, so the block sums in int16 and
//             pays one vpmaddwd per (octet, token) per block, not one per vpmaddubsw
//  Q8_0       stored as w + 128; flipped back to w, |w| is the unsigned operand and the
//             activation takes w's sign (vpsignb), so a pair is at most 2 x 128 x 127
// With VNNI: vpdpbusd on the stored bytes, as the AVX-512 tier. An unsigned operand u = w + z
// (Q4_0 z = 8, MXFP4 12, Q8_0 with VNNI 128) is corrected per block by -z sum q.
//  MXFP4      (DeepSeek V4's experts) the code becomes u = 2 e2m1 + 12 (0..24) through a vpshufb
//             table, the unsigned operand as it is, and -12 sum q corrects the sum, as in the
//             AVX-512 tier (the same integer sums, so the same bits). A pair is at most
//             2 x 24 x 127, so without VNNI four steps sum in int16 and are widened to int32
//             halfway through the block. This replaced |v| as the operand with the activation
//             taking v's sign (no correction, one int16 sum per block): a vpabsb per step and a
//             vpsignb per (step, token) fewer made an expert-shaped GEMM (2048 x 4096, 512
//             tokens) 7-14% faster at 1-2 threads on the Zen 3, alternating in one process.
//
// Blocks [b0, b1) only (a column span, kernels.h: int8_span_blocks): unless b0 == 0 the sums
// start from part, and unless b1 is the last block they go back there instead of to y: part
// holds octet k0 + h's token t at (h * np + t) * 8.
template <int TYPE, int O, int NT>
void octet_tile(const PackedWeights& w, int64_t k0, const QuantAct& x, int t0, float* y, int64_t ldy, int last_rows,
                int64_t b0, int64_t b1, float* part, int64_t np) {
    constexpr bool q4 = TYPE != GGML_Q8_0, fp4 = TYPE == kTypeMXFP4;
    __m256 f[O][NT];
    for (int h = 0; h < O; ++h)
        for (int t = 0; t < NT; ++t) f[h][t] = b0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(part + (h * np + t0 + t) * 8);
    const __m256i m0f = _mm256_set1_epi8(15);
    const __m256i e2m1 = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                          12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);  // 2 v + 12
    const int8_t* xq = x.q + (b0 * x.ld + t0) * QK;
    const float* xd = x.d + b0 * x.ld + t0;
    const int32_t* xc = x.c + b0 * x.ld + t0;
    const float* xds = x.ds + b0 * x.ld + t0;
    const int64_t qstep = x.ld * QK;
    for (int64_t b = b0; b < b1; ++b, xq += qstep, xd += x.ld, xc += x.ld, xds += x.ld) {
        const uint8_t* pay[O];
        const uint8_t* sc[O];
        for (int h = 0; h < O; ++h) {
            const int64_t k = k0 + h;
            pay[h] = w.at(k >> 1, b) + 32 * (k & 1);
            sc[h] = w.scale_at(k >> 1, b) + (fp4 ? 8 : 16) * (k & 1);  // 8 rows' scales: E8M0 bytes or fp16
        }
        if constexpr (NT == 1)
            for (int h = 0; h < O; h += 2) prefetch_bytes(w.at((k0 + h) >> 1, b) + decode_prefetch<TYPE>(), w.block_bytes);
        __m256i acc[O][NT], acc32[O][NT];  // acc32: MXFP4's first four steps without VNNI
#ifdef ZEN5_AVXVNNI
        constexpr bool i16 = false;
        constexpr int zero_point = TYPE == GGML_Q4_0 ? 8 : fp4 ? 12 : TYPE == GGML_Q8_0 ? 128 : 0;  // stored w + 128
#else
        constexpr bool i16 = q4;
        constexpr int zero_point = TYPE == GGML_Q4_0 ? 8 : fp4 ? 12 : 0;  // Q8_0: |w| and the sign trick
#endif
        for (int h = 0; h < O; ++h)
            for (int t = 0; t < NT; ++t) acc[h][t] = acc32[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m256i p[O], a[O];
            int o;
            for (int h = 0; h < O; ++h) {
                if constexpr (q4) {
                    const __m256i raw = _mm256_load_si256((const __m256i*)(pay[h] + 64 * (j % 4)));
                    p[h] = j < 4 ? _mm256_and_si256(raw, m0f) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), m0f);
                    o = j < 4 ? 4 * j : 16 + 4 * (j - 4);
                    if constexpr (fp4) p[h] = _mm256_shuffle_epi8(e2m1, p[h]);
                } else {
                    p[h] = _mm256_load_si256((const __m256i*)(pay[h] + 64 * j));
                    o = 4 * j;
#ifndef ZEN5_AVXVNNI
                    p[h] = _mm256_xor_si256(p[h], _mm256_set1_epi8(char(0x80)));  // w, signed
                    a[h] = _mm256_abs_epi8(p[h]);                                 // |w| as u8 (128 too)
#endif
                }
            }
            (void)a;
#pragma GCC unroll 8
            for (int t = 0; t < NT; ++t) {
                const __m256i xb = bcast4(xq + t * QK + o);
                for (int h = 0; h < O; ++h) {
                    if constexpr (i16)
                        acc[h][t] = _mm256_add_epi16(acc[h][t], _mm256_maddubs_epi16(p[h], xb));
#ifdef ZEN5_AVXVNNI
                    else acc[h][t] = dot4(acc[h][t], p[h], xb);
#else
                    else acc[h][t] = dot4(acc[h][t], a[h], _mm256_sign_epi8(xb, p[h]));
#endif
                }
            }
            // Integer adds reassociate freely: left alone, GCC computed all 48 products of a
            // block first and spilled them to build an add tree. Pinning the sums at every step
            // keeps one accumulator per (octet, token) in a register.
            for (int h = 0; h < O; ++h)
                for (int t = 0; t < NT; ++t) __asm__("" : "+x"(acc[h][t]));
            if constexpr (fp4 && i16)
                if (j == 3)
                    for (int h = 0; h < O; ++h)
                        for (int t = 0; t < NT; ++t) {
                            acc32[h][t] = _mm256_madd_epi16(acc[h][t], _mm256_set1_epi16(1));
                            acc[h][t] = _mm256_setzero_si256();
                        }
        }
        for (int h = 0; h < O; ++h) {
            __m256 wd;
            if constexpr (fp4) {  // E8M0 bytes: (s - 1) << 23 = 2^(s - 128), half the scale (kernels.h)
                const __m128i s8 = _mm_subs_epu8(_mm_loadl_epi64((const __m128i*)sc[h]), _mm_set1_epi8(1));
                wd = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(s8), 23));
            } else {
                wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sc[h]));
            }
            __m256 wm = _mm256_setzero_ps();
            if constexpr (TYPE == GGML_Q4_1) wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc[h] + 32)));
#pragma GCC unroll 8
            for (int t = 0; t < NT; ++t) {
                __m256i sum = acc[h][t];
                if constexpr (i16) sum = _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
                if constexpr (fp4 && i16) sum = _mm256_add_epi32(sum, acc32[h][t]);
                // the unsigned operand's zero point z: sum (u - z) q = sum u q - z sum q, and
                // c = -128 sum q, so the correction is z (c / 128), exact
                if constexpr (zero_point != 0) sum = _mm256_add_epi32(sum, _mm256_set1_epi32((xc[t] >> 7) * zero_point));
                f[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(wd, _mm256_set1_ps(xd[t])), f[h][t]);
                if constexpr (TYPE == GGML_Q4_1) f[h][t] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xds[t]), f[h][t]);
            }
        }
    }
    for (int h = 0; h < O; ++h)
        for (int t = 0; t < NT; ++t) {
            float* out = y + (t0 + t) * ldy + (k0 + h) * 8;
            if (b1 < w.blocks) _mm256_store_ps(part + (h * np + t0 + t) * 8, f[h][t]);
            else if (h == O - 1 && last_rows < 8) _mm256_maskstore_ps(out, tail_mask8(last_rows), f[h][t]);
            else _mm256_storeu_ps(out, f[h][t]);
        }
}

#ifndef ZEN5_AVXVNNI
// Q8_0 prefill without VNNI. On Zen 4 vpsignb and vpabsb issue only on the two pipes that also
// run vpmaddubsw, vpmaddwd and the FMAs, so octet_tile's sign trick (vpsignb per (octet, token)
// and step, vpabsb per octet and step) made those two pipes the bound. Here the weight side is
// prepared once per octet for all the tokens: a = |w| (as u8, 128 included) and m = (w < 0 ?
// 0xFF : 0) per step, and per block C = sum over w < 0 of |w| per row. A token's bytes then take
// w's sign with one vpxor, which runs on any pipe: x ^ m is x where w >= 0 and ~x = -x - 1 where
// w < 0, so per row vpmaddubsw(a, x ^ m) summed over the block is sum(w x) - C, and the
// accumulator starts at C. Exact in int16: with |x| <= 127, a pair is a0 s0 + a1 s1 with either
// a <= 127 and |s| <= 127, or a <= 128 and s = ~x in [-128, 126], so within [-32768, 32256].
// The integer sums are the same, so are the float steps (f += float(sum) * (d_w * d_x)).
constexpr int kQ8PrepBlocks = 32;    // blocks prepared at a time (the buffer below, 18 KB)
constexpr int kQ8PrepBytes = 576;    // per block: 8 x (a, m) 32-byte pairs, C (8 x int32), d_w (8 x fp32)

static void q8_prepare(const PackedWeights& w, int64_t k, int64_t b0, int nb, uint8_t* buf) {
    const __m256i zero = _mm256_setzero_si256(), bias = _mm256_set1_epi8(char(0x80));
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int i = 0; i < nb; ++i, buf += kQ8PrepBytes) {
        const uint8_t* pay = w.at(k >> 1, b0 + i) + 32 * (k & 1);
        __m256i c16 = zero;
        for (int j = 0; j < 8; ++j) {
            const __m256i v = _mm256_xor_si256(_mm256_load_si256((const __m256i*)(pay + 64 * j)), bias);  // w
            const __m256i a = _mm256_abs_epi8(v), m = _mm256_cmpgt_epi8(zero, v);
            _mm256_store_si256((__m256i*)(buf + 64 * j), a);
            _mm256_store_si256((__m256i*)(buf + 64 * j + 32), m);
            c16 = _mm256_add_epi16(c16, _mm256_maddubs_epi16(_mm256_and_si256(a, m), ones8));  // <= 8 x 256
        }
        _mm256_store_si256((__m256i*)(buf + 512), _mm256_madd_epi16(c16, ones16));
        _mm256_store_ps((float*)(buf + 544),
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.scale_at(k >> 1, b0 + i) + 16 * (k & 1)))));
    }
}

// NT tokens from t0 against the prepared blocks [b0, b0 + nb) of one octet; f continues from
// part (token t at t * 8) unless first, and goes to out (y) if final, else back to part. With a
// and m loaded once per step for all NT tokens, a step costs per token a broadcast, vpxor,
// vpmaddubsw, vpmaddwd and vpaddd: 6 tokens (12 accumulators with the float sums) fit the 16
// registers and measured faster than 4 (commit message). On the Zen 3 the vpxor costs: a
// microbenchmark of this loop without it ran ~20% faster, but moving the sign to vpshufb (8
// bytes x, ~x per step broadcast, an index per row picking either) made a 1-thread Q8_0 pp512 of
// SmolLM2-135M slower, 355 vs 401 tok/s alternating in one process; 4 or 5 tokens per tile were no
// faster than 6 there either.
template <int NT>
void q8_prep_tile(const uint8_t* buf, int nb, int64_t b0, const QuantAct& x, int t0, float* out, int64_t ldy,
                  int last_rows, float* part, bool first, bool final) {
    __m256 f[NT];
    const __m256i tail = tail_mask8(last_rows);
    for (int t = 0; t < NT; ++t) f[t] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + t * 8);
    const int8_t* xq = x.q + (b0 * x.ld + t0) * QK;
    const float* xd = x.d + b0 * x.ld + t0;
    const int64_t qstep = x.ld * QK;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; ++b, buf += kQ8PrepBytes, xq += qstep, xd += x.ld) {
        __m256i acc[NT];
        const __m256i c = _mm256_load_si256((const __m256i*)(buf + 512));
        for (int t = 0; t < NT; ++t) acc[t] = c;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            const __m256i a = _mm256_load_si256((const __m256i*)(buf + 64 * j));
            const __m256i m = _mm256_load_si256((const __m256i*)(buf + 64 * j + 32));
#pragma GCC unroll 8
            for (int t = 0; t < NT; ++t) {
                const __m256i s = _mm256_xor_si256(bcast4(xq + t * QK + 4 * j), m);
                acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), ones));
            }
            for (int t = 0; t < NT; ++t) __asm__("" : "+x"(acc[t]));  // one accumulator per token (octet_tile)
        }
        const __m256 wd = _mm256_load_ps((const float*)(buf + 544));
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
            f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_mul_ps(wd, _mm256_set1_ps(xd[t])), f[t]);
    }
    for (int t = 0; t < NT; ++t) {
        if (!final) _mm256_store_ps(part + t * 8, f[t]);
        else if (last_rows < 8) _mm256_maskstore_ps(out + t * ldy, tail, f[t]);
        else _mm256_storeu_ps(out + t * ldy, f[t]);
    }
}

// Octets [k_begin, k_end) in blocks of kSpanRows rows; per column span (kernels.h) each octet's
// blocks are prepared kQ8PrepBlocks at a time, the float sums carried over in part (octet o of
// the row block, token t at (o * n + t) * 8).
template <int NT>
void q8_prefill(const PackedWeights& w, int64_t k_begin, int64_t k_end, int last, const QuantAct& x, int n, float* y,
                int64_t ldy, float* part) {
    alignas(64) uint8_t buf[kQ8PrepBlocks * kQ8PrepBytes];
    const int64_t span = int8_span_blocks(w.blocks, n), ro = kSpanRows / 8;  // (part's size, spans or not)
    for (int64_t kb = k_begin; kb < k_end; kb += ro) {
        const int64_t ke = kb + ro < k_end ? kb + ro : k_end;
        for (int64_t s0 = 0; s0 < w.blocks; s0 += span) {
            const int64_t s1 = s0 + span < w.blocks ? s0 + span : w.blocks;
            for (int64_t k = kb; k < ke; ++k) {
                const int lr = k + 1 == k_end ? last : 8;
                float* out = y + k * 8;
                float* pk = part + (k - kb) * n * 8;
                for (int64_t b0 = s0; b0 < s1; b0 += kQ8PrepBlocks) {
                    const int nb = int(s1 - b0 < kQ8PrepBlocks ? s1 - b0 : kQ8PrepBlocks);
                    q8_prepare(w, k, b0, nb, buf);
                    const bool first = b0 == 0, final = b0 + nb == w.blocks;
                    int t0 = 0;
                    for (; t0 + NT <= n; t0 += NT)
                        q8_prep_tile<NT>(buf, nb, b0, x, t0, out + t0 * ldy, ldy, lr, pk + t0 * 8, first, final);
                    if (n - t0 >= NT / 2 && NT / 2 > 1) {
                        q8_prep_tile<NT / 2>(buf, nb, b0, x, t0, out + t0 * ldy, ldy, lr, pk + t0 * 8, first, final);
                        t0 += NT / 2;
                    }
                    for (; t0 < n; ++t0) q8_prep_tile<1>(buf, nb, b0, x, t0, out + t0 * ldy, ldy, lr, pk + t0 * 8, first, final);
                }
            }
        }
    }
}
#endif

// Tokens per tile in prefill: the accumulators (2 x NT) and the step's operands fit the 16 ymm
// registers; Q8_0 without VNNI needs two more (|w| and the signed activation), MXFP4 a second
// sum per (octet, token) (its first four steps in int32).
template <int TYPE>
constexpr int prefill_tokens() {
#ifdef ZEN5_AVXVNNI
    return 6;
#else
    return TYPE == GGML_Q8_0 || TYPE == kTypeMXFP4 ? 4 : 6;
#endif
}

// All n tokens against O octets from k0: full tiles of NT, then the rest one smaller tile.
template <int TYPE, int O, int NT>
void octet_tiles(const PackedWeights& w, int64_t k0, const QuantAct& x, int n, float* y, int64_t ldy, int last,
                 int64_t b0, int64_t b1, float* part) {
    int t0 = 0;
    for (; t0 + NT <= n; t0 += NT) octet_tile<TYPE, O, NT>(w, k0, x, t0, y, ldy, last, b0, b1, part, n);
    const int left = n - t0;
    if constexpr (NT > 1)
        if (left > 0) {
            if (left >= NT / 2 && NT / 2 > 1) {
                octet_tile<TYPE, O, NT / 2>(w, k0, x, t0, y, ldy, last, b0, b1, part, n);
                t0 += NT / 2;
            }
            for (; t0 < n; ++t0) octet_tile<TYPE, O, 1>(w, k0, x, t0, y, ldy, last, b0, b1, part, n);
        }
}

template <int TYPE>
void matmul_int8_typed(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n, float* y,
                       int64_t ldy) {
    const int64_t k_begin = r0 / 8, k_end = (r1 + 7) / 8;
    const int last = int(r1 - (k_end - 1) * 8);
    const int64_t nb = w.blocks;
    if (n < 4) {
        // decode and small batches: a group (two octets) per pass, so each weight line is read
        // once per token tile; decode takes two groups (four octets) per pass, two weight streams
        // in flight: on the Xeon with this tier forced, 1.7B random Llama tg32 at 1/2 threads,
        // Q4_0 13.3/24.9 -> 15.1/26.0 tok/s, Q8_0 7.85/14.0 -> 8.86/15.8. On AMD, rows of up to
        // 4096 columns stay one group per pass, one sequential stream (the AVX-512 tier's
        // decode_in_pairs says why): on a Zen 4 with this tier forced, 1 thread, GEMVs over 1.5 GB
        // (GB/s, two groups -> one) 2048 x 2048 Q4_0 16.9 -> 24.6, Q4_1 18.6 -> 26.0, Q8_0 22.2
        // -> 24.3; 4096 x 4096 Q4_0 19.6 -> 24.0, Q4_1 20.9 -> 20.7, Q8_0 24.8 -> 24.0; longer
        // rows were mixed (2048 x 8192 Q8_0 27.2 -> 24.5) or slower (4096 x 14336 Q4_1 24.1 ->
        // 18.7). On a Zen 3, 1.7B Q4_0 tg32 alternating in one process (medians of 5), 1/2
        // threads: 17.1/28.5 tok/s with this rule, 16.3/25.6 with two groups everywhere.
        int64_t k = k_begin;
        if (n == 1 && !(nb <= 128 && cpu_is_amd()))
            for (; k + 4 <= k_end; k += 4) octet_tile<TYPE, 4, 1>(w, k, x, 0, y, ldy, k + 4 == k_end ? last : 8, 0, nb, nullptr, n);
        for (; k + 2 <= k_end; k += 2) {
            const int lr = k + 2 == k_end ? last : 8;
            if (n == 1) octet_tile<TYPE, 2, 1>(w, k, x, 0, y, ldy, lr, 0, nb, nullptr, n);
            else if (n == 2) octet_tile<TYPE, 2, 2>(w, k, x, 0, y, ldy, lr, 0, nb, nullptr, n);
            else {
                octet_tile<TYPE, 2, 2>(w, k, x, 0, y, ldy, lr, 0, nb, nullptr, n);
                octet_tile<TYPE, 2, 1>(w, k, x, 2, y, ldy, lr, 0, nb, nullptr, n);
            }
        }
        if (k < k_end) octet_tiles<TYPE, 1, 2>(w, k, x, n, y, ldy, last, 0, nb, nullptr);
        return;
    }
    thread_local Scratch scratch;
    float* part = scratch.get<float>(size_t(kSpanRows) * n);  // the sums between column spans (kernels.h)
#ifndef ZEN5_AVXVNNI
    if constexpr (TYPE == GGML_Q8_0) return q8_prefill<6>(w, k_begin, k_end, last, x, n, y, ldy, part);
#endif
    // prefill: an octet at a time, every token tile (its group's weights stay in L1/L2 between
    // the two octets); Q4 without VNNI: both octets of a group at a time, 4 tokens (each
    // activation broadcast then feeds two vpmaddubsw: measured faster, commit message); all of
    // it per column span over blocks of kSpanRows rows (kernels.h: int8_span_blocks)
    const int64_t span = int8_span_blocks(nb, n), ro = span == nb ? k_end - k_begin : kSpanRows / 8;
    for (int64_t kb = k_begin; kb < k_end; kb += ro) {
        const int64_t ke = kb + ro < k_end ? kb + ro : k_end;
        const int ke_last = ke == k_end ? last : 8;
        for (int64_t b0 = 0; b0 < nb; b0 += span) {
            const int64_t b1 = b0 + span < nb ? b0 + span : nb;
            int64_t k = kb;
#ifndef ZEN5_AVXVNNI
            for (; k + 2 <= ke; k += 2)
                octet_tiles<TYPE, 2, 4>(w, k, x, n, y, ldy, k + 2 == ke ? ke_last : 8, b0, b1, part + (k - kb) * n * 8);
#endif
            for (; k < ke; ++k)
                octet_tiles<TYPE, 1, prefill_tokens<TYPE>()>(w, k, x, n, y, ldy, k + 1 == ke ? ke_last : 8, b0, b1,
                                                              part + (k - kb) * n * 8);
        }
    }
}

void matmul_int8(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n, float* y, int64_t ldy) {
    switch (w.type) {
        case GGML_Q4_0: return matmul_int8_typed<GGML_Q4_0>(w, r0, r1, x, n, y, ldy);
        case GGML_Q4_1: return matmul_int8_typed<GGML_Q4_1>(w, r0, r1, x, n, y, ldy);
        case GGML_Q8_0: return matmul_int8_typed<GGML_Q8_0>(w, r0, r1, x, n, y, ldy);
        case kTypeMXFP4: return matmul_int8_typed<kTypeMXFP4>(w, r0, r1, x, n, y, ldy);
    }
}

// Activations to int8 per 32-block, the reference's bytes: d = max|x| / 127, q = round(x / d)
// to nearest even (vcvtps2dq in the default MXCSR mode), clamped to +-127.
void quantize_act(const float* x, int n, int64_t cols, int64_t ld, int8_t* q, float* d, int32_t* c, float* ds) {
    const int64_t nb = cols / QK;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (int t = 0; t < n; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * QK;
            const int64_t i = b * ld + t;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int j = 0; j < 4; ++j) {
                v[j] = _mm256_loadu_ps(xb + 8 * j);
                m = _mm256_max_ps(m, _mm256_and_ps(v[j], absmask));
            }
            const float amax = hmax8(m);
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i qi[4], s = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                qi[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid)), hi), lo);
                s = _mm256_add_epi32(s, qi[j]);
            }
            // 32 int32 -> 32 int8 in order: packs work per 128-bit lane, the permute restores it
            const __m256i w16a = _mm256_packs_epi32(qi[0], qi[1]), w16b = _mm256_packs_epi32(qi[2], qi[3]);
            const __m256i b8 = _mm256_packs_epi16(w16a, w16b);
            _mm256_storeu_si256((__m256i*)(q + i * QK),
                                _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            const int32_t sum = hsum8i(s);
            d[i] = db;
            c[i] = -128 * sum;
            ds[i] = db * float(sum);
        }
}

// ---- float matmuls over FloatPanels (kernels.h) ----------------------------------------------
//
// A panel group (16 rows) is two ymm of lanes. A tile is R groups x NT tokens (R x 2 x NT
// accumulators): decode takes a whole band (R = 4, NT = 1), prefill a group x 4 tokens (8
// accumulators, as many FMAs as two ports of 4-cycle latency keep in flight), since a whole band x
// 6 tokens (the AVX-512 tile) needs 48 registers here (a 2 x 3 tile spilled). One FMA chain per (row,
// token) over the columns in order, as the AVX-512 tier: the same bits whatever the tile.
// Decode prefetches the panels kDecodePrefetch bytes ahead (see the top of this file).

template <int TYPE>
static inline void load_step(const uint8_t* gp, int half, __m256& w0, __m256& w1) {
    // gp: one group's bytes of a step; half (BF16 only): 0 = column 2s, 1 = column 2s + 1
    if constexpr (TYPE == GGML_F32) {
        w0 = _mm256_load_ps((const float*)gp);
        w1 = _mm256_load_ps((const float*)gp + 8);
    } else if constexpr (TYPE == GGML_F16) {
        w0 = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)gp));
        w1 = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(gp + 16)));
    } else {
        const __m256i a = _mm256_load_si256((const __m256i*)gp), b = _mm256_load_si256((const __m256i*)(gp + 32));
        if (half == 0) {
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
            w1 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
        } else {
            const __m256i hi = _mm256_set1_epi32(int(0xFFFF0000u));
            w0 = _mm256_castsi256_ps(_mm256_and_si256(a, hi));
            w1 = _mm256_castsi256_ps(_mm256_and_si256(b, hi));
        }
    }
}

template <int TYPE, int R, int NT>
void panel_tile(const FloatPanels& w, int64_t band, int g0, const float* x, int64_t ldx, float* y, int64_t ldy,
                int64_t r_end) {
    __m256 a[R][2][NT];
    for (int g = 0; g < R; ++g)
        for (int t = 0; t < NT; ++t) a[g][0][t] = a[g][1][t] = _mm256_setzero_ps();
    constexpr size_t gb = TYPE == GGML_F16 ? 32 : 64, sb = 4 * gb;  // bytes per group, per step
    const uint8_t* p = w.band(band) + g0 * gb;
    auto fma_col = [&](int g, __m256 w0, __m256 w1, int64_t c) {
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
            const __m256 xv = _mm256_broadcast_ss(x + t * ldx + c);
            a[g][0][t] = _mm256_fmadd_ps(w0, xv, a[g][0][t]);
            a[g][1][t] = _mm256_fmadd_ps(w1, xv, a[g][1][t]);
        }
    };
    const int64_t steps = TYPE == GGML_BF16 ? w.cols / 2 : w.cols;
    for (int64_t s = 0; s < steps; ++s, p += sb) {
        if constexpr (NT == 1) prefetch_bytes(p + kDecodePrefetch, sb);
#pragma GCC unroll 2
        for (int hc = 0; hc < (TYPE == GGML_BF16 ? 2 : 1); ++hc)
#pragma GCC unroll 4
            for (int g = 0; g < R; ++g) {
                __m256 w0, w1;
                load_step<TYPE>(p + g * gb, hc, w0, w1);
                fma_col(g, w0, w1, TYPE == GGML_BF16 ? 2 * s + hc : s);
            }
        // Left alone, GCC stored every accumulator to the stack at each step of the decode loop
        // (for the code after it); pinning them keeps that loop to loads and FMAs, a faster
        // decode (the same pin in the 4-token tile slowed prefill: it serialized the tile's chains).
        if constexpr (NT == 1)
            for (int g = 0; g < R; ++g) __asm__("" : "+x"(a[g][0][0]), "+x"(a[g][1][0]));
    }
    if (TYPE == GGML_BF16 && w.cols % 2)  // the last column, paired with zeros
        for (int g = 0; g < R; ++g) {
            __m256 w0, w1;
            load_step<TYPE>(p + g * gb, 0, w0, w1);
            fma_col(g, w0, w1, w.cols - 1);
        }
    const int64_t r0 = band * kPanelRows + g0 * 16;
    for (int g = 0; g < R; ++g)
        for (int hh = 0; hh < 2; ++hh) {
            const int64_t r = r0 + 16 * g + 8 * hh;
            if (r >= r_end) break;
            for (int t = 0; t < NT; ++t) {
                float* out = y + t * ldy + r;
                if (r_end - r >= 8) _mm256_storeu_ps(out, a[g][hh][t]);
                else _mm256_maskstore_ps(out, tail_mask8(r_end - r), a[g][hh][t]);
            }
        }
}

template <int TYPE>
void panel_matmul(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n, int64_t ldx, float* y,
                  int64_t ldy) {
    const FloatPanels& pw = *w.panels;
    for (int64_t b = r0 / kPanelRows; b * kPanelRows < r1; ++b) {
        if (n == 1) {
            panel_tile<TYPE, 4, 1>(pw, b, 0, x, ldx, y, ldy, r1);
            continue;
        }
        for (int g0 = 0; g0 < 4; ++g0) {  // a group at a time; its weights stay in L1 for every tile
            if (b * kPanelRows + g0 * 16 >= r1) break;
            int t0 = 0;
            for (; t0 + 4 <= n; t0 += 4) panel_tile<TYPE, 1, 4>(pw, b, g0, x + t0 * ldx, ldx, y + t0 * ldy, ldy, r1);
            if (n - t0 >= 2) {
                panel_tile<TYPE, 1, 2>(pw, b, g0, x + t0 * ldx, ldx, y + t0 * ldy, ldy, r1);
                t0 += 2;
            }
            if (t0 < n) panel_tile<TYPE, 1, 1>(pw, b, g0, x + t0 * ldx, ldx, y + t0 * ldy, ldy, r1);
        }
    }
}

// Quantized weights with float activations (matmul="f32" on a quantized model): each block
// dequantized once into 4 ymm, one FMA chain per 8 lanes of each (row, token).
template <int TYPE>
static inline void deq_block(const uint8_t* b, __m256 out[4]) {
    const __m256 d = _mm256_set1_ps(half(b));
    if constexpr (TYPE == GGML_Q8_0) {
        for (int j = 0; j < 4; ++j)
            out[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * j)))), d);
    } else {
        const uint8_t* qs = b + (TYPE == GGML_Q4_1 ? 4 : 2);
        const __m128i q = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        const __m256 m = TYPE == GGML_Q4_1 ? _mm256_set1_ps(half(b + 2)) : _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            __m256i v = _mm256_cvtepu8_epi32(parts[j]);
            if constexpr (TYPE == GGML_Q4_0) {
                out[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))), d);
            } else {  // multiply, then add, as the reference rounds
                const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
                out[j] = _mm256_add_ps(prod, m);
            }
        }
    }
}

template <int TYPE, int NT>
void row_tile(const WeightView& w, int64_t r, const float* x, int64_t ldx, float* y, int64_t ldy) {
    constexpr size_t bb = TYPE == GGML_Q4_0 ? 18 : TYPE == GGML_Q4_1 ? 20 : 34;
    __m256 lo[NT], hi[NT];
    for (int t = 0; t < NT; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
    const uint8_t* row = w.row(r);
    for (int64_t b = 0; b < w.cols / QK; ++b) {
        __m256 v[4];
        deq_block<TYPE>(row + b * bb, v);
        for (int t = 0; t < NT; ++t) {
            const float* xt = x + t * ldx + b * QK;
            lo[t] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xt), lo[t]);
            hi[t] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xt + 8), hi[t]);
            lo[t] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xt + 16), lo[t]);
            hi[t] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xt + 24), hi[t]);
        }
    }
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum8(_mm256_add_ps(lo[t], hi[t]));
}

template <int TYPE>
void quant_matmul(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n, int64_t ldx, float* y,
                  int64_t ldy) {
    for (int64_t r = r0; r < r1; ++r) {
        int t0 = 0;
        for (; t0 + 4 <= n; t0 += 4) row_tile<TYPE, 4>(w, r, x + t0 * ldx, ldx, y + t0 * ldy, ldy);
        for (; t0 < n; ++t0) row_tile<TYPE, 1>(w, r, x + t0 * ldx, ldx, y + t0 * ldy, ldy);
    }
}

void matmul(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n, int64_t ldx, float* y,
            int64_t ldy) {
    switch (w.type) {
        case GGML_Q4_0: return quant_matmul<GGML_Q4_0>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_Q4_1: return quant_matmul<GGML_Q4_1>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_Q8_0: return quant_matmul<GGML_Q8_0>(w, r0, r1, x, n, ldx, y, ldy);
    }
    if (!w.panels) return kernels_ref().matmul(w, r0, r1, x, n, ldx, y, ldy);  // (kernels.h)
    switch (w.type) {
        case GGML_F32: return panel_matmul<GGML_F32>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_F16: return panel_matmul<GGML_F16>(w, r0, r1, x, n, ldx, y, ldy);
        case GGML_BF16: return panel_matmul<GGML_BF16>(w, r0, r1, x, n, ldx, y, ldy);
    }
}

void dequant_row(int type, const uint8_t* src, int64_t n, float* dst) {
    switch (type) {
        case GGML_Q4_0:
        case GGML_Q4_1:
        case GGML_Q8_0: {
            const size_t bb = row_bytes(type, QK);
            for (int64_t b = 0; b < n / QK; ++b) {
                __m256 v[4];
                if (type == GGML_Q4_0) deq_block<GGML_Q4_0>(src + b * bb, v);
                else if (type == GGML_Q4_1) deq_block<GGML_Q4_1>(src + b * bb, v);
                else deq_block<GGML_Q8_0>(src + b * bb, v);
                for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + b * QK + 8 * j, v[j]);
            }
            return;
        }
        default: return kernels_ref().dequant_row(type, src, n, dst);  // F32 / F16 / BF16: conversions only
    }
}

// ---- elementwise ------------------------------------------------------------------------------
//
// Full vectors with plain loads and stores, the masked forms only for a tail: vmaskmovps is
// microcoded on AMD cores (on the Zen 4 here a masked add loop measured much slower per vector
// than the plain one: the figures are in the commit message). Same lanes, same arithmetic: the
// same bits.
static inline __m256 ld8(const float* p, int64_t left) {
    return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask8(left));
}
static inline void st8(float* p, int64_t left, __m256 v) {
    if (left >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, tail_mask8(left), v);
}

float dot(const float* a, const float* b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i < n; i += 8) {
        const __m256i m = tail_mask8(n - i);
        acc0 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), acc0);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

void axpy(float a, const float* x, float* y, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    for (int64_t i = 0; i < n; i += 8) st8(y + i, n - i, _mm256_fmadd_ps(va, ld8(x + i, n - i), ld8(y + i, n - i)));
}

void add(float* y, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) st8(y + i, n - i, _mm256_add_ps(ld8(y + i, n - i), ld8(x + i, n - i)));
}

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = ld8(x + i, n - i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(hsum8(ss) / float(n) + eps));
    for (int64_t i = 0; i < n; i += 8) st8(out + i, n - i, _mm256_mul_ps(_mm256_mul_ps(ld8(x + i, n - i), scale), ld8(w + i, n - i)));
}

// exp(x) for x in [-87, 88]: 2^k p(r), r = x - k ln2 (two-step), a degree-6 polynomial (Cephes
// coefficients, about 2 ulp; the AVX-512 tier's exp512); 2^k built in the exponent field (k is in
// [-126, 127] after the clamp, a normal number).
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

void swiglu(const float* g, const float* u, int64_t n, float* out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 gv = ld8(g + i, n - i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        st8(out + i, n - i, _mm256_mul_ps(s, ld8(u + i, n - i)));
    }
}

void to_f16(const float* x, int64_t n, uint16_t* out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n) {
        alignas(32) uint16_t tmp[8];
        _mm_store_si128((__m128i*)tmp, _mm256_cvtps_ph(_mm256_maskload_ps(x + i, tail_mask8(n - i)),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        std::memcpy(out + i, tmp, size_t(n - i) * 2);
    }
}

}  // namespace

const Kernels* table() {
#ifdef ZEN5_AVXVNNI
    static const Kernels k{"avx2vnni",
#else
    static const Kernels k{"avx2",
#endif
                           matmul, dequant_row, dot, axpy, add, rmsnorm, swiglu, attn_scores, quantize_act,
                           matmul_int8, attn_scores_h, attn_values_h, to_f16, softmax_partial, attn_values,
                           attn_scores_q8, attn_values_q8};
    return &k;
}

}  // namespace ZEN5_TIER

#ifdef ZEN5_AVXVNNI
const Kernels* kernels_avx2vnni() { return avx2vnni::table(); }
#else
const Kernels* kernels_avx2() { return avx2::table(); }
#endif

}  // namespace zen5
