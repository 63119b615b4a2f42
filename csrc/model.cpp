#include "model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <emmintrin.h>  // SSE2 (every x86-64): the packing's word transposes
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace zen5 {

// 64-bit hash over 8-byte words (multiply-xorshift, four independent lanes for speed). Used for
// model fingerprints and snapshot checksums: collisions only need to be unlikely, not hard.
uint64_t hash_bytes(const void* data, size_t n, uint64_t seed) {
    const uint64_t k = 0x9E3779B97F4A7C15ull;
    uint64_t h[4] = {seed ^ n, seed + k, seed * 3 + 1, ~seed};
    const uint8_t* p = static_cast<const uint8_t*>(data);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        // 2 KiB ahead: a first load hashes the file's bytes from DRAM, and the four multiply
        // chains alone left one stream's misses waiting (standalone, 1 GiB: 6.3 -> 11.3 GB/s;
        // in cache 17 either way). A prefetch past the end is harmless (it never faults).
        if ((i & 63) == 0) __builtin_prefetch(p + i + 2048);
        for (int l = 0; l < 4; ++l) {
            uint64_t w;
            std::memcpy(&w, p + i + 8 * l, 8);
            h[l] = (h[l] ^ w) * k;
            h[l] ^= h[l] >> 29;
        }
    }
    uint64_t out = h[0] ^ (h[1] * 31) ^ (h[2] * 37) ^ (h[3] * 41);
    for (; i < n; ++i) out = (out ^ p[i]) * 0x100000001B3ull;
    out ^= out >> 33;
    return out * k;
}

static std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "(";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + (s.size() == 1 ? ",)" : ")");
}

WeightView Model::matrix(const std::map<std::string, const TensorIn*>& by_name, const std::string& name,
                         int64_t rows, int64_t cols) const {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw BadModel("missing tensor " + name);
    const TensorIn& t = *it->second;
    if (t.shape != std::vector<int64_t>{rows, cols})
        throw BadModel("tensor " + name + " has shape " + shape_str(t.shape) + ", expected " +
                       shape_str({rows, cols}));
    const size_t rb = row_bytes(t.type, cols);
    if (rb == 0)
        throw BadModel("tensor " + name + " has unsupported type " + type_name(t.type) + " (id " +
                       std::to_string(t.type) + ") or a row length not divisible by 32");
    if (t.nbytes != rb * size_t(rows))
        throw BadModel("tensor " + name + " holds " + std::to_string(t.nbytes) + " bytes, expected " +
                       std::to_string(rb * size_t(rows)));
    return WeightView{t.data, t.type, rows, cols, rb};
}

const float* Model::vector_f32(const std::map<std::string, const TensorIn*>& by_name,
                               const std::string& name, int64_t n) const {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw BadModel("missing tensor " + name);
    const TensorIn& t = *it->second;
    if (t.type != GGML_F32 || t.shape != std::vector<int64_t>{n} || t.nbytes != size_t(n) * 4)
        throw BadModel("tensor " + name + " must be F32 of shape " + shape_str({n}) + ", got " +
                       type_name(t.type) + " " + shape_str(t.shape));
    if (reinterpret_cast<uintptr_t>(t.data) % alignof(float))
        throw BadModel("tensor " + name + " is not 4-byte aligned");
    return reinterpret_cast<const float*>(t.data);
}

void AlignedFree::operator()(uint8_t* p) const {
#ifdef __linux__
    if (mapped) {
        munmap(p, mapped);
        return;
    }
#endif
    std::free(p);
}

AlignedBytes alloc_zeroed(size_t bytes, bool huge, bool map) {
    constexpr size_t kHuge = size_t(2) << 20, kLazy = size_t(256) << 10;
#ifdef __linux__
    if (bytes >= kLazy || map) {
        // An anonymous mapping is zero-filled page by page on first touch: no memset, and no
        // resident memory for what is never written (aligned_alloc + memset touched it all; a
        // decode step writes one row of the Context's (chunk, width) scratch). Blocks of 2 MiB
        // and more: over-map by 2 MiB and trim both ends so they start on a huge-page boundary.
        const size_t align = bytes >= kHuge ? kHuge : 4096;
        const size_t total = (bytes + align - 1) / align * align, extra = align == kHuge ? kHuge : 0;
        void* raw = mmap(nullptr, total + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) throw BadModel("out of memory mapping " + std::to_string(bytes) + " bytes");
        const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
        const uintptr_t aligned = (start + align - 1) / align * align;
        if (aligned > start) munmap(raw, aligned - start);
        if (start + extra > aligned) munmap(reinterpret_cast<void*>(aligned + total), start + extra - aligned);
        uint8_t* p = reinterpret_cast<uint8_t*>(aligned);
        // a hint, ignored where THP is off; without `huge`, no huge pages even where THP is
        // "always", so resident memory follows use page by page (the KV cache: hint_huge)
        if (align == kHuge) madvise(p, total, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        AlignedBytes out(p);
        out.get_deleter().mapped = total;
        return out;
    }
#endif
    (void)huge, (void)map;
    const size_t total = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(64, total));
    if (!p) throw BadModel("out of memory allocating " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, total);
    return AlignedBytes(p);
}

FileMaps::FileMaps() {
#ifdef __linux__
    FILE* f = std::fopen("/proc/self/maps", "r");
    if (!f) return;
    char line[4096];
    while (std::fgets(line, sizeof line, f)) {
        unsigned long lo, hi, inode;
        char perms[8];
        if (std::sscanf(line, "%lx-%lx %7s %*s %*s %lu", &lo, &hi, perms, &inode) != 4) continue;
        // read-only and shared: the pages are the file's, never a private copy
        if (inode != 0 && perms[0] == 'r' && perms[1] == '-' && perms[3] == 's') ranges_.emplace_back(lo, hi);
    }
    std::fclose(f);
#endif
}

void FileMaps::advise(const void* p, size_t n, Advice what) const {
#ifdef __linux__
    static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const int advice = what == kDrop ? MADV_DONTNEED : what == kRandom ? MADV_RANDOM
                       : what == kNormal ? MADV_NORMAL : MADV_WILLNEED;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    for (const auto& [lo, hi] : ranges_) {
        if (a >= hi || a + n <= lo) continue;
        const uintptr_t s = std::max(lo, a / page * page), e = std::min(hi, (a + n + page - 1) / page * page);
        if (s < e) madvise(reinterpret_cast<void*>(s), e - s, advice);
    }
#else
    (void)p, (void)n, (void)what;
#endif
}

// Four rows' 16 bytes as a 4 x 4 matrix of 4-byte words, stored transposed: word j of the four
// rows side by side at dst + j * stride. Both repacked layouts put 16 rows' 4-byte words side by
// side; copying them 4 bytes at a time, row by row, was most of a first load's CPU time (8B Q4_1:
// 30% of the samples, beside the kernel's zeroing of the fresh arena pages at 19%).
static inline void store_transposed(const __m128i r[4], uint8_t* dst, size_t stride) {
    const __m128i lo01 = _mm_unpacklo_epi32(r[0], r[1]), lo23 = _mm_unpacklo_epi32(r[2], r[3]);
    const __m128i hi01 = _mm_unpackhi_epi32(r[0], r[1]), hi23 = _mm_unpackhi_epi32(r[2], r[3]);
    const __m128i word[4] = {_mm_unpacklo_epi64(lo01, lo23), _mm_unpackhi_epi64(lo01, lo23),
                             _mm_unpacklo_epi64(hi01, hi23), _mm_unpackhi_epi64(hi01, hi23)};
    for (int j = 0; j < 4; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * stride), word[j]);
}

static inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// A block of MXFP4 pairs (byte i: element 2i low, 2i + 1 high) in the Q4 order the kernels read
// (byte k: element k low, element 16 + k high): split the nibbles, interleave them back into
// element order (elements 0-15, then 16-31), and merge the halves.
static inline __m128i mxfp4_in_q4_order(__m128i x) {
    const __m128i m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    return _mm_or_si128(_mm_unpacklo_epi8(lo, hi), _mm_slli_epi16(_mm_unpackhi_epi8(lo, hi), 4));  // < 16: no carry
}

void pack_float_panels(const WeightView& w, FloatPanels& p, uint8_t* dst, int64_t r0, int64_t r1) {
    p.type = w.type, p.rows = w.rows, p.cols = w.cols;
    p.bands = (w.rows + kPanelRows - 1) / kPanelRows;
    const int per_step = w.type == GGML_BF16 ? 2 : 1;  // columns per step
    const size_t elem = w.type == GGML_F32 ? 4 : 2;
    p.steps = (w.cols + per_step - 1) / per_step;
    p.group_bytes = w.type == GGML_F16 ? 32 : 64;
    p.data = dst;
    // a row's steps are group_bytes * 4 apart; a step holds per_step of its columns side by side,
    // and the 16 rows of a group sit side by side in it. So the rows of one group are copied step
    // by step: each step's bytes are one contiguous run of the destination (row by row, a wide
    // matrix's band of 16 rows is written 4 bytes per cache line per pass, past L2's size).
    const size_t stride = p.group_bytes * 4, step_bytes = per_step * elem;
    const int64_t full = w.cols / per_step, end = r1 < 0 ? w.rows : r1;
    for (int64_t ra = r0; ra < end;) {
        const int64_t rb = std::min(end, (ra / 16 + 1) * 16), band = ra / kPanelRows, group = ra % kPanelRows / 16;
        uint8_t* at = dst + (size_t(band) * p.steps * 4 + group) * p.group_bytes + (ra % 16) * step_bytes;
        const uint8_t* src[16];
        for (int64_t r = ra; r < rb; ++r) src[r - ra] = w.row(r);
        const int n = int(rb - ra);
        auto copy = [&](auto unit, int64_t s) {  // a step's size known to the compiler: moves, not memcpy calls
            for (; s < full; ++s)
                for (int i = 0; i < n; ++i) std::memcpy(at + s * stride + i * sizeof unit, src[i] + s * sizeof unit, sizeof unit);
        };
        if (step_bytes == 4) {
            int64_t s = 0;
            if (n == 16)  // a whole group: 4 steps of 4 rows at a time
                for (; s + 4 <= full; s += 4)
                    for (int i = 0; i < 16; i += 4) {
                        const __m128i r[4] = {load16(src[i] + 4 * s), load16(src[i + 1] + 4 * s),
                                              load16(src[i + 2] + 4 * s), load16(src[i + 3] + 4 * s)};
                        store_transposed(r, at + s * stride + 4 * i, stride);
                    }
            copy(uint32_t{}, s);
        } else {
            copy(uint16_t{}, 0);
        }
        if (full < p.steps)
            for (int i = 0; i < n; ++i)
                std::memcpy(at + full * stride + i * step_bytes, src[i] + full * step_bytes, (w.cols % per_step) * elem);
        ra = rb;
    }
}

static size_t packed_scale_bytes(int type) { return type == GGML_Q4_1 ? 64 : type == kTypeMXFP4 ? 16 : 32; }

// e4m3 byte -> float for all 256 codes (e4m3_to_f32: NaN codes read as 0)
static const float* e4m3_table() {
    static const std::array<float, 256> t = [] {
        std::array<float, 256> a{};
        for (int i = 0; i < 256; ++i) a[size_t(i)] = e4m3_to_f32(uint8_t(i));
        return a;
    }();
    return t.data();
}

// DeepSeek V4's FP8 block of 32 columns (one row) as Q8_0: the e4m3 values times their 128 x 128
// block's E8M0 scale 2^(s - 127), exactly, then d = max|w| / 127 rounded to fp16 (Q8_0 stores
// it so) and q = round(w / d). The error against the exact values is what
// tests/test_dsv4_formats.py measures. Four columns at a time with SSE2 (a table lookup per byte):
// the same IEEE operations as that definition (clamping before the rounding conversion gives what
// rounding, then clamping gives), so the same bits; the scalar loop ran at 0.13 GB/s.
static void fp8_block_to_q8(const WeightView& w, int64_t r, int64_t b, uint16_t* d16, int8_t* q) {
    const float* lut = e4m3_table();
    const uint8_t* src = w.row(r) + b * QK;
    const __m128 s = _mm_set1_ps(std::ldexp(1.0f, int(w.scales[(r / 128) * ((w.cols + 127) / 128) + b * QK / 128]) - 127));
    const __m128 abs = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    __m128 v[QK / 4], amax = _mm_setzero_ps();
    for (int i = 0; i < QK / 4; ++i) {
        const uint8_t* c = src + 4 * i;
        v[i] = _mm_mul_ps(_mm_setr_ps(lut[c[0]], lut[c[1]], lut[c[2]], lut[c[3]]), s);
        amax = _mm_max_ps(amax, _mm_and_ps(v[i], abs));
    }
    amax = _mm_max_ps(amax, _mm_shuffle_ps(amax, amax, _MM_SHUFFLE(1, 0, 3, 2)));
    amax = _mm_max_ps(amax, _mm_shuffle_ps(amax, amax, _MM_SHUFFLE(2, 3, 0, 1)));
    *d16 = f32_to_f16(_mm_cvtss_f32(amax) / 127.0f);
    const float d = f16_to_f32(*d16);
    if (!(d > 0.0f)) {
        std::memset(q, 0, QK);
        return;
    }
    const __m128 vd = _mm_set1_ps(d), hi = _mm_set1_ps(127.0f), lo = _mm_set1_ps(-127.0f);
    __m128i i32[QK / 4];  // round to nearest even (the MXCSR's mode, as nearbyint)
    for (int i = 0; i < QK / 4; ++i) i32[i] = _mm_cvtps_epi32(_mm_min_ps(_mm_max_ps(_mm_div_ps(v[i], vd), lo), hi));
    for (int i = 0; i < QK / 4; i += 4) {
        const __m128i a = _mm_packs_epi32(i32[i], i32[i + 1]), c = _mm_packs_epi32(i32[i + 2], i32[i + 3]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 4 * i), _mm_packs_epi16(a, c));
    }
}

size_t packed_bytes(const WeightView& w) {
    const size_t payload = packed_payload_bytes(w.type);
    return payload ? size_t((w.rows + 15) / 16) * (w.cols / QK) * (payload + packed_scale_bytes(w.type)) : 0;
}

// One whole 16-row group of a Q4_0 / Q4_1 / Q8_0 / MXFP4 matrix, block by block: the payload is
// the transpose of the 16 rows' quant words (store_transposed, four rows at a time).
static void pack_group_words(const WeightView& w, const PackedWeights& p, uint8_t* dst, uint8_t* scales,
                             int64_t g) {
    const size_t bb = row_bytes(w.type, QK);
    const bool mx = w.type == kTypeMXFP4;
    const int qoff = w.type == GGML_Q4_1 ? 4 : mx ? 0 : 2, quads = w.type == GGML_Q8_0 ? 2 : 1;
    const __m128i flip = _mm_set1_epi8(w.type == GGML_Q8_0 ? char(0x80) : 0);  // Q8_0: q + 128 is q ^ 0x80
    const uint8_t* row[16];
    for (int l = 0; l < 16; ++l) row[l] = w.row(16 * g + l);
    for (int64_t b = 0; b < p.blocks; ++b) {
        uint8_t* sc = scales + (size_t(g) * p.blocks + b) * p.scale_bytes;
        uint8_t* pay = dst + (size_t(g) * p.blocks + b) * p.block_bytes;
        for (int l = 0; l < 16; ++l) {
            const uint8_t* src = row[l] + b * bb;
            if (mx) {
                sc[l] = w.scales[(16 * g + l) * p.blocks + b];  // E8M0
                continue;
            }
            std::memcpy(sc + 2 * l, src, 2);                                   // d
            if (w.type == GGML_Q4_1) std::memcpy(sc + 32 + 2 * l, src + 2, 2);  // m
        }
        for (int l = 0; l < 16; l += 4)
            for (int q = 0; q < quads; ++q) {
                __m128i r[4];
                for (int i = 0; i < 4; ++i) {
                    r[i] = _mm_xor_si128(load16(row[l + i] + b * bb + qoff + 16 * q), flip);
                    if (mx) r[i] = mxfp4_in_q4_order(r[i]);
                }
                store_transposed(r, pay + 256 * q + 4 * l, 64);
            }
    }
}

void pack_into(const WeightView& w, PackedWeights& p, uint8_t* dst, int64_t r0, int64_t r1) {
    p.type = w.type == kTypeFP8 ? GGML_Q8_0 : w.type, p.rows = w.rows, p.cols = w.cols;
    p.groups = (w.rows + 15) / 16, p.blocks = w.cols / QK;
    p.block_bytes = packed_payload_bytes(w.type), p.scale_bytes = packed_scale_bytes(w.type);
    uint8_t* scales = dst + size_t(p.groups) * p.blocks * p.block_bytes;  // payloads: a multiple of 64 bytes
    const size_t bb = row_bytes(w.type, QK);
    auto one_row = [&](int64_t r) {
        const int64_t g = r / 16, lane = r % 16;
        for (int64_t b = 0; b < p.blocks; ++b) {
            const uint8_t* src = w.row(r) + b * bb;
            uint8_t* sc = scales + (size_t(g) * p.blocks + b) * p.scale_bytes;
            uint8_t* pay = dst + (size_t(g) * p.blocks + b) * p.block_bytes + 4 * lane;
            uint8_t as_q8[2 + QK];  // FP8: the block re-quantized, then packed as the Q8_0 block it is
            if (w.type == kTypeFP8) {
                uint16_t d;
                fp8_block_to_q8(w, r, b, &d, reinterpret_cast<int8_t*>(as_q8 + 2));
                std::memcpy(as_q8, &d, 2);
                src = as_q8;
            }
            if (w.type == kTypeMXFP4) {  // pairs (even low) -> Q4 order: byte k = element k | element 16+k
                sc[lane] = w.scales[r * p.blocks + b];
                for (int j = 0; j < 4; ++j)
                    for (int k = 0; k < 4; ++k) {
                        const int e = 4 * j + k, f = 16 + e;
                        const int lo = (src[e / 2] >> (4 * (e % 2))) & 15, hi = (src[f / 2] >> (4 * (f % 2))) & 15;
                        pay[64 * j + k] = uint8_t(lo | hi << 4);
                    }
                continue;
            }
            std::memcpy(sc + 2 * lane, src, 2);                                   // d
            if (w.type == GGML_Q4_1) std::memcpy(sc + 32 + 2 * lane, src + 2, 2);  // m
            if (w.type == GGML_Q8_0 || w.type == kTypeFP8) {  // q + 128 as a byte is q ^ 0x80: four at a time
                for (int j = 0; j < 8; ++j) {
                    uint32_t v;
                    std::memcpy(&v, src + 2 + 4 * j, 4);
                    v ^= 0x80808080u;
                    std::memcpy(pay + 64 * j, &v, 4);
                }
            } else {
                const uint8_t* qs = src + (w.type == GGML_Q4_1 ? 4 : 2);
                for (int j = 0; j < 4; ++j) std::memcpy(pay + 64 * j, qs + 4 * j, 4);
            }
        }
    };
    const bool words = w.type == GGML_Q4_0 || w.type == GGML_Q4_1 || w.type == GGML_Q8_0 || w.type == kTypeMXFP4;
    if (r1 < 0) r1 = w.rows;
    for (int64_t r = r0; r < r1;) {  // whole groups by words, a partial one's rows one by one
        if (words && r % 16 == 0 && r + 16 <= r1) pack_group_words(w, p, dst, scales, r / 16), r += 16;
        else one_row(r++);
    }
    p.data = dst;
    p.scales = scales;
}

bool pack_weights(const WeightView& w, PackedWeights& p, AlignedBytes& storage) {
    const size_t n = packed_bytes(w);
    if (n == 0) return false;
    storage = alloc_zeroed(n);  // zero: padding rows of the last group get scale 0
    pack_into(w, p, storage.get());
    return true;
}

void own_layout(WeightView& w, uint8_t* dst, std::vector<std::unique_ptr<PackedWeights>>& packed,
                std::vector<std::unique_ptr<FloatPanels>>& panels) {
    if (packed_bytes(w)) {
        packed.push_back(std::make_unique<PackedWeights>());
        pack_into(w, *packed.back(), dst, 0, 0);  // the fields, no rows
        w.packed = packed.back().get();
    } else {
        panels.push_back(std::make_unique<FloatPanels>());
        pack_float_panels(w, *panels.back(), dst, 0, 0);
        w.panels = panels.back().get();
    }
}

void pack_rows(const WeightView& w, uint8_t* dst, int64_t r0, int64_t r1) {
    // into a scratch header: the view's own is shared by the threads packing its other rows
    if (w.packed) {
        PackedWeights p;
        pack_into(w, p, dst, r0, r1);
    } else {
        FloatPanels p;
        pack_float_panels(w, p, dst, r0, r1);
    }
}

size_t owned_bytes(const WeightView& w) {
    const size_t n = packed_bytes(w);
    return ((n ? n : float_panel_bytes(w.type, w.rows, w.cols)) + 63) / 64 * 64;
}

uint64_t pack_and_hash(const std::map<std::string, const TensorIn*>& by_name, const std::vector<WeightView*>& mats,
                       uint64_t h, AlignedBytes& arena, std::vector<std::unique_ptr<PackedWeights>>& packed,
                       std::vector<std::unique_ptr<FloatPanels>>& panels, ThreadPool& own_pool,
                       int load_threads, ArenaCache& cache, const std::set<const uint8_t*>* sampled) {
    // Every matrix the matmuls read lives in one arena: quantized ones repacked (PackedWeights),
    // F32/F16/BF16 in panels (FloatPanels). One allocation because only a 2 MiB-aligned block
    // gets huge pages, and most matrices here are smaller than 2 MiB (allocated one by one, only
    // the head got them): decode streams every byte once per token, and over 4 KiB pages a BF16
    // GEMV read markedly slower than from huge pages (a standalone sweep, 269 MB of weights; the
    // engine's A/B: commit f402a41).
    //
    // Lean loading: neither layout is the file's (GGUF rows vs 16-row groups / 64-row bands), so
    // no matrix can be used in place; instead the file's pages are dropped as soon as they are
    // copied. The arena is an anonymous mapping touched only as it is filled, and the file is
    // read once, in stripes: hash, pack, release. Peak resident memory is the arena plus one
    // stripe, not the arena plus the file. What stays in place is read from the file's pages
    // later and faults back in on use: the token embedding's rows (one page per distinct token
    // looked up) and the rows of the paths that do not read the arena (the f32 matmul of quantized
    // weights, the reference tier: exact-reference paths, which then hold the file's pages too).
    size_t total = 0;
    std::map<const uint8_t*, std::vector<std::pair<WeightView*, uint8_t*>>> at_of;  // file bytes -> views
    for (const WeightView* w : mats) total += owned_bytes(*w);
    // Zeroed (padding rows of a last group get scale 0) and on 4 KiB pages: packing is the first
    // touch of every arena byte, and on the VM measured a huge page's first touch cost much more
    // than 512 small ones (an AMD EPYC Zen 3 guest, 1 GiB touched in fresh processes 3 s apart:
    // 0.32-0.48 GB/s on huge pages, 1.40-1.63 GB/s on 4 KiB pages; a 1.7B Q4_1 first load at 2
    // threads 2.45-6.93 s against 0.97-1.16 s). Once packed, the arena moves onto huge pages in
    // the background (ArenaCache::start_promotion, as a mapped cache does), which decode wants.
    arena = alloc_zeroed(total, false, true);
    uint8_t* at = arena.get();
    std::vector<std::pair<WeightView*, uint8_t*>> others;  // views of memory that is not a tensor's
    std::map<const uint8_t*, bool> tensor_data;
    for (const auto& [name, t] : by_name) tensor_data[t->data] = true;
    for (WeightView* w : mats) {
        if (tensor_data.count(w->data)) at_of[w->data].emplace_back(w, at);
        else others.emplace_back(w, at);
        own_layout(*w, at, packed, panels);
        at += owned_bytes(*w);
    }
    // A load after the first maps the arena from the cache file (arena_cache.h) instead (the views
    // have their layout's fields already); the fingerprint is the one stored.
    const uint64_t seed = h;
    if (cache.map(arena.get(), arena.get_deleter().mapped, total, seed, h)) return h;
    std::unique_ptr<ThreadPool> wide(load_threads > own_pool.size() ? new ThreadPool(load_threads) : nullptr);
    ThreadPool& pool = wide ? *wide : own_pool;
    for (auto& [w, dst] : others) pack_rows(*w, dst, 0, w->rows);  // owned copies (converted vectors)

    const FileMaps maps;
    // a sampled tensor's ends: the reads' fault-around maps up to 64 KiB beside each (590 MB over
    // V4 Flash's first 3 layers), and so does a neighbour's last stripe
    auto release_ends = [&](const TensorIn* t) {
        const size_t near = std::min<size_t>(128 << 10, t->nbytes);
        maps.release(t->data, near);
        maps.release(t->data + t->nbytes - near, near);
    };
    constexpr size_t kStripe = size_t(4) << 20;  // file bytes per step
    for (const auto& [name, t] : by_name) {
        h = hash_bytes(name.data(), name.size(), h);
        h = hash_bytes(&t->type, sizeof t->type, h);
        h = hash_bytes(t->shape.data(), t->shape.size() * 8, h);
        if (sampled && sampled->count(t->data)) {
            // the samples are read sparsely: with the mapping's read-around, the two faults of
            // each routed expert's tensors read most of them (a fault reads read_ahead_kb around
            // it; 8 MiB on the Zen 3 VM, where opening V4 Flash's first 3 layers put 12.5 GB of
            // the file into the page cache and took 54-164 s; read sparsely, 2.7 GB and 13-35 s)
            const size_t k = std::min<size_t>(256, t->nbytes);
            const uint8_t* ends[] = {t->data, t->data + t->nbytes - k};
            for (const uint8_t* e : ends) maps.read_sparsely(e, k, true);
            h = hash_bytes(ends[0], k, h);
            h = hash_bytes(ends[1], k, h);
            for (const uint8_t* e : ends) maps.read_sparsely(e, k, false);
            release_ends(t);
            continue;
        }
        auto it = at_of.find(t->data);
        if (it == at_of.end()) {  // not a matrix of the arena: hash it and drop its pages
            StreamHash sh(h, t->nbytes);
            for (size_t o = 0; o < t->nbytes; o += kStripe) {
                const size_t n = std::min(kStripe, t->nbytes - o);
                sh.update(t->data + o, n);
                maps.release(t->data + o, n);
            }
            h = sh.finish();
        } else {
            // A matrix enters the hash as the hashes of its 16-row groups, in order: each is
            // hashed by the task that packs it, just before, while its bytes are in L1/L2 (one
            // read of the file instead of two). A task of its own hashing the stripe as a stream
            // beside the packing was as much CPU as the packing once that used word transposes.
            const WeightView& w0 = *it->second.front().first;
            const int64_t groups = (w0.rows + 15) / 16;
            StreamHash sh(h, size_t(groups) * 8);
            std::vector<uint64_t> group_hash;
            const int64_t rows_per = std::max<int64_t>(16, int64_t(kStripe / w0.row_bytes) / 16 * 16);
            for (int64_t r0 = 0; r0 < w0.rows; r0 += rows_per) {
                const int64_t r1 = std::min(w0.rows, r0 + rows_per);
                const uint8_t* src = w0.row(r0);
                const size_t n = size_t(r1 - r0) * w0.row_bytes;
                // the stripe's rows hashed and packed by every thread, 16 at a time (a group: no
                // two threads write one destination block), so the arena's pages are also first
                // touched, and zeroed by the kernel, on every core: both were most of a load's time
                const int tasks = int((r1 - r0 + 15) / 16);
                group_hash.resize(size_t(tasks));
                pool.run(tasks, [&](int t, int) {
                    const int64_t a = r0 + int64_t(t) * 16, b = std::min(r1, a + 16);
                    group_hash[size_t(t)] = hash_bytes(w0.row(a), size_t(b - a) * w0.row_bytes, 0);
                    for (auto& [w, dst] : it->second) pack_rows(*w, dst, a, b);
                });
                sh.update(reinterpret_cast<const uint8_t*>(group_hash.data()), size_t(tasks) * 8);
                maps.release(src, n);
            }
            h = sh.finish();
        }
    }
    // Once more over the whole file, now that nothing reads it: a page fault maps the pages
    // around it that are in the page cache too (fault-around, 64 KiB), so starting on a stripe
    // re-mapped the tail of the one released before it (13 of SmolLM2's 94 MB stayed resident).
    for (const auto& [name, t] : by_name) {
        if (sampled && sampled->count(t->data)) release_ends(t);
        else maps.release(t->data, t->nbytes);
    }
    cache.write(arena.get(), total, seed, h);
    if (transparent_huge_pages()) cache.start_promotion(arena.get(), arena.get_deleter().mapped, total);
    return h;
}

static void check_config(const Config& c) {
    if (c.arch != "llama" && c.arch != "qwen2" && c.arch != "qwen3")
        throw BadModel("unsupported architecture '" + c.arch + "'");
    if (c.n_layer <= 0 || c.n_embd <= 0 || c.n_ff <= 0 || c.n_head <= 0 || c.n_head_kv <= 0 ||
        c.head_dim <= 0 || c.vocab_size <= 0 || c.n_head % c.n_head_kv || c.head_dim % 2)
        throw BadModel("inconsistent model dimensions");
}

Model::Model(Config c, const std::vector<TensorIn>& tensors, std::vector<float> rope_inv_freq, int threads,
             const CacheSpec& cache, int load_threads)
    : cfg(std::move(c)), inv_freq(std::move(rope_inv_freq)), pool(threads), cache_(cache) {
    check_config(cfg);
    if (int(inv_freq.size()) != cfg.head_dim / 2) throw BadModel("rope_inv_freq must have head_dim/2 entries");
    std::map<std::string, const TensorIn*> by_name;
    for (const auto& t : tensors) by_name[t.name] = &t;

    const int64_t E = cfg.n_embd, V = cfg.vocab_size;
    tok_embd = matrix(by_name, "token_embd.weight", V, E);
    output = cfg.tied_output ? tok_embd : matrix(by_name, "output.weight", V, E);
    output_norm = vector_f32(by_name, "output_norm.weight", E);
    for (int i = 0; i < cfg.n_layer; ++i) {
        const std::string p = "blk." + std::to_string(i) + ".";
        Layer L;
        L.attn_norm = vector_f32(by_name, p + "attn_norm.weight", E);
        L.ffn_norm = vector_f32(by_name, p + "ffn_norm.weight", E);
        L.wq = matrix(by_name, p + "attn_q.weight", cfg.q_dim(), E);
        L.wk = matrix(by_name, p + "attn_k.weight", cfg.kv_dim(), E);
        L.wv = matrix(by_name, p + "attn_v.weight", cfg.kv_dim(), E);
        L.wo = matrix(by_name, p + "attn_output.weight", E, cfg.q_dim());
        L.gate = matrix(by_name, p + "ffn_gate.weight", cfg.n_ff, E);
        L.up = matrix(by_name, p + "ffn_up.weight", cfg.n_ff, E);
        L.down = matrix(by_name, p + "ffn_down.weight", E, cfg.n_ff);
        if (cfg.qkv_bias) {
            L.bq = vector_f32(by_name, p + "attn_q.bias", cfg.q_dim());
            L.bk = vector_f32(by_name, p + "attn_k.bias", cfg.kv_dim());
            L.bv = vector_f32(by_name, p + "attn_v.bias", cfg.kv_dim());
        }
        if (cfg.qk_norm) {
            L.q_norm = vector_f32(by_name, p + "attn_q_norm.weight", cfg.head_dim);
            L.k_norm = vector_f32(by_name, p + "attn_k_norm.weight", cfg.head_dim);
        }
        layers.push_back(L);
    }

    std::vector<WeightView*> mats;
    for (Layer& L : layers)
        for (WeightView* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down}) mats.push_back(w);
    mats.push_back(&output);  // when tied, only the head gets a copy; the embedding lookup reads the file
    for (const WeightView* w : mats) arena_bytes_ += owned_bytes(*w);

    // Fingerprint: the configuration, then every tensor the model uses, in name order (hashed
    // while the matrices are packed: one pass over the file, pack_and_hash).
    uint64_t h = hash_bytes(cfg.arch.data(), cfg.arch.size(), 0x7A656E35);
    const int dims[] = {cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim,
                        cfg.vocab_size, cfg.rope_neox, cfg.qkv_bias, cfg.qk_norm, cfg.tied_output};
    h = hash_bytes(dims, sizeof dims, h);
    h = hash_bytes(&cfg.rms_eps, sizeof cfg.rms_eps, h);
    h = hash_bytes(inv_freq.data(), inv_freq.size() * 4, h);
    h = pack_and_hash(by_name, mats, h, arena_, packed_, panels_, pool, load_threads, cache_);
    for (const auto& [name, t] : by_name)
        if (name != "output.weight" || !cfg.tied_output) n_params += t->elements();
    fingerprint = h;
}

}  // namespace zen5
