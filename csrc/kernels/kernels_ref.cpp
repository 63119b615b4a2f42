// Scalar reference kernels: plain loops, no SIMD, no fast-math. They are the specification the
// AVX-512 kernels are tested against, and the path every machine can run.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace zen5 {

float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (mant << 13);  // inf / nan
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);  // normal: rebias 15 -> 127
    } else if (mant == 0) {
        u = sign;  // zero
    } else {       // subnormal half: normalize
        exp = 113;
        while (!(mant & 0x400u)) { mant <<= 1; --exp; }
        u = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xFFu;
    uint32_t mant = x & 0x7FFFFFu;
    if (e == 0xFF) return uint16_t(sign | 0x7C00u | (mant ? 0x200u : 0));  // inf / nan
    const int32_t exp = int32_t(e) - 127 + 15;
    if (exp >= 31) return uint16_t(sign | 0x7C00u);                          // overflow: inf
    if (exp <= 0) {                                                          // subnormal or zero
        if (exp < -10) return uint16_t(sign);
        mant |= 0x800000u;
        const int shift = 14 - exp;
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (h & 1))) ++h;
        return uint16_t(sign | h);
    }
    uint32_t h = sign | (uint32_t(exp) << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;  // a carry rounds into the exponent
    return uint16_t(h);
}

size_t row_bytes(int type, int64_t cols) {
    switch (type) {
        case GGML_F32: return size_t(cols) * 4;
        case GGML_F16:
        case GGML_BF16: return size_t(cols) * 2;
        case GGML_Q4_0: return cols % QK ? 0 : size_t(cols / QK) * 18;
        case GGML_Q4_1: return cols % QK ? 0 : size_t(cols / QK) * 20;
        case GGML_Q8_0: return cols % QK ? 0 : size_t(cols / QK) * 34;
        case kTypeFP8: return size_t(cols);
        case kTypeMXFP4: return cols % QK ? 0 : size_t(cols / 2);
        default: return 0;
    }
}

const char* type_name(int type) {
    switch (type) {
        case GGML_F32: return "F32";
        case GGML_F16: return "F16";
        case GGML_BF16: return "BF16";
        case GGML_Q4_0: return "Q4_0";
        case GGML_Q4_1: return "Q4_1";
        case GGML_Q8_0: return "Q8_0";
        case kTypeFP8: return "F8_E4M3";
        case kTypeMXFP4: return "MXFP4";
        default: return "unknown";
    }
}

static inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// One quantized block of 32 values, GGML layouts:
//   Q4_0 {f16 d; u8 qs[16]}        x[j] = ((qs[j] & 15) - 8) * d, x[j+16] = ((qs[j] >> 4) - 8) * d
//   Q4_1 {f16 d; f16 m; u8 qs[16]} x[j] = (qs[j] & 15) * d + m,   x[j+16] = (qs[j] >> 4) * d + m
//   Q8_0 {f16 d; i8 qs[32]}        x[j] = qs[j] * d
static void dequant_block(int type, const uint8_t* b, float* out) {
    const float d = f16_to_f32(rd16(b));
    if (type == GGML_Q4_0) {
        for (int j = 0; j < 16; ++j) {
            out[j] = float(int(b[2 + j] & 15) - 8) * d;
            out[j + 16] = float(int(b[2 + j] >> 4) - 8) * d;
        }
    } else if (type == GGML_Q4_1) {
        const float m = f16_to_f32(rd16(b + 2));
        for (int j = 0; j < 16; ++j) {
            out[j] = float(b[4 + j] & 15) * d + m;
            out[j + 16] = float(b[4 + j] >> 4) * d + m;
        }
    } else {  // Q8_0
        for (int j = 0; j < 32; ++j) out[j] = float(int8_t(b[2 + j])) * d;
    }
}

static size_t block_bytes(int type) { return row_bytes(type, QK); }

static void dequant_row_ref(int type, const uint8_t* src, int64_t n, float* dst) {
    switch (type) {
        case GGML_F32: std::memcpy(dst, src, size_t(n) * 4); return;
        case GGML_F16: for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(rd16(src + 2 * i)); return;
        case GGML_BF16: for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(rd16(src + 2 * i)); return;
        default: {
            const size_t bb = block_bytes(type);
            for (int64_t b = 0; b < n / QK; ++b) dequant_block(type, src + b * bb, dst + b * QK);
        }
    }
}

static void matmul_ref(const WeightView& w, int64_t r0, int64_t r1, const float* x, int n,
                       int64_t ldx, float* y, int64_t ldy) {
    float buf[QK];  // one dequantized block (no allocation in the hot loop)
    const bool quant = w.type == GGML_Q4_0 || w.type == GGML_Q4_1 || w.type == GGML_Q8_0;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.row(r);
        for (int t = 0; t < n; ++t) {
            const float* xt = x + t * ldx;
            float acc = 0.0f;
            if (quant) {
                const size_t bb = block_bytes(w.type);
                for (int64_t b = 0; b < w.cols / QK; ++b) {
                    dequant_block(w.type, row + b * bb, buf);
                    for (int j = 0; j < QK; ++j) acc += buf[j] * xt[b * QK + j];
                }
            } else {
                for (int64_t c0 = 0; c0 < w.cols; c0 += QK) {
                    const int64_t len = w.cols - c0 < QK ? w.cols - c0 : QK;
                    dequant_row_ref(w.type, row + c0 * (w.type == GGML_F32 ? 4 : 2), len, buf);
                    for (int64_t j = 0; j < len; ++j) acc += buf[j] * xt[c0 + j];
                }
            }
            y[t * ldy + r] = acc;
        }
    }
}

static float dot_ref(const float* a, const float* b, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static void axpy_ref(float a, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

static void add_ref(float* y, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

static void rmsnorm_ref(const float* x, const float* w, int64_t n, float eps, float* out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float scale = 1.0f / std::sqrt(ss / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

static void swiglu_ref(const float* g, const float* u, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// Element of channel d of position i in a head's key tiles (kernels.h, kKeyTile).
template <typename T>
static float key_at(const T* k, int64_t tstride, int i, int d) {
    const T x = k[key_tile_index(i, d, tstride / kKeyTile)];
    if constexpr (sizeof(T) == 2) return f16_to_f32(x);
    else return float(x);
}

// ks: the int8 cache's per-position scales (nullptr for float caches)
template <typename T>
static void attn_scores_tiles_ref(const float* q, int nq, const T* k, int64_t tstride, int n, int hd, float scale,
                                  float* out, int64_t ldo, const float* ks = nullptr) {
    for (int j = 0; j < nq; ++j)
        for (int i = 0; i < n; ++i) {
            float acc = 0.0f;
            for (int d = 0; d < hd; ++d) acc += q[j * hd + d] * key_at(k, tstride, i, d);
            out[j * ldo + i] = (ks ? acc * ks[i] : acc) * scale;
        }
}

static void attn_scores_ref(const float* q, int nq, const float* k, int64_t tstride, int n, int hd, float scale,
                            float* out, int64_t ldo) {
    attn_scores_tiles_ref(q, nq, k, tstride, n, hd, scale, out, ldo);
}

static float softmax_partial_ref(float* x, int n, float* max) {
    float mx = x[0];
    for (int i = 1; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
        x[i] = std::exp2(x[i] - mx);
        sum += x[i];
    }
    *max = mx;
    return sum;
}

static void attn_values_ref(const float* p, int64_t ldp, int nq, const float* v, int64_t stride, int n, int hd,
                            float* out, int64_t ldo) {
    for (int j = 0; j < nq; ++j)
        for (int i = 0; i < n; ++i) axpy_ref(p[j * ldp + i], v + i * stride, out + j * ldo, hd);
}

size_t packed_payload_bytes(int type) {
    return type == GGML_Q8_0 || type == kTypeFP8 ? 512
           : type == GGML_Q4_0 || type == GGML_Q4_1 || type == kTypeMXFP4 ? 256 : 0;
}

size_t float_panel_bytes(int type, int64_t rows, int64_t cols) {
    if (type != GGML_F32 && type != GGML_F16 && type != GGML_BF16) return 0;
    const int64_t bands = (rows + kPanelRows - 1) / kPanelRows, steps = type == GGML_BF16 ? (cols + 1) / 2 : cols;
    return size_t(bands) * steps * 4 * (type == GGML_F16 ? 32 : 64);
}

static void quantize_act_ref(const float* x, int n, int64_t cols, int64_t ld, int8_t* q, float* d, int32_t* c,
                             float* ds) {
    const int64_t nb = cols / QK;
    for (int t = 0; t < n; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + t * cols + b * QK;
            const int64_t i = b * ld + t;
            float amax = 0.0f;
            for (int j = 0; j < QK; ++j) amax = std::fabs(xb[j]) > amax ? std::fabs(xb[j]) : amax;
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < QK; ++j) {
                float v = std::nearbyint(xb[j] * id);
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                q[i * QK + j] = int8_t(v);
                sum += int32_t(v);
            }
            d[i] = db;
            c[i] = -128 * sum;
            ds[i] = db * float(sum);
        }
}

// The spec of the int8 path: integer dot per block, then the block's two scales.
static void matmul_int8_ref(const PackedWeights& w, int64_t r0, int64_t r1, const QuantAct& x, int n,
                            float* y, int64_t ldy) {
    const bool q4 = w.type != GGML_Q8_0, fp4 = w.type == kTypeMXFP4;
    // MXFP4: a code u weighs kE2M1x2[u] (twice its value; the 1/2 goes into the scale)
    auto nib = [fp4](int u) { return fp4 ? int32_t(kE2M1x2[u]) : int32_t(u); };
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t g = r / 16, lane = r % 16;
        for (int t = 0; t < n; ++t) {
            float acc = 0.0f;
            for (int64_t b = 0; b < w.blocks; ++b) {
                const uint8_t* pay = w.at(g, b) + lane * 4;
                const uint8_t* sc = w.scale_at(g, b);
                const int64_t i = b * x.ld + t;
                const int8_t* xq = x.q + i * QK;
                int32_t isum = 0;
                for (int j = 0; j < (q4 ? 4 : 8); ++j)
                    for (int k = 0; k < 4; ++k) {
                        const uint8_t u = pay[j * 64 + k];
                        if (q4) isum += nib(u & 15) * xq[4 * j + k] + nib(u >> 4) * xq[16 + 4 * j + k];
                        else isum += int32_t(u) * xq[4 * j + k];
                    }
                if (w.type == GGML_Q4_0) isum += x.c[i] / 16;  // -8 * sum(q)
                if (w.type == GGML_Q8_0) isum += x.c[i];        // -128 * sum(q)
                const float d = fp4 ? e8m0_half(sc[lane]) : f16_to_f32(rd16(sc + 2 * lane));
                acc += float(isum) * (d * x.d[i]);
                if (w.type == GGML_Q4_1) acc += f16_to_f32(rd16(sc + 32 + 2 * lane)) * x.ds[i];
            }
            y[t * ldy + r] = acc;
        }
    }
}

static void attn_scores_h_ref(const float* q, int nq, const uint16_t* k, int64_t tstride, int n, int hd,
                              float scale, float* out, int64_t ldo) {
    attn_scores_tiles_ref(q, nq, k, tstride, n, hd, scale, out, ldo);
}

static void attn_values_h_ref(const float* p, int64_t ldp, int nq, const uint16_t* v, int64_t stride, int n,
                              int hd, float* out, int64_t ldo) {
    for (int j = 0; j < nq; ++j)
        for (int i = 0; i < n; ++i)
            for (int d = 0; d < hd; ++d) out[j * ldo + d] += p[j * ldp + i] * f16_to_f32(v[i * stride + d]);
}

float quantize_s8(const float* x, int n, int8_t* q, int32_t* sum) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    // below 1e-30 (or NaN) the vector counts as zero: 1 / d would overflow for subnormal d
    const float d = amax >= 1e-30f ? amax / 127.0f : 0.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < n; ++i) {
        // adding and removing 1.5 x 2^23 rounds to nearest even (|x id| <= 127 + rounding)
        // without a libm call, so the loop vectorizes on the baseline ISA
        float r = (x[i] * id + 12582912.0f) - 12582912.0f;
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[i] = int8_t(r);
        s += q[i];
    }
    *sum = s;
    return d;
}

static void attn_scores_q8_ref(const float* q, int nq, const uint8_t* k, const float* ks, int64_t tstride, int n,
                               int hd, float scale, float* out, int64_t ldo) {
    const int64_t kv_dim = tstride / kKeyTile;  // key_q8_index's tile is kv_dim x 16 bytes
    std::vector<int8_t> qq(hd);
    for (int j = 0; j < nq; ++j) {
        int32_t s;
        const float c = quantize_s8(q + j * hd, hd, qq.data(), &s) * scale;
        for (int i = 0; i < n; ++i) {
            int32_t isum = 0;
            for (int d = 0; d < hd; ++d) isum += int32_t(k[key_q8_index(i, d, kv_dim)]) * qq[d];
            out[j * ldo + i] = (float(isum - 128 * s) * ks[i]) * c;
        }
    }
}

static void attn_values_q8_ref(const float* p, int64_t ldp, int nq, const int8_t* v, const float* vs,
                               int64_t qstride, int n, int hd, float* out, int64_t ldo) {
    const int64_t kv_dim = qstride / 4;
    for (int j = 0; j < nq; ++j)
        for (int b = 0; b < n; b += 32) {
            const int cnt = n - b < 32 ? n - b : 32;
            float w[32], mx = 0.0f;
            for (int i = 0; i < cnt; ++i) {
                w[i] = p[j * ldp + b + i] * vs[b + i];
                mx = w[i] > mx ? w[i] : mx;
            }
            const float d = mx / 255.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t u[32];
            for (int i = 0; i < cnt; ++i) {
                const float r = std::nearbyint(w[i] * id);
                u[i] = int32_t(r > 255.0f ? 255.0f : r);
            }
            for (int c = 0; c < hd; ++c) {
                int32_t isum = 0;
                for (int i = 0; i < cnt; ++i) isum += u[i] * v[value_q8_index(b + i, c, kv_dim)];
                out[j * ldo + c] = out[j * ldo + c] + float(isum) * d;
            }
        }
}

static void to_f16_ref(const float* x, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(x[i]);
}

const Kernels& kernels_ref() {
    static const Kernels k{"ref", matmul_ref, dequant_row_ref, dot_ref, axpy_ref, add_ref,
                           rmsnorm_ref, swiglu_ref, attn_scores_ref, quantize_act_ref, matmul_int8_ref,
                           attn_scores_h_ref, attn_values_h_ref, to_f16_ref, softmax_partial_ref,
                           attn_values_ref, attn_scores_q8_ref, attn_values_q8_ref};
    return k;
}

}  // namespace zen5
