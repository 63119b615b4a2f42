// DeepSeek V4 (Flash): the model and one sequence's state, beside the Llama-family decoder
// (decoder.h) with the same contract: eval appends tokens, rewind forgets positions exactly,
// snapshot/restore is bit exact. ../shared/specs/deepseek-v4-architecture.md is the design; the
// independent oracle is transformers' DeepseekV4ForCausalLM (tests/test_deepseek_v4_engine.py).
//
// What differs from a Llama decoder, and where it lives here:
//  - the residual is hc_mult streams mixed by hyper-connections (hc_pre/hc_post, Sinkhorn);
//  - attention has one shared K=V head with low-rank Q, a per-head sink, RoPE on the tail of each
//    head (undone on the output) and a grouped low-rank output projection;
//  - each layer sees a raw window of the last `window` rows plus compressed rows: ratio 4 (an
//    overlapping window of 8 slots, picked by the lightning indexer's top-k) or ratio 128 (all);
//  - the FFN is a mixture of experts (sqrt-softplus scores, selection bias; the first layers
//    routed by token id) plus a shared expert, with SwiGLU clamps;
//  - the QAT simulations of the official model (FP8 on KV rows, Hadamard + FP4 in the indexer),
//    switched off to compare with transformers, which leaves them out.
#pragma once
#include <atomic>
#include <mutex>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model.h"

namespace zen5 {

struct V4Config {
    int vocab = 0, hidden = 0, n_layers = 0, n_heads = 0, head_dim = 0, rope_dim = 0;
    int q_rank = 0, o_groups = 0, o_rank = 0, window = 0;
    std::vector<int> ratios;  // per layer: 0 (window only), 4 (with the indexer) or 128
    int index_heads = 0, index_dim = 0, index_topk = 0;
    int n_experts = 0, top_k = 0, moe_inter = 0, n_hash_layers = 0;
    float route_scale = 1.0f, swiglu_limit = 0.0f;
    int hc_mult = 0, hc_iters = 0;
    float hc_eps = 1e-6f, rms_eps = 1e-6f;
    int n_ctx_train = 0;
};

// One compressor: kv and gate projections of `width` (2 * head for ratio 4: two halves that
// feed this window and the next one; head for ratio 128), the position bias added to the gate
// (ape, (ratio, width)) and the RMSNorm of an emitted row (head).
struct V4Compressor {
    WeightView wkv, wgate;
    const float* ape = nullptr;
    const float* norm = nullptr;
    int width = 0, head = 0;
};

// A hyper-connection's parameters: fn ((2 + hc) * hc, hc * hidden), base, scale[3].
struct V4Hc {
    WeightView fn;
    const float* base = nullptr;
    const float* scale = nullptr;
};

struct V4Layer {
    int ratio = 0;
    bool hash = false;  // experts picked by token id (tid2eid), not by score
    V4Hc hc_attn, hc_ffn;
    const float *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *kv_norm = nullptr;
    const float* sink = nullptr;  // (n_heads)
    WeightView wq_a, wq_b, wkv, wo_a, wo_b;
    V4Compressor comp;            // ratio != 0
    V4Compressor icomp;           // ratio 4: the indexer's own compressor
    WeightView iwq_b, iweights;   // ratio 4: indexer queries (from the Q low-rank vector), head weights
    WeightView gate;              // router (n_experts, hidden)
    const float* gate_bias = nullptr;   // selection bias (score-routed layers)
    const int32_t* tid2eid = nullptr;   // (vocab, top_k) (hash layers)
    std::vector<WeightView> w1, w2, w3;  // routed experts
    WeightView sw1, sw2, sw3;            // shared expert
};

// A routed expert's three matrices in the matmuls' layout (V4Model::expert).
struct V4Expert { WeightView w1, w2, w3; };

// safetensors dtypes of the official checkpoint beyond kernels.h's: the E8M0 scale tensors.
// (F8_E4M3 is kTypeFP8; the I8 tensors of packed e2m1 pairs arrive as kTypeMXFP4.)
constexpr int kTypeE8M0 = 1002;

class V4Model {
  public:
    // Tensors under the official names (embed.weight, layers.0.attn.wq_a.weight, ...); matrices
    // F32/F16/BF16, used in place; vectors any float type (copied to F32); tid2eid I32.
    V4Model(V4Config cfg, const std::vector<TensorIn>& tensors, std::vector<float> freq_main,
            std::vector<float> freq_compress, int threads, const CacheSpec& cache = {}, int load_threads = 0);

    const V4Config cfg;
    WeightView embed, head;
    const float* norm = nullptr;
    V4Hc hc_head;  // fn (hc, hc * hidden), base (hc), scale (1)
    std::vector<V4Layer> layers;
    std::vector<float> freq_main, freq_compress;  // (rope_dim / 2): ratio-0 layers, compressed ones
    uint64_t fingerprint = 0;
    int64_t n_params = 0;
    mutable ThreadPool pool;
    // the arena: what the matmuls read but the routed experts (prepare_experts) and the embedding
    size_t weight_bytes() const { return arena_bytes_; }
    // Bytes the matmuls read, by part (the bench's bytes-per-token accounting): per layer its
    // attention side (hc_attn, projections, compressors, indexer), its FFN side less the routed
    // experts (hc_ffn, router, shared expert) and one routed expert; then the head (hc_head, head).
    struct LayerBytes { size_t attn = 0, ffn = 0, expert = 0; };
    std::vector<LayerBytes> layer_bytes() const;
    size_t head_bytes() const;
    const ArenaCache& weight_cache() const { return cache_; }
    void finish_weight_cache() { cache_.finish(); }  // waits for a background cache write

    // Routed experts are packed the first time a token is routed to them, not at load: they are
    // most of the model (V4 Flash: 33,024 experts, 147 of its 160 GB), so a load packs only the
    // rest, and the experts' file pages stay untouched until used (a model larger than RAM opens,
    // and runs as far as the experts it routes to fit). Each is packed once, over the pool, into
    // memory of its own; its file pages are then released like a load's. prepare_experts packs
    // those of `ids` (in layer l) not yet packed; expert() is valid for them afterwards.
    void prepare_experts(int l, const std::vector<int>& ids) const;
    void prepare_all_experts() const;  // every expert of every layer (a warm-up, the bench)
    const V4Expert& expert(int l, int e) const { return slots_[l][e].view; }
    size_t expert_bytes_packed() const { return expert_bytes_.load(); }
    size_t expert_bytes_total() const;  // all experts packed

  private:
    size_t arena_bytes_ = 0;
    std::vector<std::unique_ptr<std::vector<float>>> floats_;  // vectors converted to F32
    std::vector<std::unique_ptr<std::vector<int32_t>>> ints_;
    AlignedBytes arena_;
    std::vector<std::unique_ptr<PackedWeights>> packed_;  // FP8 (as Q8_0) and MXFP4 matrices
    std::vector<std::unique_ptr<FloatPanels>> panels_;
    ArenaCache cache_;  // after arena_: destroyed first (model.h)
    struct ExpertSlot {
        std::atomic<bool> ready{false};  // set (release) once view's memory is filled
        V4Expert view;
        AlignedBytes mem;
        std::vector<std::unique_ptr<PackedWeights>> packed;  // own_layout's headers
        std::vector<std::unique_ptr<FloatPanels>> panels;
    };
    mutable std::vector<std::unique_ptr<ExpertSlot[]>> slots_;  // (n_layers, n_experts)
    mutable std::mutex expert_mu_;                               // one packer at a time
    mutable std::atomic<size_t> expert_bytes_{0};
};

// The QAT simulations (exposed for the tests' bit-exact checks against numpy + ml_dtypes).
// x[0:n] -> e4m3 values times a power-of-two scale per block of `block` (n % block == 0):
// scale = 2^ceil(log2(max(amax, 1e-4) * f32(1 / 448))), round to nearest even (official kernel.py).
void v4_fp8_sim(float* x, int n, int block);
// The same onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}: scale = 2^ceil(log2(max(amax, 6 * 2^-126) * f32(1 / 6))).
void v4_fp4_sim(float* x, int n, int block);
// In-place Sylvester Hadamard transform of n (a power of two) values, scaled by 1/sqrt(n).
void v4_hadamard(float* x, int n);

class V4Context {
  public:
    // qat: run the official model's FP8/FP4/Hadamard simulations (false: the plain math that
    // transformers computes, for the oracle comparison).
    V4Context(std::shared_ptr<const V4Model> model, int n_ctx, const Kernels* kernels = nullptr, bool qat = true);
    const char* isa() const { return k_.name; }
    bool qat() const { return qat_; }
    // Bytes of state one more token adds: its raw row in every layer plus its share of the
    // compressed and indexer rows.
    size_t bytes_per_token() const;

    void eval(const int32_t* tokens, int n, float* all_logits = nullptr);
    // Exact: within the current 128-position block a truncation; further back, the state at the
    // block start is rebuilt (rows truncated, the ratio-4 overlap inputs saved at that boundary)
    // and the rest of the tokens are evaluated again. last_logits as in Context::rewind.
    void rewind(int n, const float* last_logits = nullptr);
    std::string snapshot() const;
    void restore(const std::string& blob);

    int n_past() const { return n_past_; }
    int n_ctx() const { return n_ctx_; }
    bool logits_valid() const { return logits_valid_; }
    const std::vector<float>& logits() const { return logits_; }
    const V4Model& model() const { return *model_; }
    int rebuilt_tokens() const { return rebuilt_; }  // tokens re-evaluated by rewinds so far

    // Expert ids picked for each token of the last eval, (n, n_layers, top_k), and the indexer
    // rows each token attended to in ratio-4 layers ((n, n_layers, index_topk), -1 padded): the
    // discrete decisions the tests compare with the oracle's.
    const std::vector<int32_t>& last_experts() const { return experts_; }
    const std::vector<int32_t>& last_selected() const { return selected_; }
    // Wall seconds spent per stage since the last reset, (2 * n_layers + 1): layer l's attention
    // half (hc_pre to hc_post) at 2l, its FFN half at 2l + 1, the rest (embedding, head) last.
    const std::vector<double>& stage_seconds() const { return stage_s_; }
    void reset_stage_seconds() { std::fill(stage_s_.begin(), stage_s_.end(), 0.0); }

    static constexpr int kChunk = 512;  // tokens per forward step
    static constexpr int kBlock = 128;  // rewind's block: compressor inputs are kept since its start

  private:
    struct LayerState {
        std::vector<float> raw;     // (n_ctx, head_dim): every position's KV row
        std::vector<float> comp;    // (n_ctx / ratio, head_dim) compressed rows
        // (n_ctx / 4, index_dim) indexer rows (ratio 4) as key tiles (kernels.h: row w, channel c
        // at key_tile_index(w, c, index_dim)), the layout the score kernels read: every decoded
        // token scores all of them, so they are tiled once, when written, not per token
        std::vector<float> idx;
        // compressor inputs (kv, gate + ape) of positions [base, n_past): the pending window, for
        // ratio 4 the previous window (its first half overlaps the next row), and every position
        // of the current block so a rewind inside it is a truncation
        std::vector<float> ckv, cgate, ikv, igate;
        int base = 0;
        // ratio 4: the inputs of positions [b*kBlock - 4, b*kBlock) at each block boundary b
        // (compressor kv, gate, then the indexer's): the overlap a rebuilt block starts from
        std::vector<std::vector<float>> edge;
    };
    void forward_chunk(const int32_t* tokens, int n, float* all_logits);
    void hc_pre(const V4Hc& hc, int n, float* post, float* comb, float* collapsed);
    void hc_post(const float* out, const float* post, const float* comb, int n);
    void attention(int l, int n, const float* x, float* out);
    void compress(int l, const V4Compressor& c, bool indexer, int n, const float* kv, float* gate);
    void moe(int l, int n, const int32_t* tokens, const float* x, float* out);
    // y[t] = rows [r0, r1) of w times x[t], t < n (r1 < 0: all rows)
    struct MatJob {
        const WeightView* w;
        const float* x;
        int n;
        int64_t ldx;
        float* y;
        int64_t ldy;
        int64_t r0 = 0, r1 = -1;
    };
    // Several matmuls in one parallel run: a decoded token's many small matrices (a layer's input
    // projections, its experts) share one wait for the threads instead of one each.
    void matmuls(const std::vector<MatJob>& jobs);
    void matmul(const WeightView& w, const float* x, int n, int64_t ldx, float* y, int64_t ldy,
                int64_t r0 = 0, int64_t r1 = -1) {
        matmuls({MatJob{&w, x, n, ldx, y, ldy, r0, r1}});
    }
    // RoPE on the last rope_dim values of a dim-wide head: at position pos (the compressor's
    // window starts), or by the chunk's token t's row of rot_ (rope_at(v, dim, rot(compressed, t)):
    // freq_compress for a compressed layer's heads and the indexer's, else freq_main)
    void rope(float* v, int dim, const float* freq, int pos, bool inverse) const;
    void rope_at(float* v, int dim, const float* cs, bool inverse) const;
    const float* rot(bool compressed, int t) const {
        return rot_.data() + (size_t(compressed) * rot_n_ + size_t(t)) * model_->cfg.rope_dim;
    }
    // fn(t) for every t in [0, n): per-token steps, over the threads for a prefill chunk
    // (ThreadPool::run_items). On the calling thread alone, the hyper-connections, activation
    // quantization, norms, RoPE, QAT simulations, routing, the SwiGLU clamp and the experts'
    // gathers and sums were 25% of its time in a 2-thread 512-token prefill of the V4 bench model
    // (Xeon, avx512 tier) while the other thread waited; split, that prefill took 4.37 ms per
    // token instead of 4.93 (alternated in one process). Decode (n = 1) runs them inline.
    template <class Fn>
    void items(int n, const Fn& fn) {
        model_->pool.run_items(n, [&](int64_t t0, int64_t t1) {
            for (int t = int(t0); t < int(t1); ++t) fn(t);
        });
    }
    void reset_state();
    void truncate(int n);         // n >= trunc_floor_: forget positions >= n
    void trim_inputs();           // drop compressor inputs before the current block's lead
    int lead(int l) const { return model_->cfg.ratios[l] == 4 ? 4 : 0; }  // inputs kept before a block

    std::shared_ptr<const V4Model> model_;
    const Kernels& k_;
    int n_ctx_, n_past_ = 0;
    bool qat_;
    bool logits_valid_ = false;
    int rebuilt_ = 0;
    int rec_off_ = 0;             // the chunk's first token within the eval (decision records)
    int trunc_floor_ = 0;         // a rewind to n >= this is a truncation (the inputs are all kept)
    int history_floor_ = 0;       // below this block start, only a replay from 0 rebuilds state
    std::vector<int32_t> tokens_; // every position's token (a rewind may replay them)
    std::vector<LayerState> st_;
    std::vector<float> logits_;
    // the chunk's (cos, sin) pairs per token, for freq_main then freq_compress: every head of a
    // token turns by the same angles, so they are computed once per token, not per head and layer
    std::vector<float> rot_;
    int rot_n_ = 0;
    std::vector<int32_t> experts_, selected_;
    std::vector<double> stage_s_;
    struct Rows { std::vector<float> rows, tiles; int nk = 0; };  // a token's attention rows, gathered
    std::vector<Rows> gathered_;  // a small batch's tokens (attention)
    // scratch, per chunk (ZeroedArray: resident only where written, so a decode-only context
    // does not hold the 512-token chunk's ~280 MB at V4 Flash's widths)
    ZeroedArray<float> X_, xn_, col_, out_, post_, comb_, qa_, q_, kv_, att_, oa_, iq_, iw_, tmp_, tmp2_;
    ZeroedArray<float> ckv_, cg_, ffn_g_, ffn_u_, rlog_;
    // the activations of an int8 matmul (FP8 / MXFP4 weights), QuantAct's arrays
    std::vector<int8_t> act_q_;
    std::vector<float> act_d_, act_ds_;
    std::vector<int32_t> act_c_;
};

}  // namespace zen5
