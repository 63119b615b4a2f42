// The AMX tier: the AVX-512 table with the int8 prefill matmul on Intel's AMX tile unit (Sapphire
// Rapids and later Xeons). The only file compiled with AMX flags; reached only through the kernel
// table after cpu_features.cpp has checked CPUID, XCR0 and the kernel's permission to use the
// tile data state (arch_prctl), so no other CPU executes an instruction from it.
//
// Why a tier for one kernel: on the AVX-512 tier a prefill's int8 tile spends, per 16 rows,
// token and 32-column block, 8 vpdpbusd on the products and 3-4 more vector instructions on the
// block's scales (cvt, mul, fma; Q4_1 one more fma) plus the Q4 unpacking, all on the two vector
// ports, so the products could take at most ~57% of those ports (they took 44% of the vpdpbusd
// peak measured, on 8B widths at 256 tokens). AMX does the products of a whole 16-token x
// 16-row x 32-column block in one TDPBSSD on a unit of its own, so the vector ports are left with
// the scales, which are the same instructions in the same order as the AVX-512 tile's. The
// integer sums are exact in both, so this tier computes the same bits as avx512 (tested).
//
// Per 16-row group and span of blocks (kernels.h, int8_span_blocks) the weights are unpacked once
// into a B-tile image (8 rows of 16 rows' 4 bytes: the packed layout itself, as signed int8:
// Q8_0 u ^ 0x80, Q4_0 q - 8, MXFP4 2 x e2m1; Q4_1 unsigned q), then every 16-token tile of the
// batch multiplies it: per block one tile load of the tokens' 32 quants (QuantAct keeps a block's
// tokens side by side, 32 bytes apart), one TDP into a zeroed accumulator tile, one tile store,
// then the scale epilogs from the stored int32 sums, a chunk of blocks at a time (token_tile).
// Batches below kMinTokens tokens, and the last n % 16 tokens of a batch, run the AVX-512
// kernel. On the Xeon this was written on, 1 thread, 256 tokens, 14336 x 4096 / 4096 x 14336:
// Q4_0 351 / 350 -> 409 / 478 GOP/s, Q4_1 ~340 / ~350 -> 341-375 / 367-402, Q8_0 372 / 380 ->
// 388 / 442; 8B Q4_1 pp512 23.2 -> 25.3-26.1 tok/s. Without the epilog the tiles alone ran at
// 737-850 GOP/s: the epilog, not the tile unit, is what is left to speed up. On the Xeon VM of a
// later session (vpdpbusd probe 995 GOP/s at 1 thread where that one read 747-868) the gain did
// not reproduce: 512-token prefills alternated in one process, AMX vs AVX-512 tok/s, 1.7B Q4_0
// 115 / 114 (1 thread), 209 / 213 (2), Q4_1 104 / 105, Q8_0 106 / 117 and 216 / 233; 8B Q8_0
// 27.6 / 28.2. Both give the same bits, so which is faster is a question of the host only.
// What bounds it: the per-block scales need every block's 16 x 16 sums out of the tile unit, and
// on that VM a tile store took ~17 cycles, a TDP ~16, the epilog of a block ~28 on the vector
// ports, with no vector load running while a tile store is in flight (token_tile); the TDP
// itself is a small part, and its rate moved by 2x from minute to minute (the tile unit seems
// shared with the host's other guests, as a core's SMT sibling would share it).
#include <immintrin.h>

#include "kernels.h"
#include "tier_scratch.h"

namespace zen5 {
namespace {

constexpr int kTok = 16;             // tokens per tile: A and C rows
// Batches under kMinTokens tokens run the AVX-512 kernel whole. With one 16-token tile and the
// rest on AVX-512, the weights streamed twice (once into the B images, again for the rest), and a
// lone tile's unpacking and tile stores outweighed the vpdpbusd it saved. In-process alternation on
// the Xeon, 1 thread: 1.7B Q4_0 prefill of 16 tokens 80 -> 121 tok/s, 24: 88 -> 107, 31: 91 ->
// 102; V4 Flash's MoE halves in a 512-token prefill (~12 tokens per expert, the busiest ~20)
// 1.30 -> 1.18 ms per token at 1 thread, 0.82 -> 0.74 at 2. Short tiles of 8-15 tokens on AMX
// (tile rows = tokens) made those MoE halves slower still (1.30 -> 1.67). From 32 tokens on, the
// two kernels were within a few percent of each other there (48-512 tokens).
constexpr int kMinTokens = 32;
constexpr size_t kBTile = 8 * 64;    // one block's B image: 8 rows (4 columns each) x 16 rows' 4 bytes

// GCC's tile intrinsics are asm statements that name the tile registers by literal number, and
// only tilestored tells the compiler that it touches memory: this barrier keeps the stores of a
// B image or of the tile configuration ahead of the tile instructions that read them.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// Palette 1. tmm0..tmm3: C, 16 tokens x 16 rows of int32, a block each; tmm4, tmm5: A, 16
// tokens x 32 bytes; tmm6, tmm7: B, 8 x 64 bytes (blocks alternate between tmm4/tmm6 and
// tmm5/tmm7).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

void configure_tiles() {
    TileConfig c;
    for (int i = 0; i < 4; ++i) c.colsb[i] = 64, c.rows[i] = kTok;
    for (int i = 4; i < 6; ++i) c.colsb[i] = QK, c.rows[i] = kTok;
    for (int i = 6; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = QK / 4;
    memory_barrier();
    _tile_loadconfig(&c);
}

// The B images of group g's blocks [b0, b1) into dst, kBTile bytes per block; row j of a block's
// image holds the block's columns 4j..4j+3 (packed step j: for Q4, nibbles of step j % 4).
template <int TYPE>
void unpack_b(const PackedWeights& w, int64_t g, int64_t b0, int64_t b1, int8_t* dst) {
    const __m512i m0f = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8), flip = _mm512_set1_epi8(char(0x80));
    const __m512i e2m1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kE2M1x2));
    for (int64_t b = b0; b < b1; ++b, dst += kBTile) {
        const uint8_t* src = w.at(g, b);
        if constexpr (TYPE == GGML_Q8_0) {
            for (int j = 0; j < 8; ++j)
                _mm512_store_si512(dst + 64 * j, _mm512_xor_si512(_mm512_load_si512(src + 64 * j), flip));
        } else {
            for (int j = 0; j < 4; ++j) {
                const __m512i raw = _mm512_load_si512(src + 64 * j);
                __m512i lo = _mm512_and_si512(raw, m0f), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m0f);
                if constexpr (TYPE == GGML_Q4_0) lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
                if constexpr (TYPE == kTypeMXFP4) lo = _mm512_shuffle_epi8(e2m1, lo), hi = _mm512_shuffle_epi8(e2m1, hi);
                _mm512_store_si512(dst + 64 * j, lo);
                _mm512_store_si512(dst + 64 * (j + 4), hi);
            }
        }
    }
}

// f[i] += the scaled sums of token t0 + i over block b, from the stored accumulator tile c: the
// AVX-512 tile's epilog (kernels_avx512.cpp, group_tile), instruction for instruction.
template <int TYPE>
__attribute__((always_inline)) inline void epilog(__m512 (&f)[kTok], const int32_t* c, const PackedWeights& w, int64_t g, int64_t b,
                   const QuantAct& x, int t0) {
    const uint8_t* sc = w.scale_at(g, b);
    __m512 wd, wm = _mm512_setzero_ps();
    if constexpr (TYPE == kTypeMXFP4) {  // E8M0 bytes: (s - 1) << 23 = 2^(s - 128), half the scale
        const __m128i s8 = _mm_subs_epu8(_mm_loadu_si128((const __m128i*)sc), _mm_set1_epi8(1));
        wd = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(s8), 23));
    } else {
        wd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)sc));
    }
    if constexpr (TYPE == GGML_Q4_1) wm = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(sc + 32)));
    const float* xd = x.d + b * x.ld + t0;
    const float* xds = x.ds + b * x.ld + t0;
#pragma GCC unroll 16
    for (int i = 0; i < kTok; ++i) {
        const __m512i sum = _mm512_load_si512(c + 16 * i);
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(wd, _mm512_set1_ps(xd[i])), f[i]);
        if constexpr (TYPE == GGML_Q4_1) f[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xds[i]), f[i]);
    }
}

// One block's products into tile C (C, A, B: literal numbers, see above): C = A B.
#define ZEN5_PRODUCTS(C, A, B, b)                                                              \
    do {                                                                                       \
        _tile_zero(C);                                                                         \
        _tile_loadd(A, x.q + ((b) * x.ld + t0) * QK, QK);                                      \
        _tile_loadd(B, img + (b) * int64_t(kBTile), 64);                                       \
        if constexpr (TYPE == GGML_Q4_1) _tile_dpbsud(C, A, B); /* signed tokens x unsigned q */ \
        else _tile_dpbssd(C, A, B);                                                            \
    } while (0)

// Group g's rows against tokens [t0, t0 + 16) over blocks [b0, b1) (bimg: their B images). The
// float sums start from part unless b0 == 0 and go back there unless b1 is the last block, as in
// the AVX-512 tile, so the order of the float steps is the same.
// Blocks go in chunks of kChunkBlocks, in two phases: every block's products on the tile unit,
// each stored to its own slot of c, then the epilogs from c in block order. On the Xeon this was
// measured on, a vector load does not run while a tile store is in flight (a loop of 4 tile
// stores and 64 independent loads took the sum of their two times, where tile stores beside FMAs,
// or TDPs beside loads, overlapped), so the epilogs, whose sums are loads, cannot hide behind the
// next blocks' stores; the former schedule (the next quad's products, this quad's epilogs, the next
// quad's stores) ran about 100 cycles per block, near the sum of the two phases plus the waits of
// each quad's loads on the stores before them. Two phases per chunk, alternated in one process
// (1 thread, 512 tokens, GOP/s): 4096 x 4096 Q8_0 444 -> 493, MXFP4 448 -> 491, 4096 x 14336
// Q4_1 399 -> 435, MXFP4 439 -> 489; 32 and 128 tokens +7-21%; 1.7B Llama prefill of 512 tokens
// Q4_0 +13.8% / +3.3% (1 / 2 threads), Q8_0 +10.3% / +15.1%. c stays in L1: tile stores to a
// buffer beyond it took 61-65 cycles each against 17 (standalone loop).
constexpr int kChunkBlocks = 8;
template <int TYPE>
void token_tile(const PackedWeights& w, int64_t g, const QuantAct& x, int t0, const int8_t* bimg, int64_t b0,
                int64_t b1, float* y, int64_t ldy, __mmask16 rows, float* part) {
    alignas(64) int32_t c[kChunkBlocks][kTok * 16];
    __m512 f[kTok];  // in registers: every loop over f is unrolled (else GCC keeps f in memory)
#pragma GCC unroll 16
    for (int i = 0; i < kTok; ++i) f[i] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + 16 * i);
    const int8_t* img = bimg - b0 * int64_t(kBTile);  // block b's image at img + b * kBTile
    for (int64_t bs = b0; bs < b1; bs += kChunkBlocks) {
        const int64_t be = bs + kChunkBlocks < b1 ? bs + kChunkBlocks : b1;
        // four blocks at a time, one accumulator tile each: tiles have no register renaming, so a
        // quad's products reuse the A and B tiles only after the TDP before them read theirs
        for (int64_t b = bs; b < be; b += 4) {
            ZEN5_PRODUCTS(0, 4, 6, b);
            if (b + 1 < be) ZEN5_PRODUCTS(1, 5, 7, b + 1);
            if (b + 2 < be) ZEN5_PRODUCTS(2, 4, 6, b + 2);
            if (b + 3 < be) ZEN5_PRODUCTS(3, 5, 7, b + 3);
            _tile_stored(0, c[b - bs], 64);
            if (b + 1 < be) _tile_stored(1, c[b + 1 - bs], 64);
            if (b + 2 < be) _tile_stored(2, c[b + 2 - bs], 64);
            if (b + 3 < be) _tile_stored(3, c[b + 3 - bs], 64);
        }
        for (int64_t b = bs; b < be; ++b) epilog<TYPE>(f, c[b - bs], w, g, b, x, t0);
    }
#pragma GCC unroll 16
    for (int i = 0; i < kTok; ++i)
        if (b1 == w.blocks) _mm512_mask_storeu_ps(y + (t0 + i) * ldy + g * 16, rows, f[i]);
        else _mm512_store_ps(part + 16 * i, f[i]);
}
#undef ZEN5_PRODUCTS

template <int TYPE>
void matmul_typed(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n, float* y, int64_t ldy) {
    const int64_t g_begin = r0 / 16, g_end = (r1 + 15) / 16;
    const int64_t left = r1 - (g_end - 1) * 16;
    const __mmask16 last = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const int n16 = n / kTok * kTok;
    // spans as on the AVX-512 tier: a span's activations stay in L2 while kSpanRows rows use them
    const int64_t span = int8_span_blocks(w.blocks, n), rg = span == w.blocks ? g_end - g_begin : kSpanRows / 16;
    thread_local Scratch part_scratch, b_scratch;
    float* part = span == w.blocks ? nullptr : part_scratch.get<float>(size_t(rg) * n16 * 16);
    int8_t* bimg = b_scratch.get<int8_t>(size_t(span) * kBTile);
    configure_tiles();
    for (int64_t gb = g_begin; gb < g_end; gb += rg) {
        const int64_t ge = gb + rg < g_end ? gb + rg : g_end;
        for (int64_t b0 = 0; b0 < w.blocks; b0 += span) {
            const int64_t b1 = b0 + span < w.blocks ? b0 + span : w.blocks;
            for (int64_t g = gb; g < ge; ++g) {
                unpack_b<TYPE>(w, g, b0, b1, bimg);
                memory_barrier();
                const __mmask16 rows = g + 1 == g_end ? last : __mmask16(0xFFFF);
                for (int t0 = 0; t0 < n16; t0 += kTok)
                    token_tile<TYPE>(w, g, x, t0, bimg, b0, b1, y, ldy, rows,
                                     part ? part + ((g - gb) * n16 + t0) * 16 : nullptr);
            }
        }
    }
    _tile_release();  // back to the init state: the thread's saved context stays small
}

}  // namespace

void matmul_int8_amx(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n, float* y,
                     int64_t ldy) {
    if (n < kMinTokens) return kernels_avx512()->matmul_int8(w, r0, r1, x, n, y, ldy);
    const int n16 = n / kTok * kTok;
    if (n16 > 0) switch (w.type) {
            case GGML_Q4_0: matmul_typed<GGML_Q4_0>(w, r0, r1, x, n16, y, ldy); break;
            case GGML_Q4_1: matmul_typed<GGML_Q4_1>(w, r0, r1, x, n16, y, ldy); break;
            case GGML_Q8_0: matmul_typed<GGML_Q8_0>(w, r0, r1, x, n16, y, ldy); break;
            case kTypeMXFP4: matmul_typed<kTypeMXFP4>(w, r0, r1, x, n16, y, ldy); break;
        }
    if (n16 < n) {  // the last n % 16 tokens: their columns of QuantAct start n16 tokens in
        const QuantAct rest{x.q + size_t(n16) * QK, x.d + n16, x.c + n16, x.ds + n16, x.cols, x.ld};
        kernels_avx512()->matmul_int8(w, r0, r1, rest, n - n16, y + n16 * ldy, ldy);
    }
}

}  // namespace zen5
