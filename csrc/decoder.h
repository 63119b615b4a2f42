// Context: one sequence's KV cache (kv_cache.h), scratch buffers and last logits over a shared
// Model. The cache is position-indexed, so rewinding is just forgetting positions (n_past = n),
// and a snapshot is the K/V rows themselves plus the last logits: restore is bit exact.
#pragma once
#include <atomic>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kv_cache.h"
#include "model.h"

namespace zen5 {

class Context {
  public:
    // `kernels`: the table to compute with (tests force ref or avx512); default: the active one.
    // `int8_matmul`: quantized weights multiply int8-quantized activations (fast, ~0.5%
    // relative error per matmul, like llama.cpp); false: dequantize to fp32 (exact reference).
    // `kv`: the cache's element type.
    Context(std::shared_ptr<const Model> model, int n_ctx, const Kernels* kernels = nullptr,
            bool int8_matmul = true, KvType kv = KvType::F16);
    const char* isa() const { return k_.name; }
    KvType kv_type() const { return cache_.type(); }
    size_t kv_bytes_per_token() const { return cache_.bytes_per_token(); }
    size_t kv_bytes_reserved() const { return cache_.bytes_reserved(); }
    size_t kv_bytes_resident() const { return cache_.bytes_resident(); }

    // Appends tokens at n_past and computes the logits of the last one. When all_logits is
    // non-null it receives (n, vocab) logits, one row per token. Throws ContextOverflow
    // (before touching any state) if n_past + n would exceed n_ctx.
    void eval(const int32_t* tokens, int n, float* all_logits = nullptr);
    // Forget positions >= n (n <= n_past). The logits of position n - 1 are gone unless the
    // caller hands them back in last_logits (vocab floats): a speculative decoder drops the
    // rejected drafts of a batch it evaluated with all_logits and keeps the accepted row.
    void rewind(int n, const float* last_logits = nullptr);

    std::string snapshot() const;
    void restore(const std::string& blob);

    int n_past() const { return n_past_; }
    int n_ctx() const { return n_ctx_; }
    bool logits_valid() const { return logits_valid_; }
    const std::vector<float>& logits() const { return logits_; }
    const Model& model() const { return *model_; }

    // tokens per prefill step: weights stream once per chunk (64 -> 256: A/B in commit 2c3f59a)
    static constexpr int kChunk = 256;
    static constexpr int kQB = 24;     // query vectors per kv head in an attention task (the widest score group)
    static constexpr int kSplit = kAttnSplit;  // cache positions per attention split (kernels.h)

  private:
    void forward_chunk(const int32_t* tokens, int n, float* all_logits);
    // Causal attention of the n new tokens (attention.cpp): attention() plans the work and picks
    // the reader of the cache's type, attend() runs the tasks, attention_task() is one (unit,
    // split) and merge_unit() the last step of a unit.
    struct AttnPlan;
    void attention(int layer, int n);
    template <class Reader> void attend(const Reader& kv, const AttnPlan& a);
    template <class Reader> void attention_task(const Reader& kv, const AttnPlan& a, int task, int thread);
    void merge_unit(const AttnPlan& a, int t0, int t1);
    float* partial(const AttnPlan& a, int t, int kvh, int split);  // token t's first query on kv head kvh
    int len_of(int t) const { return n_past_ + t + 1; }           // positions token t attends to
    // y = x W^T for one or more independent matrices sharing one thread-pool dispatch (q/k/v,
    // gate/up): a decoded token is a few hundred small jobs, so dispatches are worth saving.
    struct MatJob { const WeightView* w; const float* x; float* y; };
    void matmuls(std::initializer_list<MatJob> jobs, int n);
    void rope_table(int n);                                             // rope_cs_ for the chunk
    void apply_rope(float* v, int n_heads, const float* cs) const;

    std::shared_ptr<const Model> model_;
    const Kernels& k_;
    int n_ctx_, n_past_ = 0;
    bool logits_valid_ = false;
    bool int8_;
    KvCache cache_;
    // scratch, (kChunk, width)
    // (ZeroedArray: resident only where written; part_ grows with n_ctx)
    ZeroedArray<float> x_, xb_, q_, kx_, vx_, att_, gate_, up_;
    ZeroedArray<float> scores_;  // (threads, n_head_kv, kQB / group x group, kSplit)
    ZeroedArray<float> qh_;      // (n_head_kv, kChunk, group, hd): the roped queries by kv head
    // attention partials per (query vector, split): max, sum of exp, unnormalized output (hd);
    // query vectors ordered (kv head, token, query of the group) so a kv head's are consecutive
    ZeroedArray<float> part_;    // (n_head_kv, kChunk, group, splits, hd + 2)
    std::unique_ptr<std::atomic<int>[]> pending_;  // splits left per attention unit
    // activations quantized for the int8 matmuls: up to 3 distinct inputs per dispatch
    ZeroedArray<int8_t> act_q_[3];   // (max cols / 32, kChunk, 32): QuantAct's block-major layout
    ZeroedArray<float> act_d_[3];    // (max cols / 32, kChunk)
    ZeroedArray<int32_t> act_c_[3];
    ZeroedArray<float> act_ds_[3];
    std::vector<float> logits_;  // (vocab)
    std::vector<float> rope_cs_; // (kChunk, head_dim / 2, 2): cos, sin
};

}  // namespace zen5
