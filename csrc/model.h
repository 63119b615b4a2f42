// Model: read-only weights used in place (pointers into the caller's memory-mapped file, never
// a dequantized copy), the validated configuration, RoPE frequencies and the thread pool.
// The Python loader owns the mapped memory; the binding keeps it alive as long as the Model.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "threadpool.h"

namespace zen5 {

// Typed errors, mapped to Python exception classes by the bindings.
struct ZenError : std::runtime_error { using std::runtime_error::runtime_error; };
struct ContextOverflow : ZenError { using ZenError::ZenError; };
struct BadSnapshot : ZenError { using ZenError::ZenError; };
struct ModelMismatch : ZenError { using ZenError::ZenError; };
struct BadModel : ZenError { using ZenError::ZenError; };

// Repack a Q4_0/Q4_1/Q8_0 matrix into the PackedWeights layout (kernels.h); the bytes live in
// `storage` (64-byte aligned). Returns false for types that are not packed.
struct AlignedFree { void operator()(uint8_t* p) const { std::free(p); } };
using AlignedBytes = std::unique_ptr<uint8_t, AlignedFree>;
bool pack_weights(const WeightView& w, PackedWeights& out, AlignedBytes& storage);
size_t packed_bytes(const WeightView& w);  // 0 for types that are not packed
void pack_into(const WeightView& w, PackedWeights& out, uint8_t* dst);  // dst: zeroed, 64-aligned
// Repack an F32/F16/BF16 matrix into the FloatPanels layout (kernels.h) at dst (zeroed,
// 64-aligned, float_panel_bytes long).
void pack_float_panels(const WeightView& w, FloatPanels& out, uint8_t* dst);
// `bytes` of zeroed memory, 64-byte aligned; large blocks are 2 MiB aligned and asked to be
// backed by huge pages (Linux THP, madvise mode): the weights and the KV cache are streamed
// every token, and with 4 KiB pages each page costs a TLB walk. Throws BadModel when out of memory.
AlignedBytes alloc_zeroed(size_t bytes);

struct Config {
    std::string arch;  // llama | qwen2 | qwen3
    int n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
    int vocab_size = 0, n_ctx_train = 0;
    float rms_eps = 1e-5f, rope_theta = 10000.0f;
    bool rope_neox = false, qkv_bias = false, qk_norm = false, tied_output = false;

    int q_dim() const { return n_head * head_dim; }
    int kv_dim() const { return n_head_kv * head_dim; }
};

// A tensor as handed over by the loader: raw bytes in GGML layout, numpy-order shape.
struct TensorIn {
    std::string name;
    int type;
    std::vector<int64_t> shape;
    const uint8_t* data;
    size_t nbytes;
    int64_t elements() const {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        return n;
    }
};

struct Layer {
    const float *attn_norm, *ffn_norm;
    WeightView wq, wk, wv, wo, gate, up, down;
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr;          // qwen2
    const float *q_norm = nullptr, *k_norm = nullptr;                 // qwen3, (head_dim)
};

class Model {
  public:
    Model(Config cfg, const std::vector<TensorIn>& tensors, std::vector<float> rope_inv_freq, int threads);

    const Config cfg;
    WeightView tok_embd;   // (vocab, n_embd)
    WeightView output;     // (vocab, n_embd): token_embd when tied
    const float* output_norm = nullptr;
    std::vector<Layer> layers;
    std::vector<float> inv_freq;  // (head_dim / 2)
    uint64_t fingerprint = 0;     // config + every tensor's name, type, shape and bytes
    int64_t n_params = 0;
    mutable ThreadPool pool;

  private:
    // the matrices' own copies (quantized ones repacked, see PackedWeights; float ones in
    // panels, see FloatPanels), one arena; WeightView::data still points at the file's rows
    AlignedBytes arena_;
    std::vector<std::unique_ptr<PackedWeights>> packed_;
    std::vector<std::unique_ptr<FloatPanels>> panels_;
    void own_weights(const std::vector<WeightView*>& mats);

    WeightView matrix(const std::map<std::string, const TensorIn*>& by_name, const std::string& name,
                      int64_t rows, int64_t cols) const;
    const float* vector_f32(const std::map<std::string, const TensorIn*>& by_name,
                            const std::string& name, int64_t n) const;
};

uint64_t hash_bytes(const void* data, size_t n, uint64_t seed);
uint64_t hash_tensor(const TensorIn& t, uint64_t h);  // name, type, shape and bytes (model fingerprints)


}  // namespace zen5
