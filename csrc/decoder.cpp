// The forward pass, read top to bottom like a recipe (llama2.c style): embed, then per layer
// RMSNorm -> q/k/v (+bias, +per-head norm) -> RoPE -> append to the KV cache (kv_cache.cpp) ->
// causal attention (attention.cpp) -> output projection + residual -> RMSNorm -> SwiGLU MLP + residual; final norm and the head.
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

Context::Context(std::shared_ptr<const Model> model, int n_ctx, const Kernels* kernels, bool int8_matmul, KvType kv)
    : model_(std::move(model)), k_(kernels ? *kernels : active_kernels()), n_ctx_(n_ctx), int8_(int8_matmul),
      cache_(model_->cfg, n_ctx, kv) {  // throws when n_ctx is not positive
    const Config& c = model_->cfg;
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
                model_->pool.run_items(n, [&](int64_t t0, int64_t t1) {
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
    // The jobs' rows, in whole granules, are laid end to end and shared out among the threads
    // (ThreadPool::run_shares: each takes its share front to back, then the back of a slower
    // one's); a range may end one matrix and start the next. (Slices of one matrix at a time
    // left decode's q, k and v, three equal matrices, as three tasks for two threads: one
    // thread ran two of them while the other waited.) A part of a matrix is whole pairs of
    // 16-row groups (the int8 tiles cover two; an odd count leaves a slower single-group pass
    // per part); float weights are read in 64-row bands (FloatPanels), so their parts are whole
    // bands.
    ThreadPool::Rows rows[8];
    const MatJob* job_of[8];
    int n_jobs = 0;
    for (const MatJob& j : jobs) job_of[n_jobs] = &j, rows[n_jobs++] = {0, j.w->rows, j.w->panels ? kPanelRows : 32};
    model_->pool.run_rows(rows, n_jobs, [&](int jj, int64_t r0, int64_t r1) {
        const MatJob& job = *job_of[jj];
        const WeightView& w = *job.w;
        if (act_of[jj] >= 0) k_.matmul_int8(*w.packed, r0, r1, acts[act_of[jj]], n, job.y, w.rows);
        else k_.matmul(w, r0, r1, job.x, n, w.cols, job.y, w.rows);
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
        model_->pool.run_items(n, [&](int64_t t0, int64_t t1) {  // (previous layer's residual add,) xb = norm(x)
            for (int t = t0; t < t1; ++t) {
                if (l > 0) k_.add(X + size_t(t) * E, XB + size_t(t) * E, E);
                k_.rmsnorm(X + size_t(t) * E, L.attn_norm, E, c.rms_eps, XB + size_t(t) * E);
            }
        });
        matmuls({{&L.wq, XB, q_.data()},     // (n, Q)
                 {&L.wk, XB, kx_.data()},    // (n, KV)
                 {&L.wv, XB, vx_.data()}},   // (n, KV)
                n);
        model_->pool.run_items(n, [&](int64_t t0, int64_t t1) {
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
                cache_.store(k_, l, n_past_ + t, k, v);
                for (int h = 0; h < c.n_head_kv; ++h)  // attention reads a kv head's queries of a unit in one run
                    std::memcpy(qh_.data() + (size_t(h) * kChunk + t) * group * hd, q + size_t(h) * group * hd,
                                sizeof(float) * group * hd);
            }
        });
        attention(l, n);                            // att: (n, Q)
        matmuls({{&L.wo, att_.data(), XB}}, n);    // (n, E)
        model_->pool.run_items(n, [&](int64_t t0, int64_t t1) {  // x += attention; xb = norm(x)
            for (int t = t0; t < t1; ++t) {
                k_.add(X + size_t(t) * E, XB + size_t(t) * E, E);
                k_.rmsnorm(X + size_t(t) * E, L.ffn_norm, E, c.rms_eps, XB + size_t(t) * E);
            }
        });
        matmuls({{&L.gate, XB, gate_.data()},     // (n, F)
                 {&L.up, XB, up_.data()}},        // (n, F)
                n);
        model_->pool.run_items(n, [&](int64_t t0, int64_t t1) {
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
    h.kv_type = uint32_t(cache_.type());
    std::string out;
    out.reserve(sizeof h + n_past_ * kv_bytes_per_token() + logits_.size() * 4 + 8);
    out.append(reinterpret_cast<const char*>(&h), sizeof h);
    cache_.save(n_past_, out);  // per layer K rows then V rows, (n_past, kv_dim) each (KvCache::save)
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
    if (h.kv_type != uint32_t(cache_.type()))
        throw ModelMismatch(std::string("snapshot holds a ") +
                            (h.kv_type <= 2 ? kv_type_name(KvType(h.kv_type)) : "unknown") +
                            " KV cache; this context's is " + kv_type_name(cache_.type()));
    if (h.n_past > uint32_t(n_ctx_))
        throw ContextOverflow("snapshot holds " + std::to_string(h.n_past) + " tokens, more than the context of " +
                              std::to_string(n_ctx_));
    const size_t expect = sizeof h + h.n_past * kv_bytes_per_token() + size_t(c.vocab_size) * 4 + 8;
    if (blob.size() != expect)
        throw BadSnapshot("snapshot is " + std::to_string(blob.size()) + " bytes, expected " + std::to_string(expect));
    uint64_t sum;
    std::memcpy(&sum, blob.data() + blob.size() - 8, 8);
    if (sum != hash_bytes(blob.data(), blob.size() - 8, 42)) throw BadSnapshot("snapshot checksum mismatch (corrupted)");

    n_past_ = int(h.n_past);
    cache_.load(n_past_, blob.data() + sizeof h);
    std::memcpy(logits_.data(), blob.data() + sizeof h + size_t(n_past_) * kv_bytes_per_token(), size_t(c.vocab_size) * 4);
    logits_valid_ = h.logits_valid != 0;
}

}  // namespace zen5
