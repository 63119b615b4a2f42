// The forward pass, read top to bottom like a recipe (llama2.c style): embed, then per layer
// RMSNorm -> q/k/v (+bias, +per-head norm) -> RoPE -> append to cache -> causal attention ->
// output projection + residual -> RMSNorm -> SwiGLU MLP + residual; final norm and the head.
// Prefill runs in chunks of kChunk tokens so every matmul streams a weight row once per chunk.
#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace zen5 {

namespace {
constexpr char kMagic[8] = {'Z', 'E', 'N', '5', 'K', 'V', 0, 1};
constexpr uint32_t kSnapshotVersion = 1;
#ifndef ZEN5_VERSION
#define ZEN5_VERSION "dev"
#endif
// Snapshots are only exchanged between builds with the same KV layout and version.
const uint64_t kBuildId = hash_bytes(ZEN5_VERSION "/kv-4", sizeof(ZEN5_VERSION "/kv-4") - 1, 1);

struct SnapshotHeader {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t build_id;
    uint64_t model_fingerprint;
    uint32_t n_layer, kv_dim, vocab, n_past;
    uint32_t logits_valid;
    uint32_t int8_matmul;  // the K/V values depend on the matmul path
    uint32_t kv_type;      // KvType of the rows
};

}  // namespace

KvType kv_type_from_name(const std::string& name) {
    if (name == "f32") return KvType::F32;
    if (name == "f16") return KvType::F16;
    if (name == "q8_0") return KvType::Q8_0;
    throw ZenError("KV cache type must be f32, f16 or q8_0, got '" + name + "'");
}

const char* kv_type_name(KvType t) {
    return t == KvType::F32 ? "f32" : t == KvType::F16 ? "f16" : "q8_0";
}

Context::Context(std::shared_ptr<const Model> model, int n_ctx, const Kernels* kernels, bool int8_matmul, KvType kv)
    : model_(std::move(model)), k_(kernels ? *kernels : active_kernels()), n_ctx_(n_ctx), int8_(int8_matmul), kv_(kv) {
    const Config& c = model_->cfg;
    if (n_ctx <= 0) throw ZenError("n_ctx must be positive");
    kv_elem_ = kv_ == KvType::F32 ? 4 : kv_ == KvType::F16 ? 2 : 1;
    n_rows_ = (n_ctx + kKeyTile - 1) / kKeyTile * kKeyTile;
    const size_t kv_size = size_t(c.n_layer) * n_rows_ * c.kv_dim() * kv_elem_;
    kcache_ = alloc_zeroed(kv_size);
    vcache_ = alloc_zeroed(kv_size);
    if (kv_ == KvType::Q8_0) {
        // a head starts on a channel quad (key_q8_index); store_kv quantizes a head on the stack
        if (c.head_dim % 4 != 0 || c.head_dim > 512)
            throw ZenError("the q8_0 KV cache needs a head size that is a multiple of 4 and at most 512, not " +
                           std::to_string(c.head_dim));
        kscale_.assign(size_t(c.n_layer) * c.n_head_kv * n_rows_, 0.0f);
        vscale_.assign(kscale_.size(), 0.0f);
    }
    x_.resize(size_t(kChunk) * c.n_embd);
    xb_.resize(size_t(kChunk) * std::max(c.n_embd, c.q_dim()));
    q_.resize(size_t(kChunk) * c.q_dim());
    att_.resize(size_t(kChunk) * c.q_dim());
    kx_.resize(size_t(kChunk) * c.kv_dim());
    vx_.resize(size_t(kChunk) * c.kv_dim());
    gate_.resize(size_t(kChunk) * c.n_ff);
    up_.resize(size_t(kChunk) * c.n_ff);
    const int tb = std::max(kQB / (c.n_head / c.n_head_kv), 1);  // tokens per attention unit
    scores_.resize(size_t(model_->pool.size()) * tb * c.n_head * kSplit);
    qh_.resize(size_t(kChunk) * c.q_dim());
    part_.resize(size_t(kChunk) * c.n_head * ((n_ctx + kSplit - 1) / kSplit) * (c.head_dim + 2));
    pending_.reset(new std::atomic<int>[kChunk]);  // attention units: at most one per token
    logits_.assign(c.vocab_size, 0.0f);
    rope_cs_.resize(size_t(kChunk) * c.head_dim);
    const size_t max_cols = std::max({c.n_embd, c.q_dim(), c.n_ff});
    for (int i = 0; i < 3; ++i) {
        act_q_[i].resize(size_t(kChunk) * max_cols);
        act_d_[i].resize(size_t(kChunk) * max_cols / QK + 1);
        act_c_[i].resize(size_t(kChunk) * max_cols / QK + 1);
        act_ds_[i].resize(size_t(kChunk) * max_cols / QK + 1);
    }
}

void Context::eval(const int32_t* tokens, int n, float* all_logits) {
    const Config& c = model_->cfg;
    if (n <= 0) return;
    if (int64_t(n_past_) + n > n_ctx_)
        throw ContextOverflow("context overflow: " + std::to_string(n_past_) + " cached + " +
                              std::to_string(n) + " new tokens exceed the context of " +
                              std::to_string(n_ctx_) + " tokens");
    for (int i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
            throw ZenError("token id " + std::to_string(tokens[i]) + " is outside the vocabulary (" +
                           std::to_string(c.vocab_size) + ")");
    for (int i = 0; i < n; i += kChunk) {
        const int m = std::min(kChunk, n - i);
        forward_chunk(tokens + i, m, all_logits ? all_logits + size_t(i) * c.vocab_size : nullptr);
    }
    logits_valid_ = true;
}

void Context::rewind(int n, const float* last_logits) {
    if (n < 0 || n > n_past_)
        throw ZenError("rewind(" + std::to_string(n) + ") outside [0, " + std::to_string(n_past_) + "]");
    if (last_logits && n == 0) throw ZenError("rewind(0) has no last position to give logits to");
    if (last_logits) {
        std::memcpy(logits_.data(), last_logits, sizeof(float) * model_->cfg.vocab_size);
        logits_valid_ = true;
    } else if (n != n_past_) {
        logits_valid_ = false;  // the logits of position n-1 are not kept
    }
    n_past_ = n;
}

void Context::matmuls(std::initializer_list<MatJob> jobs, int n) {
    // Quantized matrices multiply int8 activations: quantize each distinct input once.
    QuantAct acts[3];
    const float* quantized[3] = {nullptr, nullptr, nullptr};
    int n_acts = 0;
    int act_of[8] = {-1, -1, -1, -1, -1, -1, -1, -1};  // no allocation per dispatch
    int ji = 0;
    for (const MatJob& j : jobs) {
        if (j.w->packed && int8_) {
            int a = 0;
            while (a < n_acts && quantized[a] != j.x) ++a;
            if (a == n_acts) {
                const int64_t cols = j.w->cols;
                for_tokens(n, [&](int t0, int t1) {
                    k_.quantize_act(j.x + t0 * cols, t1 - t0, cols, n, act_q_[a].data() + t0 * QK, act_d_[a].data() + t0,
                                    act_c_[a].data() + t0, act_ds_[a].data() + t0);
                });
                acts[a] = QuantAct{act_q_[a].data(), act_d_[a].data(), act_c_[a].data(), act_ds_[a].data(), cols, n};
                quantized[a] = j.x, ++n_acts;
            }
            act_of[ji] = a;
        }
        ++ji;
    }
    // Each matrix is cut into contiguous row slices; tasks enumerate (job, slice) pairs. A
    // prefill has several slices per thread, so a slow thread is not the tail.
    const int nt = model_->pool.size();
    int64_t total_rows = 0;
    for (const MatJob& j : jobs) total_rows += j.w->rows;
    // A prefill slice is whole pairs of 16-row groups (the int8 prefill tile covers two; an odd
    // count leaves a slower single-group tile per slice); decode balances 16-row granules.
    // Float weights are read in 64-row bands (FloatPanels), so their slices are whole bands.
    bool bands = false;
    for (const MatJob& j : jobs) bands |= j.w->panels != nullptr;
    const int64_t gran = bands ? kPanelRows : n > 1 ? 32 : 16;
    // Decode and small batches (<= 8 tokens, e.g. a speculative verification): one slice per
    // thread. Their phases last tens of microseconds, and every extra slice is one more claim on
    // the pool's shared counter (a cache line that moves between cores): 4 slices per thread
    // measured 1-6% slower for Q4_1 decode at 2 threads (3 alternating pairs).
    const int per_thread = n > 8 ? 4 : 1;
    const int64_t per = std::max<int64_t>(gran, (total_rows / (nt * per_thread) + gran - 1) / gran * gran);
    // Task t is slice t - first[job] of the job with first[job] <= t < first[job + 1], computed
    // rather than stored: any thread count and shape gets every row (a fixed table of 256 slices
    // once dropped the rows past it from about 74 threads on).
    int first[9] = {0};
    const MatJob* job_of[8];
    ji = 0;
    for (const MatJob& j : jobs) {
        job_of[ji] = &j;
        first[ji + 1] = first[ji] + int((j.w->rows + per - 1) / per);
        ++ji;
    }
    model_->pool.run(first[ji], [&](int t, int) {
        int jj = 0;
        while (t >= first[jj + 1]) ++jj;
        const MatJob& job = *job_of[jj];
        const WeightView& w = *job.w;
        const int64_t r0 = int64_t(t - first[jj]) * per, r1 = std::min(w.rows, r0 + per);
        if (act_of[jj] >= 0) k_.matmul_int8(*w.packed, r0, r1, acts[act_of[jj]], n, job.y, w.rows);
        else k_.matmul(w, r0, r1, job.x, n, w.cols, job.y, w.rows);
    });
}

void Context::for_tokens(int n, const std::function<void(int, int)>& fn) {
    // Per-token work (norms, RoPE, residual adds, activation quantization) is split over the
    // threads for a prefill chunk; for a decoded token a dispatch would cost more than the work.
    const int nt = model_->pool.size();
    if (n < 8 || nt == 1) return fn(0, n);
    model_->pool.run(nt, [&](int part, int) {
        const int t0 = n * part / nt, t1 = n * (part + 1) / nt;
        if (t0 < t1) fn(t0, t1);
    });
}

void Context::rope_table(int n) {
    // cos/sin of pos * inv_freq for the chunk's positions, once per chunk instead of per layer
    const int half = model_->cfg.head_dim / 2;
    for (int t = 0; t < n; ++t)
        for (int i = 0; i < half; ++i) {
            const float angle = float(n_past_ + t) * model_->inv_freq[i];
            rope_cs_[(size_t(t) * half + i) * 2] = std::cos(angle);
            rope_cs_[(size_t(t) * half + i) * 2 + 1] = std::sin(angle);
        }
}

void Context::apply_rope(float* v, int n_heads, const float* cs) const {
    // cs: (head_dim / 2) pairs of cos, sin. neox pairs element i with i + d/2 (HF layout);
    // otherwise adjacent elements 2i, 2i+1 (GGUF llama).
    // (A head at a time with the pairs innermost, so GCC vectorizes both layouts.)
    const int d = model_->cfg.head_dim, half = d / 2;
    const bool neox = model_->cfg.rope_neox;
    for (int h = 0; h < n_heads; ++h) {
        float* p = v + h * d;
        if (neox)
            for (int i = 0; i < half; ++i) {
                const float x0 = p[i], x1 = p[i + half], c = cs[2 * i], s = cs[2 * i + 1];
                p[i] = x0 * c - x1 * s;
                p[i + half] = x0 * s + x1 * c;
            }
        else
            for (int i = 0; i < half; ++i) {
                const float x0 = p[2 * i], x1 = p[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
                p[2 * i] = x0 * c - x1 * s;
                p[2 * i + 1] = x0 * s + x1 * c;
            }
    }
}

size_t Context::kv_bytes_per_token() const {
    const Config& c = model_->cfg;
    return size_t(c.n_layer) * 2 * (size_t(c.kv_dim()) * kv_elem_ + (kv_ == KvType::Q8_0 ? 4 * c.n_head_kv : 0));
}

void Context::store_kv(int layer, int pos, const float* k, const float* v) {
    const int KV = model_->cfg.kv_dim();
    uint8_t* K = const_cast<uint8_t*>(kv_layer(kcache_, layer));
    uint8_t* V = const_cast<uint8_t*>(kv_layer(vcache_, layer));
    if (kv_ == KvType::Q8_0) {  // key_q8_index / value_q8_index layouts (kernels.h)
        const int hd = model_->cfg.head_dim;
        int8_t q[512];
        int32_t sum;
        for (int h = 0; h < model_->cfg.n_head_kv; ++h) {
            vscale_[scale_index(layer, h) + pos] = quantize_s8(v + h * hd, hd, q, &sum);
            for (int i = 0; i < hd; ++i) V[value_q8_index(pos, h * hd + i, KV)] = uint8_t(q[i]);
            kscale_[scale_index(layer, h) + pos] = quantize_s8(k + h * hd, hd, q, &sum);
            for (int i = 0; i < hd; ++i) K[key_q8_index(pos, h * hd + i, KV)] = uint8_t(q[i] + 128);
        }
        return;
    }
    // V is a row; K's channels go to their rows of the position's key tile, kKeyTile apart.
    V += size_t(pos) * KV * kv_elem_;
    const size_t k0 = key_index(pos, 0);
    if (kv_ == KvType::F16) {
        k_.to_f16(v, KV, reinterpret_cast<uint16_t*>(V));
        uint16_t h[64];
        for (int c0 = 0; c0 < KV; c0 += 64) {
            const int m = std::min(64, KV - c0);
            k_.to_f16(k + c0, m, h);
            for (int i = 0; i < m; ++i) reinterpret_cast<uint16_t*>(K)[k0 + size_t(c0 + i) * kKeyTile] = h[i];
        }
    } else {
        std::memcpy(V, v, sizeof(float) * KV);
        for (int i = 0; i < KV; ++i) reinterpret_cast<float*>(K)[k0 + size_t(i) * kKeyTile] = k[i];
    }
}

static_assert(Context::kSplit % kKeyTile == 0, "a split starts on a key tile");

void Context::attention(int layer, int n) {
    // Causal attention for the n new tokens at positions n_past_ .. n_past_+n-1 (whose k/v are
    // already in the cache). At long context decode is bound by reading K and V, and prefill by
    // the arithmetic. A unit of work is tb = kQB / group of the chunk's tokens: for each kv head
    // its tb x group queries are scored together (each key tile loaded once for all of them,
    // positions in the lanes) and summed together (each value row loaded once). The cache is
    // cut into splits of kSplit positions, and a task is one (unit, split); it leaves per query
    // a partial softmax (max, sum of exp, unnormalized output). Splits let a single decoded
    // token use every thread and keep the score rows in L2 at any context length. The task that
    // finishes a unit's last split merges its partials in split order (flash-decoding). A
    // query's arithmetic depends only on its own length, never on the batch or the thread that
    // ran it, so a batch equals the tokens one by one, bit for bit.
    const Config& c = model_->cfg;
    const int hd = c.head_dim, kvd = c.kv_dim(), group = c.n_head / c.n_head_kv;
    const int n_splits_max = (n_ctx_ + kSplit - 1) / kSplit, pstride = hd + 2;
    // scores in base-2 units: softmax_partial and the merge below use exp2 (kernels.h)
    const float scale = 1.4426950408889634f / std::sqrt(float(hd));
    const bool h16 = kv_ == KvType::F16, q8 = kv_ == KvType::Q8_0;
    const uint8_t *K = kv_layer(kcache_, layer), *V = kv_layer(vcache_, layer);
    const int tb = std::max(1, kQB / group), units = (n + tb - 1) / tb;
    const int64_t tstride = int64_t(kvd) * kKeyTile;  // elements between key tiles
    const int64_t lds = kSplit, ldp = int64_t(n_splits_max) * pstride;  // score rows; partials of a kv head
    auto scores = [&](const float* q, int nq, int kvh, int p0, int cnt, float* out) {  // p0: tile aligned
        const size_t off = key_index(p0, kvh * hd);
        if (h16) k_.attn_scores_h(q, nq, reinterpret_cast<const uint16_t*>(K) + off, tstride, cnt, hd, scale, out, lds);
        else if (q8)  // same offset: a tile-aligned position and a head's first channel
            k_.attn_scores_q8(q, nq, K + off, kscale_.data() + scale_index(layer, kvh) + p0, tstride, cnt, hd, scale,
                              out, lds);
        else k_.attn_scores(q, nq, reinterpret_cast<const float*>(K) + off, tstride, cnt, hd, scale, out, lds);
    };
    auto values = [&](const float* p, int nq, int kvh, int p0, int cnt, float* out) {
        const size_t off = size_t(p0) * kvd + kvh * hd;
        if (h16) k_.attn_values_h(p, lds, nq, reinterpret_cast<const uint16_t*>(V) + off, kvd, cnt, hd, out, ldp);
        else if (q8)  // p0 is a multiple of 32 (below)
            k_.attn_values_q8(p, lds, nq, reinterpret_cast<const int8_t*>(V) + value_q8_index(p0, kvh * hd, kvd),
                              vscale_.data() + scale_index(layer, kvh) + p0, int64_t(kvd) * 4, cnt, hd, out, ldp);
        else k_.attn_values(p, lds, nq, reinterpret_cast<const float*>(V) + off, kvd, cnt, hd, out, ldp);
    };
    auto len_of = [&](int t) { return n_past_ + t + 1; };  // positions token t attends to
    auto partial = [&](int t, int kvh, int split) {  // the first of token t's queries on kv head kvh
        return part_.data() + ((size_t(kvh) * kChunk + t) * group * n_splits_max + split) * pstride;
    };
    const int splits = (n_past_ + n + kSplit - 1) / kSplit;  // of the last token
    // A decoded token's tasks, or a batch of one unit's (a speculative verification), are
    // (split, kv head): under 2 x kSplit positions a split per task would leave a thread idle.
    // Prefill has units enough. (Which task computes what never changes the arithmetic.)
    const int kvt = units == 1 ? c.n_head_kv : 1, heads = c.n_head_kv / kvt;
    for (int u = 0; u < units; ++u) {
        const int t1 = std::min(n, (u + 1) * tb);
        pending_[u].store((len_of(t1 - 1) + kSplit - 1) / kSplit * kvt, std::memory_order_relaxed);
    }
    // split-major: the two threads work on neighbouring cache positions
    model_->pool.run(units * splits * kvt, [&](int task, int thread) {
        const int u = task % units, split = task / units / kvt, h0 = task / units % kvt * heads, h1 = h0 + heads;
        const int t0 = u * tb, t1 = std::min(n, t0 + tb), nq = (t1 - t0) * group;
        const int c0 = split * kSplit, c1 = std::min(c0 + kSplit, len_of(t1 - 1));
        if (c0 >= c1) return;  // no token of this unit reaches this split
        auto cnt_of = [&](int t) { return std::min(len_of(t), c1) - c0; };  // <= 0: t ends before c0
        // positions every token of the unit sees; q8_0 values quantize the weights per 32
        // positions, so there the shared call stops at a multiple of 32 (the tokens' own calls
        // then start on a block, and a token's blocks are the same as when it runs alone)
        const int common = q8 ? std::max(0, cnt_of(t0)) / 32 * 32 : std::max(0, cnt_of(t0));
        float* S = scores_.data() + size_t(thread) * tb * c.n_head * kSplit;  // (n_head_kv, tb x group, kSplit)
        auto srow = [&](int kvh, int t) { return S + (size_t(kvh) * tb + (t - t0)) * group * kSplit; };
        for (int kvh = h0; kvh < h1; ++kvh)  // the kv head's queries of the unit, side by side
            scores(qh_.data() + (size_t(kvh) * kChunk + t0) * group * hd, nq, kvh, c0, c1 - c0, srow(kvh, t0));
        for (int t = t0; t < t1; ++t) {
            const int cnt = cnt_of(t);
            for (int kvh = h0; cnt > 0 && kvh < h1; ++kvh)
                for (int g = 0; g < group; ++g) {
                    float* P = partial(t, kvh, split) + size_t(g) * ldp;
                    P[1] = k_.softmax_partial(srow(kvh, t) + size_t(g) * kSplit, cnt, &P[0]);
                    std::memset(P + 2, 0, sizeof(float) * hd);
                }
        }
        for (int kvh = h0; kvh < h1; ++kvh) {
            // positions all of the unit's tokens see, then each token's own remainder (the
            // diagonal): a query's sum runs over its positions in order either way
            if (common > 0) values(srow(kvh, t0), nq, kvh, c0, common, partial(t0, kvh, split) + 2);
            for (int t = t0; t < t1; ++t)
                if (cnt_of(t) > common)
                    values(srow(kvh, t) + common, group, kvh, c0 + common, cnt_of(t) - common, partial(t, kvh, split) + 2);
        }
        if (pending_[u].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
        for (int t = t0; t < t1; ++t)  // the unit's last split: merge in split order
            for (int h = 0; h < c.n_head; ++h) {
                const float* P0 = partial(t, h / group, 0) + size_t(h % group) * ldp;
                const int ns = (len_of(t) + kSplit - 1) / kSplit;
                float mx = P0[0];
                for (int s = 1; s < ns; ++s) mx = std::max(mx, P0[size_t(s) * pstride]);
                float* out = att_.data() + (size_t(t) * c.n_head + h) * hd;
                std::memset(out, 0, sizeof(float) * hd);
                float sum = 0.0f;
                for (int s = 0; s < ns; ++s) {
                    const float* P = P0 + size_t(s) * pstride;
                    const float w = std::exp2(P[0] - mx);
                    sum += P[1] * w;
                    k_.axpy(w, P + 2, out, hd);
                }
                const float inv = 1.0f / sum;
                for (int d = 0; d < hd; ++d) out[d] *= inv;
            }
    });
}

void Context::forward_chunk(const int32_t* tokens, int n, float* all_logits) {
    const Model& m = *model_;
    const Config& c = m.cfg;
    const int E = c.n_embd, Q = c.q_dim(), KV = c.kv_dim(), F = c.n_ff, hd = c.head_dim, group = c.n_head / c.n_head_kv;

    for (int t = 0; t < n; ++t)  // x: (n, E)
        k_.dequant_row(m.tok_embd.type, m.tok_embd.row(tokens[t]), E, x_.data() + size_t(t) * E);

    rope_table(n);
    float *X = x_.data(), *XB = xb_.data();
    for (int l = 0; l < c.n_layer; ++l) {
        const Layer& L = m.layers[l];
        for_tokens(n, [&](int t0, int t1) {  // (previous layer's residual add,) xb = norm(x)
            for (int t = t0; t < t1; ++t) {
                if (l > 0) k_.add(X + size_t(t) * E, XB + size_t(t) * E, E);
                k_.rmsnorm(X + size_t(t) * E, L.attn_norm, E, c.rms_eps, XB + size_t(t) * E);
            }
        });
        matmuls({{&L.wq, XB, q_.data()},     // (n, Q)
                 {&L.wk, XB, kx_.data()},    // (n, KV)
                 {&L.wv, XB, vx_.data()}},   // (n, KV)
                n);
        for_tokens(n, [&](int t0, int t1) {
            for (int t = t0; t < t1; ++t) {
                float *q = q_.data() + size_t(t) * Q, *k = kx_.data() + size_t(t) * KV, *v = vx_.data() + size_t(t) * KV;
                if (L.bq) { k_.add(q, L.bq, Q); k_.add(k, L.bk, KV); k_.add(v, L.bv, KV); }
                if (L.q_norm) {
                    for (int h = 0; h < c.n_head; ++h) k_.rmsnorm(q + h * hd, L.q_norm, hd, c.rms_eps, q + h * hd);
                    for (int h = 0; h < c.n_head_kv; ++h) k_.rmsnorm(k + h * hd, L.k_norm, hd, c.rms_eps, k + h * hd);
                }
                const float* cs = rope_cs_.data() + size_t(t) * hd;
                apply_rope(q, c.n_head, cs);
                apply_rope(k, c.n_head_kv, cs);
                store_kv(l, n_past_ + t, k, v);
                for (int h = 0; h < c.n_head_kv; ++h)  // attention reads a kv head's queries of a unit in one run
                    std::memcpy(qh_.data() + (size_t(h) * kChunk + t) * group * hd, q + size_t(h) * group * hd,
                                sizeof(float) * group * hd);
            }
        });
        attention(l, n);                            // att: (n, Q)
        matmuls({{&L.wo, att_.data(), XB}}, n);    // (n, E)
        for_tokens(n, [&](int t0, int t1) {  // x += attention; xb = norm(x)
            for (int t = t0; t < t1; ++t) {
                k_.add(X + size_t(t) * E, XB + size_t(t) * E, E);
                k_.rmsnorm(X + size_t(t) * E, L.ffn_norm, E, c.rms_eps, XB + size_t(t) * E);
            }
        });
        matmuls({{&L.gate, XB, gate_.data()},     // (n, F)
                 {&L.up, XB, up_.data()}},        // (n, F)
                n);
        for_tokens(n, [&](int t0, int t1) {
            for (int t = t0; t < t1; ++t)
                k_.swiglu(gate_.data() + size_t(t) * F, up_.data() + size_t(t) * F, F, gate_.data() + size_t(t) * F);
        });
        matmuls({{&L.down, gate_.data(), XB}}, n);  // (n, E); added to x at the next layer's start
    }
    for (int t = 0; t < n; ++t) k_.add(X + size_t(t) * E, XB + size_t(t) * E, E);  // the last layer's MLP
    n_past_ += n;

    // The head: every token's logits when asked for, else only the last token's.
    const int first = all_logits ? 0 : n - 1;
    for (int t = first; t < n; ++t)
        k_.rmsnorm(x_.data() + size_t(t) * E, m.output_norm, E, c.rms_eps, xb_.data() + size_t(t - first) * E);
    for (int t0 = first; t0 < n; t0 += 8) {  // (<=8, vocab) at a time: the head streams once per 8 tokens
        const int cnt = std::min(8, n - t0);
        float* dst = all_logits ? all_logits + size_t(t0) * c.vocab_size : logits_.data();
        matmuls({{&m.output, xb_.data() + size_t(t0 - first) * E, dst}}, cnt);
    }
    if (all_logits)
        std::memcpy(logits_.data(), all_logits + size_t(n - 1) * c.vocab_size, sizeof(float) * c.vocab_size);
}

void Context::copy_rows(int layer, char* krows, char* vrows, bool to_rows) const {
    // A snapshot stores K and V as plain (n_past, kv_dim) rows (q8_0: signed bytes): the file
    // does not depend on the cache's layouts, and holds nothing of the positions past n_past.
    const int KV = model_->cfg.kv_dim();
    uint8_t* K = const_cast<uint8_t*>(kv_layer(kcache_, layer));
    uint8_t* V = const_cast<uint8_t*>(kv_layer(vcache_, layer));
    if (kv_ == KvType::Q8_0) {
        auto* kr = reinterpret_cast<int8_t*>(krows);
        auto* vr = reinterpret_cast<int8_t*>(vrows);
        for (int p = 0; p < n_past_; ++p)
            for (int c = 0; c < KV; ++c) {
                uint8_t& kb = K[key_q8_index(p, c, KV)];
                uint8_t& vb = V[value_q8_index(p, c, KV)];
                int8_t& kx = kr[size_t(p) * KV + c];
                int8_t& vx = vr[size_t(p) * KV + c];
                if (to_rows) kx = int8_t(kb - 128), vx = int8_t(vb);
                else kb = uint8_t(kx + 128), vb = uint8_t(vx);
            }
        return;
    }
    const size_t bytes = size_t(n_past_) * KV * kv_elem_;  // V is already rows
    if (to_rows) std::memcpy(vrows, V, bytes);
    else std::memcpy(V, vrows, bytes);
    if (kv_elem_ == 2)
        copy_key_tiles(reinterpret_cast<uint16_t*>(K), reinterpret_cast<uint16_t*>(krows), n_past_, KV, to_rows);
    else
        copy_key_tiles(reinterpret_cast<float*>(K), reinterpret_cast<float*>(krows), n_past_, KV, to_rows);
}

std::string Context::snapshot() const {
    const Config& c = model_->cfg;
    SnapshotHeader h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kSnapshotVersion;
    h.header_bytes = sizeof(SnapshotHeader);
    h.build_id = kBuildId;
    h.model_fingerprint = model_->fingerprint;
    h.n_layer = c.n_layer;
    h.kv_dim = c.kv_dim();
    h.vocab = c.vocab_size;
    h.n_past = n_past_;
    h.logits_valid = logits_valid_;
    h.int8_matmul = int8_;
    h.kv_type = uint32_t(kv_);
    const size_t rows = size_t(n_past_) * c.kv_dim() * kv_elem_;
    std::string out;
    out.reserve(sizeof h + n_past_ * kv_bytes_per_token() + logits_.size() * 4 + 8);
    out.append(reinterpret_cast<const char*>(&h), sizeof h);
    auto append_scales = [&](const std::vector<float>& s, int l) {  // q8_0: (n_head_kv, n_past) f32
        for (int kvh = 0; kvh < c.n_head_kv; ++kvh)
            out.append(reinterpret_cast<const char*>(s.data() + scale_index(l, kvh)), sizeof(float) * n_past_);
    };
    for (int l = 0; l < c.n_layer; ++l) {  // K rows then V rows, (n_past, kv_dim) each
        const size_t at = out.size();
        out.resize(at + 2 * rows);
        copy_rows(l, &out[at], &out[at + rows], true);
        if (kv_ == KvType::Q8_0) append_scales(kscale_, l), append_scales(vscale_, l);
    }
    out.append(reinterpret_cast<const char*>(logits_.data()), logits_.size() * 4);
    const uint64_t sum = hash_bytes(out.data(), out.size(), 42);
    out.append(reinterpret_cast<const char*>(&sum), 8);
    return out;
}

void Context::restore(const std::string& blob) {
    const Config& c = model_->cfg;
    SnapshotHeader h;
    if (blob.size() < sizeof h + 8) throw BadSnapshot("snapshot too short (" + std::to_string(blob.size()) + " bytes)");
    std::memcpy(&h, blob.data(), sizeof h);
    if (std::memcmp(h.magic, kMagic, 8) != 0) throw BadSnapshot("not a zen5 KV snapshot (bad magic)");
    if (h.version != kSnapshotVersion || h.header_bytes != sizeof h)
        throw BadSnapshot("snapshot format version " + std::to_string(h.version) + " is not supported (expected " +
                          std::to_string(kSnapshotVersion) + ")");
    if (h.build_id != kBuildId) throw BadSnapshot("snapshot was written by a different zen5 build");
    if (h.model_fingerprint != model_->fingerprint || h.n_layer != uint32_t(c.n_layer) ||
        h.kv_dim != uint32_t(c.kv_dim()) || h.vocab != uint32_t(c.vocab_size))
        throw ModelMismatch("snapshot belongs to a different model");
    if (h.int8_matmul != uint32_t(int8_))
        throw ModelMismatch(std::string("snapshot was computed with ") + (h.int8_matmul ? "int8" : "f32") +
                            " matmuls; this context uses " + (int8_ ? "int8" : "f32"));
    if (h.kv_type != uint32_t(kv_))
        throw ModelMismatch(std::string("snapshot holds a ") +
                            (h.kv_type <= 2 ? kv_type_name(KvType(h.kv_type)) : "unknown") +
                            " KV cache; this context's is " + kv_type_name(kv_));
    if (h.n_past > uint32_t(n_ctx_))
        throw ContextOverflow("snapshot holds " + std::to_string(h.n_past) + " tokens, more than the context of " +
                              std::to_string(n_ctx_));
    const size_t rows = size_t(h.n_past) * c.kv_dim() * kv_elem_;
    const size_t expect = sizeof h + h.n_past * kv_bytes_per_token() + size_t(c.vocab_size) * 4 + 8;
    if (blob.size() != expect)
        throw BadSnapshot("snapshot is " + std::to_string(blob.size()) + " bytes, expected " + std::to_string(expect));
    uint64_t sum;
    std::memcpy(&sum, blob.data() + blob.size() - 8, 8);
    if (sum != hash_bytes(blob.data(), blob.size() - 8, 42)) throw BadSnapshot("snapshot checksum mismatch (corrupted)");

    const char* p = blob.data() + sizeof h;
    n_past_ = int(h.n_past);  // copy_rows reads it
    for (int l = 0; l < c.n_layer; ++l) {
        copy_rows(l, const_cast<char*>(p), const_cast<char*>(p + rows), false), p += 2 * rows;
        if (kv_ == KvType::Q8_0)
            for (std::vector<float>* s : {&kscale_, &vscale_})
                for (int kvh = 0; kvh < c.n_head_kv; ++kvh)
                    std::memcpy(s->data() + scale_index(l, kvh), p, sizeof(float) * h.n_past), p += sizeof(float) * h.n_past;
    }
    std::memcpy(logits_.data(), p, size_t(c.vocab_size) * 4);
    logits_valid_ = h.logits_valid != 0;
}

}  // namespace zen5
