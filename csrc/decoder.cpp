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
const uint64_t kBuildId = hash_bytes(ZEN5_VERSION "/kv-2", sizeof(ZEN5_VERSION "/kv-2") - 1, 1);

struct SnapshotHeader {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t build_id;
    uint64_t model_fingerprint;
    uint32_t n_layer, kv_dim, vocab, n_past;
    uint32_t logits_valid;
    uint32_t int8_matmul;  // the KV rows (fp16 with int8 matmuls, else fp32) depend on the path
};
}  // namespace

Context::Context(std::shared_ptr<const Model> model, int n_ctx, const Kernels* kernels, bool int8_matmul)
    : model_(std::move(model)), k_(kernels ? *kernels : active_kernels()), n_ctx_(n_ctx), int8_(int8_matmul) {
    const Config& c = model_->cfg;
    if (n_ctx <= 0) throw ZenError("n_ctx must be positive");
    kv_elem_ = int8_ ? 2 : 4;
    const size_t kv = size_t(c.n_layer) * n_ctx * c.kv_dim() * kv_elem_;
    kcache_.assign(kv, 0);
    vcache_.assign(kv, 0);
    x_.resize(size_t(kChunk) * c.n_embd);
    xb_.resize(size_t(kChunk) * std::max(c.n_embd, c.q_dim()));
    q_.resize(size_t(kChunk) * c.q_dim());
    att_.resize(size_t(kChunk) * c.q_dim());
    kx_.resize(size_t(kChunk) * c.kv_dim());
    vx_.resize(size_t(kChunk) * c.kv_dim());
    gate_.resize(size_t(kChunk) * c.n_ff);
    up_.resize(size_t(kChunk) * c.n_ff);
    scores_.resize(size_t(model_->pool.size()) * kQB * n_ctx);
    logits_.assign(c.vocab_size, 0.0f);
    const size_t max_cols = std::max({c.n_embd, c.q_dim(), c.n_ff});
    for (int i = 0; i < 3; ++i) {
        act_q_[i].resize(size_t(kChunk) * max_cols);
        act_d_[i].resize(size_t(kChunk) * max_cols / QK + 1);
        act_s_[i].resize(size_t(kChunk) * max_cols / QK + 1);
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

void Context::rewind(int n) {
    if (n < 0 || n > n_past_)
        throw ZenError("rewind(" + std::to_string(n) + ") outside [0, " + std::to_string(n_past_) + "]");
    if (n != n_past_) logits_valid_ = false;  // the logits of position n-1 are not kept
    n_past_ = n;
}

void Context::matmuls(std::initializer_list<MatJob> jobs, int n) {
    // Quantized matrices multiply int8 activations: quantize each distinct input once.
    QuantAct acts[3];
    const float* quantized[3] = {nullptr, nullptr, nullptr};
    int n_acts = 0;
    std::vector<int> act_of(jobs.size(), -1);
    int ji = 0;
    for (const MatJob& j : jobs) {
        if (j.w->packed && int8_) {
            int a = 0;
            while (a < n_acts && quantized[a] != j.x) ++a;
            if (a == n_acts) {
                const int64_t cols = j.w->cols;
                k_.quantize_act(j.x, n, cols, act_q_[a].data(), act_d_[a].data(), act_s_[a].data());
                acts[a] = QuantAct{act_q_[a].data(), act_d_[a].data(), act_s_[a].data(), cols};
                quantized[a] = j.x, ++n_acts;
            }
            act_of[ji] = a;
        }
        ++ji;
    }
    // Each matrix is cut into contiguous row slices (16-row granules), several per thread so a
    // slow thread is not the tail; tasks enumerate (job, slice) pairs.
    const int nt = model_->pool.size();
    int64_t total_rows = 0;
    for (const MatJob& j : jobs) total_rows += j.w->rows;
    const int64_t per = std::max<int64_t>(16, (total_rows / (nt * 4) + 15) / 16 * 16);
    struct Slice { const MatJob* job; int act; int64_t r0, r1; };
    Slice slices[256];
    int n_slices = 0;
    ji = 0;
    for (const MatJob& j : jobs) {
        for (int64_t r0 = 0; r0 < j.w->rows && n_slices < 256; r0 += per)
            slices[n_slices++] = Slice{&j, act_of[ji], r0, std::min(j.w->rows, r0 + per)};
        ++ji;
    }
    model_->pool.run(n_slices, [&](int t, int) {
        const Slice& s = slices[t];
        const WeightView& w = *s.job->w;
        if (s.act >= 0) k_.matmul_int8(*w.packed, s.r0, s.r1, acts[s.act], n, s.job->y, w.rows);
        else k_.matmul(w, s.r0, s.r1, s.job->x, n, w.cols, s.job->y, w.rows);
    });
}

void Context::apply_rope(float* v, int n_heads, int pos) const {
    // Shared scalar code: sin/cos of (pos * inv_freq) rotate pairs of each head. neox pairs
    // element i with i + d/2 (HF layout); otherwise adjacent elements 2i, 2i+1 (GGUF llama).
    const int d = model_->cfg.head_dim, half = d / 2;
    const bool neox = model_->cfg.rope_neox;
    for (int i = 0; i < half; ++i) {
        const float angle = float(pos) * model_->inv_freq[i];
        const float cs = std::cos(angle), sn = std::sin(angle);
        for (int h = 0; h < n_heads; ++h) {
            float* p = v + h * d;
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float x0 = p[a], x1 = p[b];
            p[a] = x0 * cs - x1 * sn;
            p[b] = x0 * sn + x1 * cs;
        }
    }
}

void Context::attention(int layer, int n) {
    // Causal attention for the n new tokens at positions n_past_ .. n_past_+n-1 (whose k/v are
    // already in the cache). At long context this is bound by reading K and V, not by math: a
    // (token, head) pair alone would stream the whole K/V slice of its kv head from memory.
    // So a task takes one kv head and up to kQB query vectors of it (the GQA group's heads x
    // the chunk's tokens) and walks K and V in blocks of kPB positions, each block staying in
    // L1 while every query of the task uses it. Per query the sums run in position order, so
    // the result does not depend on the blocking (batch = token by token, bit for bit).
    const Config& c = model_->cfg;
    const int hd = c.head_dim, kvd = c.kv_dim(), group = c.n_head / c.n_head_kv;
    const float scale = 1.0f / std::sqrt(float(hd));
    const bool h16 = kv_elem_ == 2;
    const void* K = kv_row<uint8_t>(kcache_, layer, 0);  // (n_ctx, kv_dim)
    const void* V = kv_row<uint8_t>(vcache_, layer, 0);
    auto scores = [&](const float* q, size_t off, int cnt, float* out) {
        if (h16) k_.attn_scores_h(q, static_cast<const uint16_t*>(K) + off, kvd, cnt, hd, scale, out);
        else k_.attn_scores(q, static_cast<const float*>(K) + off, kvd, cnt, hd, scale, out);
    };
    auto values = [&](const float* p, size_t off, int cnt, float* out) {
        if (h16) k_.attn_values_h(p, static_cast<const uint16_t*>(V) + off, kvd, cnt, hd, out);
        else k_.attn_values(p, static_cast<const float*>(V) + off, kvd, cnt, hd, out);
    };
    const int per_kv = n * group, blocks = (per_kv + kQB - 1) / kQB;
    model_->pool.run(c.n_head_kv * blocks, [&](int task, int thread) {
        const int kvh = task / blocks, i0 = (task % blocks) * kQB, i1 = std::min(per_kv, i0 + kQB);
        float* S = scores_.data() + size_t(thread) * kQB * n_ctx_;  // (kQB, n_ctx)
        auto len_of = [&](int i) { return n_past_ + i / group + 1; };
        auto q_of = [&](int i) { return q_.data() + size_t(i / group) * c.q_dim() + (kvh * group + i % group) * hd; };
        auto out_of = [&](int i) { return att_.data() + size_t(i / group) * c.q_dim() + (kvh * group + i % group) * hd; };
        const int max_len = len_of(i1 - 1);
        for (int p0 = 0; p0 < max_len; p0 += kPB)
            for (int i = i0; i < i1; ++i) {
                const int cnt = std::min(kPB, len_of(i) - p0);
                if (cnt > 0) scores(q_of(i), size_t(p0) * kvd + kvh * hd, cnt, S + size_t(i - i0) * n_ctx_ + p0);
            }
        for (int i = i0; i < i1; ++i) {
            k_.softmax(S + size_t(i - i0) * n_ctx_, len_of(i));
            std::memset(out_of(i), 0, sizeof(float) * hd);
        }
        for (int p0 = 0; p0 < max_len; p0 += kPB)
            for (int i = i0; i < i1; ++i) {
                const int cnt = std::min(kPB, len_of(i) - p0);
                if (cnt > 0) values(S + size_t(i - i0) * n_ctx_ + p0, size_t(p0) * kvd + kvh * hd, cnt, out_of(i));
            }
    });
}

void Context::forward_chunk(const int32_t* tokens, int n, float* all_logits) {
    const Model& m = *model_;
    const Config& c = m.cfg;
    const int E = c.n_embd, Q = c.q_dim(), KV = c.kv_dim(), F = c.n_ff, hd = c.head_dim;

    for (int t = 0; t < n; ++t)  // x: (n, E)
        k_.dequant_row(m.tok_embd.type, m.tok_embd.row(tokens[t]), E, x_.data() + size_t(t) * E);

    for (int l = 0; l < c.n_layer; ++l) {
        const Layer& L = m.layers[l];
        for (int t = 0; t < n; ++t)  // xb: (n, E)
            k_.rmsnorm(x_.data() + size_t(t) * E, L.attn_norm, E, c.rms_eps, xb_.data() + size_t(t) * E);
        matmuls({{&L.wq, xb_.data(), q_.data()},     // (n, Q)
                 {&L.wk, xb_.data(), kx_.data()},    // (n, KV)
                 {&L.wv, xb_.data(), vx_.data()}},   // (n, KV)
                n);
        for (int t = 0; t < n; ++t) {
            float *q = q_.data() + size_t(t) * Q, *k = kx_.data() + size_t(t) * KV, *v = vx_.data() + size_t(t) * KV;
            if (L.bq) { k_.add(q, L.bq, Q); k_.add(k, L.bk, KV); k_.add(v, L.bv, KV); }
            if (L.q_norm) {
                for (int h = 0; h < c.n_head; ++h) k_.rmsnorm(q + h * hd, L.q_norm, hd, c.rms_eps, q + h * hd);
                for (int h = 0; h < c.n_head_kv; ++h) k_.rmsnorm(k + h * hd, L.k_norm, hd, c.rms_eps, k + h * hd);
            }
            apply_rope(q, c.n_head, n_past_ + t);
            apply_rope(k, c.n_head_kv, n_past_ + t);
            if (kv_elem_ == 2) {
                k_.to_f16(k, KV, kv_row<uint16_t>(kcache_, l, n_past_ + t));
                k_.to_f16(v, KV, kv_row<uint16_t>(vcache_, l, n_past_ + t));
            } else {
                std::memcpy(kv_row<float>(kcache_, l, n_past_ + t), k, sizeof(float) * KV);
                std::memcpy(kv_row<float>(vcache_, l, n_past_ + t), v, sizeof(float) * KV);
            }
        }
        attention(l, n);                                   // att: (n, Q)
        matmuls({{&L.wo, att_.data(), xb_.data()}}, n);   // (n, E)
        for (int t = 0; t < n; ++t) k_.add(x_.data() + size_t(t) * E, xb_.data() + size_t(t) * E, E);

        for (int t = 0; t < n; ++t)
            k_.rmsnorm(x_.data() + size_t(t) * E, L.ffn_norm, E, c.rms_eps, xb_.data() + size_t(t) * E);
        matmuls({{&L.gate, xb_.data(), gate_.data()},     // (n, F)
                 {&L.up, xb_.data(), up_.data()}},        // (n, F)
                n);
        for (int t = 0; t < n; ++t)
            k_.swiglu(gate_.data() + size_t(t) * F, up_.data() + size_t(t) * F, F, gate_.data() + size_t(t) * F);
        matmuls({{&L.down, gate_.data(), xb_.data()}}, n);  // (n, E)
        for (int t = 0; t < n; ++t) k_.add(x_.data() + size_t(t) * E, xb_.data() + size_t(t) * E, E);
    }
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
    const size_t rows = size_t(n_past_) * c.kv_dim() * kv_elem_;
    std::string out;
    out.reserve(sizeof h + 2 * rows * c.n_layer + logits_.size() * 4 + 8);
    out.append(reinterpret_cast<const char*>(&h), sizeof h);
    for (int l = 0; l < c.n_layer; ++l) {  // K rows then V rows, (n_past, kv_dim) each
        const size_t off = size_t(l) * n_ctx_ * c.kv_dim() * kv_elem_;
        out.append(reinterpret_cast<const char*>(kcache_.data() + off), rows);
        out.append(reinterpret_cast<const char*>(vcache_.data() + off), rows);
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
    if (h.n_past > uint32_t(n_ctx_))
        throw ContextOverflow("snapshot holds " + std::to_string(h.n_past) + " tokens, more than the context of " +
                              std::to_string(n_ctx_));
    const size_t rows = size_t(h.n_past) * c.kv_dim() * kv_elem_;
    const size_t expect = sizeof h + 2 * rows * c.n_layer + size_t(c.vocab_size) * 4 + 8;
    if (blob.size() != expect)
        throw BadSnapshot("snapshot is " + std::to_string(blob.size()) + " bytes, expected " + std::to_string(expect));
    uint64_t sum;
    std::memcpy(&sum, blob.data() + blob.size() - 8, 8);
    if (sum != hash_bytes(blob.data(), blob.size() - 8, 42)) throw BadSnapshot("snapshot checksum mismatch (corrupted)");

    const char* p = blob.data() + sizeof h;
    for (int l = 0; l < c.n_layer; ++l) {
        const size_t off = size_t(l) * n_ctx_ * c.kv_dim() * kv_elem_;
        std::memcpy(kcache_.data() + off, p, rows), p += rows;
        std::memcpy(vcache_.data() + off, p, rows), p += rows;
    }
    std::memcpy(logits_.data(), p, size_t(c.vocab_size) * 4);
    n_past_ = int(h.n_past);
    logits_valid_ = h.logits_valid != 0;
}

}  // namespace zen5
