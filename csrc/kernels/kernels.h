// The kernel table: every hot operation of the decoder, in one version per ISA tier: a scalar
// reference (kernels_ref.cpp, the spec), AVX2 (kernels_avx2.cpp, built twice: AVX2+FMA+F16C, and
// again with AVX-VNNI as avx2vnni), AVX-512 (kernels_avx512.cpp) and AMX (kernels_amx.cpp: the
// AVX-512 table with the int8 prefill matmul on AMX tiles); each SIMD tier is a translation unit
// of its own with its own flags. The best tier this CPU, OS and build support is chosen once at
// import from CPUID + XCR0 (cpu_features.cpp), or forced with
// ZEN5_FORCE_ISA=ref|avx2|avx2vnni|avx512|amx. Nothing else in the engine calls SIMD intrinsics, so
// the rest of the code builds for any x86-64 or ARM target.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace zen5 {

// GGML type ids, as stored in GGUF files, then the official DeepSeek V4 checkpoint's formats
// (zen5's own ids, never in a GGUF; spec deepseek-v4-architecture.md 4.3), whose E8M0 scales
// (one byte, value 2^(s - 127)) come in a tensor of their own, WeightView::scales:
//   kTypeFP8    e4m3 bytes, (rows, cols), one scale per 128 x 128 block: (ceil(rows/128), ceil(cols/128))
//   kTypeMXFP4  e2m1 codes two per byte, the even element in the low nibble, bit 3 the sign,
//               (rows, cols / 2) bytes, one scale per 32 of a row: (rows, cols / 32)
enum GgmlType : int {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_BF16 = 30,
    kTypeFP8 = 1000, kTypeMXFP4 = 1001,
};

// e4m3 (no infinities; 0x7F / 0xFF are NaN, read as 0 here: never in a weight) and e2m1 values.
inline float e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float mag = e ? float(8 + m) * float(1 << e) / 1024.0f  // (1 + m/8) 2^(e-7)
                        : float(m) / 512.0f;                      // m/8 2^-6
    return (b & 0x7F) == 0x7F ? 0.0f : (b & 0x80 ? -mag : mag);
}
// Half an E8M0 scale, 2^(s - 128), as the MXFP4 int8 kernels apply it to twice the e2m1 value;
// s <= 1 reads as 0 (what a vector (s - 1) << 23 with saturation gives; 2^-127 never matters).
inline float e8m0_half(uint8_t s) {
    uint32_t bits = s > 1 ? uint32_t(s - 1) << 23 : 0;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
// Twice the e2m1 value of a code: integers, so the MXFP4 int8 kernels multiply them exactly.
constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

constexpr int QK = 32;  // elements per quantized block (Q4_0, Q4_1, Q8_0)

// Bytes per row of `cols` elements in GGML's block layout, or 0 for an unsupported type.
size_t row_bytes(int type, int64_t cols);
const char* type_name(int type);

struct PackedWeights;
struct FloatPanels;

// A weight matrix used in place: (rows, cols) in GGML block layout, rows contiguous.
// Quantized matrices also carry an int8-friendly repacked copy and float ones a panel copy
// (both below) that the AVX-512 matmuls use.
struct WeightView {
    const uint8_t* data = nullptr;
    int type = GGML_F32;
    int64_t rows = 0, cols = 0;
    size_t row_bytes = 0;
    const PackedWeights* packed = nullptr;
    const FloatPanels* panels = nullptr;
    const uint8_t* scales = nullptr;  // kTypeFP8 / kTypeMXFP4: the E8M0 scale tensor (see GgmlType)
    const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
};

// F32 / F16 / BF16 weights repacked at load for the AVX-512 float matmul: rows in bands of 64
// (4 groups of 16, one zmm lane per row); a band's columns come in steps, each step holding
// the 4 groups' weights side by side:
//   BF16  a step is a column pair; per group 64 bytes, lane i = bf16(row i, column 2s) in the
//         low half and bf16(row i, column 2s + 1) in the high half, so one shift or one mask
//         widens either column to fp32 (an odd last column is paired with zeros)
//   F16   a step is one column; per group 32 bytes (16 halves)
//   F32   a step is one column; per group 64 bytes
// Rows past the end (in the last band) are zero. With rows in the lanes a GEMM tile needs no
// horizontal sums: a tile of 64 rows x 6 tokens keeps 24 accumulators, each weight vector
// feeds 6 FMAs and each token's value is one broadcast (BF16 prefill's fraction of the FMA
// peak before and after this tile replaced a row-major dot-product tile, commit c77fd7c: the
// BF16 rows' frac_peak in bench/results/Intel_Xeon_Processor-bench.csv).
constexpr int kPanelRows = 64;
struct FloatPanels {
    int type = GGML_BF16;
    int64_t rows = 0, cols = 0, bands = 0, steps = 0;
    size_t group_bytes = 0;          // 64, or 32 for F16
    const uint8_t* data = nullptr;   // (bands, steps, 4, group_bytes), 64-byte aligned
    const uint8_t* band(int64_t b) const { return data + size_t(b) * steps * 4 * group_bytes; }
};
size_t float_panel_bytes(int type, int64_t rows, int64_t cols);  // 0 for types that are not float

// Q4_0 / Q4_1 / Q8_0 weights repacked at load for int8 dot products (vpdpbusd): rows in
// groups of 16 (one zmm lane per row). Each (group, 32-column block) has a payload of chunks of
// 64 bytes = 16 rows x 4 bytes, unsigned:
//                Q4_*: 4 chunks; chunk j holds packed bytes qs[4j..4j+3], whose low nibbles
//                      are elements 4j..4j+3 and high nibbles elements 16+4j..16+4j+3
//                Q8_0: 8 chunks; chunk j holds elements 4j..4j+3 plus 128 (made unsigned)
// and scales, in a second array with the same (group, block) order:
//   fp16 d[16]   the rows' block scales                                  32 bytes
//   fp16 m[16]   the rows' block minimums (Q4_1 only)                    32 bytes
// The weight of an element is (u - 8) d for Q4_0, u d + m for Q4_1, (u - 128) d for Q8_0.
// DeepSeek V4's formats: kTypeFP8 is re-quantized at load to Q8_0 (per row and 32 columns, d =
// max|w| / 127 of the exactly decoded e4m3 values; PackedWeights::type is then GGML_Q8_0), and
// kTypeMXFP4 keeps its codes in the Q4 payload layout (u = the e2m1 code) with its E8M0 bytes as
// the scales, 16 bytes per (group, block): the weight is kE2M1x2[u] / 2 2^(s - 127). The stream
// is then the file's bytes exactly (16 payload + 1 scale byte per row and 32 columns).
// Payloads and scales are apart so that every payload stays 64-byte aligned while a block
// carries only the scales its type has: the decode stream is the file's bytes (Q8_0 inline
// with an unused m field streamed 6% more, Q4_0 11% more).
struct PackedWeights {
    int type = GGML_Q8_0;
    int64_t rows = 0, cols = 0, groups = 0, blocks = 0;
    size_t block_bytes = 0;             // payload bytes per (group, block): 256 or 512
    size_t scale_bytes = 0;             // 32 (d), 64 (Q4_1: d, m) or 16 (MXFP4: E8M0 bytes)
    const uint8_t* data = nullptr;      // (groups, blocks, block_bytes), 64-byte aligned
    const uint8_t* scales = nullptr;    // (groups, blocks, scale_bytes), 32-byte aligned
    const uint8_t* at(int64_t g, int64_t b) const { return data + (size_t(g) * blocks + b) * block_bytes; }
    const uint8_t* scale_at(int64_t g, int64_t b) const { return scales + (size_t(g) * blocks + b) * scale_bytes; }
};
size_t packed_payload_bytes(int type);  // 256 for Q4_* and MXFP4, 512 for Q8_0 and FP8, 0 if not packable

// Activations quantized to int8 per 32-value block, stored block-major so a GEMM tile finds
// its tokens' data for one block side by side (one pointer per block, constant offsets per
// token): token t's block b is q[(b*ld + t)*32 ..], with scale d[b*ld + t], the integer
// correction c[b*ld + t] = -128 * sum(q) (Q8_0 weights are stored as u = w + 128, so
// sum((u - 128) q) = sum(u q) + c; Q4_0 uses c / 16) and ds[b*ld + t] = d * sum(q) (the Q4_1
// minimum's factor). Both are precomputed so the GEMM broadcasts them from memory.
struct QuantAct {
    const int8_t* q;
    const float* d;
    const int32_t* c;
    const float* ds;
    int64_t cols;
    int64_t ld;  // tokens between consecutive blocks of one token
};

// The K cache holds keys in tiles of kKeyTile positions, transposed: channel c of position p
// (c < kv_dim, the tile's width: one kv head's channels in the KV cache, kv_cache.h) is element
// ((p / kKeyTile) * kv_dim + c) * kKeyTile + p % kKeyTile. One load gives a channel for 16
// positions, so a score kernel keeps positions in the lanes and needs no horizontal sums (V
// stays row-major: the value kernels keep output channels in the lanes).
constexpr int kKeyTile = 16;
// Cache positions per attention split (the decoder's unit of attention work, whole key tiles;
// 256 -> 512: half the merges and per-split query work, faster long prefill with the f16 and
// q8_0 caches, A/B in commit 50a8ee4). Its score rows are kAttnSplit floats apart, and the
// values kernel specializes on that stride.
constexpr int kAttnSplit = 512;
inline size_t key_tile_index(int64_t pos, int64_t channel, int64_t kv_dim) {
    return size_t((pos / kKeyTile) * kv_dim + channel) * kKeyTile + size_t(pos % kKeyTile);
}
// Copies n positions between (n, kv_dim) rows and key tiles, in either direction.
template <typename T>
void copy_key_tiles(T* tiles, T* rows, int n, int kv_dim, bool to_rows) {
    for (int p = 0; p < n; ++p) {
        T* tile = tiles + key_tile_index(p, 0, kv_dim);
        T* row = rows + size_t(p) * kv_dim;
        if (to_rows)
            for (int i = 0; i < kv_dim; ++i) row[i] = tile[i * kKeyTile];
        else
            for (int i = 0; i < kv_dim; ++i) tile[i * kKeyTile] = row[i];
    }
}

// The q8_0 KV cache (kv type q8_0) keeps each position's hd values of a kv head as int8 with one
// fp32 scale (quantize_s8), laid out for vpdpbusd, which sums 4 byte products per 32-bit lane:
//  K: tiles of kKeyTile positions like the float caches (a tile is kv_dim x 16 bytes; in the
//     KV cache kv_dim is one kv head's hd, kv_cache.h), but inside a tile the channels come in
//     quads, so a lane (a position) holds 4 consecutive channels: channel c of position p is
//     byte (c / 4) * 64 + (p % 16) * 4 + c % 4 of its tile. Keys are stored unsigned, k + 128
//     (vpdpbusd's unsigned operand; the query is the signed one).
//  V: quads of 4 positions, so a lane (an output channel) holds 4 consecutive positions:
//     channel c of position p is byte (p / 4) * kv_dim * 4 + c * 4 + p % 4, signed.
inline size_t key_q8_index(int64_t pos, int64_t channel, int64_t kv_dim) {
    return size_t((pos / kKeyTile) * kv_dim * kKeyTile + (channel / 4) * 64 + (pos % kKeyTile) * 4 + channel % 4);
}
inline size_t value_q8_index(int64_t pos, int64_t channel, int64_t kv_dim) {
    return size_t((pos / 4) * kv_dim * 4 + channel * 4 + pos % 4);
}
// q[0:n] = round(x / d) with d = max|x| / 127 (round half to even; all zero when x is); returns
// d and sets *sum = sum of q. One definition (kernels_ref.cpp, no FMA contraction) serves the
// cache store and both kernel tables, so every path quantizes to the same bytes.
float quantize_s8(const float* x, int n, int8_t* q, int32_t* sum);

// log2(e): attention scales its scores by it so that softmax_partial's exp2 computes e^x
constexpr float kLog2e = 1.4426950408889634f;

struct Kernels {
    const char* name;
    // y[t*ldy + r] = dot(W[r, :], x[t*ldx : t*ldx + cols]) for r in [r0, r1), t in [0, n).
    // The accumulation order for one (t, r) does not depend on n, so a batch of tokens gives
    // the same bits as the tokens one by one. For F32/F16/BF16 the AVX-512 version reads
    // w.panels (r0 a multiple of kPanelRows; one FMA chain per (t, r), columns in order) and
    // falls back to the reference without them; the reference reads the rows.
    void (*matmul)(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n,
                   int64_t ldx, float* y, int64_t ldy);
    // dst[0:n] = dequantized first n elements of one row (n % 32 == 0 for quantized types).
    void (*dequant_row)(int type, const uint8_t* src, int64_t n, float* dst);
    float (*dot)(const float* a, const float* b, int64_t n);
    void (*axpy)(float a, const float* x, float* y, int64_t n);  // y += a * x
    void (*add)(float* y, const float* x, int64_t n);            // y += x
    // out = x / sqrt(mean(x^2) + eps) * w
    void (*rmsnorm)(const float* x, const float* w, int64_t n, float eps, float* out);
    // out = silu(g) * u
    void (*swiglu)(const float* g, const float* u, int64_t n, float* out);
    // Attention scores of nq queries (q + j*hd) against positions 0..n-1 of one head's keys:
    // out[j*ldo + i] = (sum over d = 0..hd-1, in order, of q[j][d] * key_i[d]) * scale.
    // Keys are stored in tiles of kKeyTile positions, transposed (see kKeyTile): k points at the
    // head's first channel in the tile of position 0, and tile t starts tstride elements later.
    // A score is one chain over d with the positions in the lanes, so it does not depend on nq,
    // on which other queries share the call, or on n: batches equal queries one by one.
    void (*attn_scores)(const float* q, int nq, const float* k, int64_t tstride, int n, int hd, float scale,
                        float* out, int64_t ldo);
    // Quantize n rows of x (n, cols) per 32-block into QuantAct's block-major layout with token
    // stride ld (token t, block b at index b*ld + t): d = max|x|/127, q = round(x/d),
    // c = -128 * sum(q), ds = d * float(sum(q)).
    void (*quantize_act)(const float* x, int n, int64_t cols, int64_t ld, int8_t* q, float* d, int32_t* c, float* ds);
    // y[t*ldy + r] = sum over blocks of the int8 dot of packed row r and token t, scaled, for
    // r in [r0, r1) (r0 a multiple of 16) and t in [0, n).
    void (*matmul_int8)(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n,
                        float* y, int64_t ldy);
    // The same two attention kernels over an fp16 cache (the fast path stores K/V in fp16).
    void (*attn_scores_h)(const float* q, int nq, const uint16_t* k, int64_t tstride, int n, int hd, float scale,
                          float* out, int64_t ldo);
    void (*attn_values_h)(const float* p, int64_t ldp, int nq, const uint16_t* v, int64_t stride, int n, int hd,
                          float* out, int64_t ldo);
    // out[0:n] = fp16(x[0:n]), round to nearest even
    void (*to_f16)(const float* x, int64_t n, uint16_t* out);
    // x[0:n] = 2^(x[0:n] - m) in place with m = max(x[0:n]) (n >= 1); *max = m; returns the
    // sum of the new x (an unnormalized softmax: attention merges these per cache split). Base 2
    // because the decoder folds log2(e) into the score scale: exp2 needs no range-reduction
    // multiply, and e^(s - m) = 2^(s log2(e) - m log2(e)).
    float (*softmax_partial)(float* x, int n, float* max);
    // For each of nq queries j: out[j*ldo + 0:hd] += sum_i p[j*ldp + i] * v[i*stride : +hd], one
    // chain per output value in position order (rows of V are not tiled). Like the scores, a
    // query's result does not depend on nq, and a call over positions [0, a) followed by one
    // over [a, n) gives the same bits as one call over [0, n).
    void (*attn_values)(const float* p, int64_t ldp, int nq, const float* v, int64_t stride, int n, int hd,
                        float* out, int64_t ldo);
    // The two attention kernels over the q8_0 cache (layout above key_q8_index): integer dot
    // products (vpdpbusd), then the scales.
    // attn_scores_q8: each query is quantized with quantize_s8 (q8, scale dq, sum s), then
    //   out[j*ldo + i] = (float(sum over d of uk_i[d] * q8[j][d] - 128 s) * ks[i]) * (dq * scale)
    //   with uk the stored (unsigned, k + 128) key bytes; k points at the head's first channel in
    //   the tile of position 0, tstride bytes between tiles.
    // attn_values_q8: positions in blocks of 32 from the first; per block and query the weights
    //   w_i = p[j*ldp + i] * vs[i] are quantized to u8 (d = max w / 255, u = round(w / d)), then
    //   out[j*ldo + c] = out[j*ldo + c] + float(sum over the block of u_i * v_i[c]) * d, block by
    //   block. v points at the head's first channel in the quad of position 0 (a multiple of 4),
    //   qstride bytes between quads. A call over [0, a) then [a, n) with a % 32 == 0 gives the
    //   same bits as one call over [0, n), and a query's bits never depend on the others.
    // Both ISAs compute the same bits (the same integer sums, the float steps in the same order).
    void (*attn_scores_q8)(const float* q, int nq, const uint8_t* k, const float* ks, int64_t tstride, int n,
                           int hd, float scale, float* out, int64_t ldo);
    void (*attn_values_q8)(const float* p, int64_t ldp, int nq, const int8_t* v, const float* vs, int64_t qstride,
                           int n, int hd, float* out, int64_t ldo);
};

const Kernels& kernels_ref();
// Each is nullptr when the build has no such translation unit (non-x86 targets, or a compiler
// without -mavxvnni for avx2vnni).
const Kernels* kernels_avx2();
const Kernels* kernels_avx2vnni();
const Kernels* kernels_avx512();
// avx512's table with matmul_int8_amx (kernels_amx.cpp, the tier's only code) as its int8 matmul.
// The table is assembled in baseline code (cpu_features.cpp): copied in the AMX tier's file, the
// copy was made with zmm moves, before any CPU check, and killed the import on AVX2-only CPUs.
const Kernels* kernels_amx();
void matmul_int8_amx(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n, float* y,
                     int64_t ldy);

// The ISA tiers, worst to best: ref, avx2, avx2vnni, avx512, amx. `missing` is empty when this CPU, OS
// and build can run the tier, else what is missing ("CPU lacks AVX512_VNNI", "OS does not save
// the YMM state", "not built"...).
struct IsaTier {
    const char* name;
    const Kernels* kernels;  // nullptr when missing
    const char* missing;     // "" when supported
};
constexpr int kTierCount = 5;
IsaTier isa_tier(int i);  // i in [0, kTierCount)
bool cpu_supports_avx512();
bool cpu_is_amd() noexcept;  // CPUID vendor "AuthenticAMD": the kernels' software prefetch differs (kernels_avx512.cpp)
// A prefill's int8 matmul sweeps the columns in spans of int8_span_blocks(blocks, n) blocks whose
// quantized activations (n tokens x 44 bytes per block: 32 quants and the d, c, ds scalars) stay
// in L2 while kSpanRows rows use them, the float sums of those rows waiting in a compact
// per-thread buffer between spans (matmul_int8_typed in the SIMD tiers). Without spans each
// 16 or 8 rows streamed all of the activations again, and at 8,192 columns (an FFN down
// projection: 256 tokens x 11 KB) they came from L3, one block's tokens per 4 KB page; the
// sums are kept out of y because a token's row of y is the matrix's width apart, and at 8,192
// rows the lines of a block of y fell into a quarter of the L2's sets. Activations that fit in
// half the L2 are not split (a split of 2,048 columns measured a few percent slower on the
// Xeon); larger ones are cut into equal spans of at most a quarter of it.
constexpr int64_t kSpanRows = 256;
int64_t int8_span_blocks(int64_t blocks, int n) noexcept;
// Chooses the table once: the best supported tier, or ZEN5_FORCE_ISA; throws std::runtime_error
// naming what is missing on a bad request.
const Kernels& select_kernels();
const Kernels& active_kernels();  // the table chosen by select_kernels()
const Kernels& kernels_by_name(const char* name);  // a tier's name; throws if unknown or unsupported

// IEEE half / bfloat16 to float, bit exact (shared by both paths).
inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even, like vcvtps2ph

}  // namespace zen5
