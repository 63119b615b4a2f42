// Model: the validated configuration, RoPE frequencies, the thread pool and the weights: every
// matrix the matmuls read repacked into one arena (own_weights), the rest (norm vectors, the
// token embedding's rows) read in place from the caller's memory-mapped file, never a
// dequantized copy. The Python loader owns the mapped memory; the binding keeps it alive as long
// as the Model. Lean loading (issue 21): the file's pages of what was repacked are released.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "arena_cache.h"
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
// Memory from alloc_zeroed: `mapped` bytes of an anonymous mapping (munmap), or 0 for the heap.
struct AlignedFree {
    size_t mapped = 0;
    void operator()(uint8_t* p) const;
};
using AlignedBytes = std::unique_ptr<uint8_t, AlignedFree>;
bool pack_weights(const WeightView& w, PackedWeights& out, AlignedBytes& storage);
size_t packed_bytes(const WeightView& w);  // 0 for types that are not packed
// dst: zeroed, 64-aligned; rows [r0, r1) only (r1 < 0: all), each row's bytes are its own
void pack_into(const WeightView& w, PackedWeights& out, uint8_t* dst, int64_t r0 = 0, int64_t r1 = -1);
// Repack an F32/F16/BF16 matrix into the FloatPanels layout (kernels.h) at dst (zeroed,
// 64-aligned, float_panel_bytes long); rows [r0, r1) only (r1 < 0: all).
void pack_float_panels(const WeightView& w, FloatPanels& out, uint8_t* dst, int64_t r0 = 0, int64_t r1 = -1);
// The arena bytes one matrix takes (packed or panels), a multiple of 64.
size_t owned_bytes(const WeightView& w);
// Gives w a layout of its own at dst (zeroed, owned_bytes(w) long): PackedWeights for a quantized
// type, FloatPanels for a float one, kept in `packed` / `panels`, its fields set; pack_rows then
// fills rows [r0, r1) from w's source (threads may fill distinct 16-row groups at once).
void own_layout(WeightView& w, uint8_t* dst, std::vector<std::unique_ptr<PackedWeights>>& packed,
                std::vector<std::unique_ptr<FloatPanels>>& panels);
void pack_rows(const WeightView& w, uint8_t* dst, int64_t r0, int64_t r1);
// `bytes` of zeroed memory, 64-byte aligned. Blocks of 256 KiB and more come from an anonymous
// mapping (mmap; from 2 MiB on, 2 MiB aligned): the kernel zeroes a page when it is first touched, so what is
// never written costs no resident memory (a KV cache for a long n_ctx holds only the positions
// used). With `huge` blocks of 2 MiB and more are asked to be backed by huge pages (Linux THP, madvise mode): the
// weights are streamed every token, and with 4 KiB pages each page costs a TLB walk. Throws
// BadModel when out of memory. `map`: a mapping whatever the size (a cached arena is mapped over it).
AlignedBytes alloc_zeroed(size_t bytes, bool huge = true, bool map = false);
// A zeroed array for scratch whose size follows n_ctx or the chunk: a block of 256 KiB or more
// costs resident memory only where it is written (alloc_zeroed), std::vector's resize would
// write all of it.
template <class T>
class ZeroedArray {
  public:
    void resize(size_t n) { mem_ = alloc_zeroed(std::max<size_t>(n, 1) * sizeof(T)), n_ = n; }
    T* data() { return reinterpret_cast<T*>(mem_.get()); }
    const T* data() const { return reinterpret_cast<const T*>(mem_.get()); }
    T& operator[](size_t i) { return data()[i]; }
    const T& operator[](size_t i) const { return data()[i]; }
    size_t size() const { return n_; }
  private:
    AlignedBytes mem_;
    size_t n_ = 0;
};

struct TensorIn;

// Release the pages of [p, p + n) where they belong to a read-only shared file mapping (the
// loader's np.memmap): MADV_DONTNEED drops them from this process (the page cache keeps them, and
// a later read faults them back in from the file, so nothing is lost); memory of any other kind
// (the heap, a writable or private mapping, whose pages DONTNEED would zero) is left alone. The
// range is rounded out to whole pages: a neighbour's edge page that is still to be read comes
// back on its next access.
class FileMaps {
  public:
    FileMaps();  // reads /proc/self/maps
    void release(const void* p, size_t n) const { advise(p, n, kDrop); }
    // Reads of [p, p + n) fault in their own pages only (MADV_RANDOM; on = false: MADV_NORMAL
    // again): without it a fault reads read_ahead_kb of the file around it (8 MiB on the Zen 3 VM)
    void read_sparsely(const void* p, size_t n, bool on) const { advise(p, n, on ? kRandom : kNormal); }
    // MADV_WILLNEED: these pages read ahead, and no others
    void will_need(const void* p, size_t n) const { advise(p, n, kWillNeed); }
    bool any() const { return !ranges_.empty(); }
  private:
    enum Advice { kDrop, kRandom, kNormal, kWillNeed };
    void advise(const void* p, size_t n, Advice what) const;
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;  // [start, end) of r--s file mappings
};
// Packs `mats` into one arena (PackedWeights / FloatPanels, set on each view) and hashes every
// tensor of `by_name` into `h` in name order, in one pass over the file: each tensor in stripes of
// a few MiB that are hashed, packed where a matrix reads them and released (FileMaps), so the
// resident file pages at any moment are one stripe, not the file; the pool's threads hash and pack
// each stripe, a 16-row group per task (a matrix enters the hash as its groups' hashes, in order).
// Returns the hash. With a matching cache file the arena is mapped from it instead, and
// after packing the arena is written to it (arena_cache.h). Tensors whose data is in `sampled`
// (packed later, on first use) enter the hash by name, type, shape and their first and last
// 256 bytes only, and are neither read further nor released. The packing runs on `pool`, or on
// a pool of `load_threads` threads for the load only when that is more: packing first touches
// every arena page, which the kernel zeroes, and converts every weight, a burst that every core
// may share whatever the inference thread count (1-thread first loads of 1.7B-shaped files on a
// 2-core Zen 3 VM, own pool -> 2 threads: Q8_0 1.54-1.69 s -> 1.24-1.27 s, BF16 3.3-7.1 s ->
// 3.1-6.6 s; the BF16 spread is the page cache's writeback). A cache hit starts no thread.
uint64_t pack_and_hash(const std::map<std::string, const TensorIn*>& by_name,
                       const std::vector<WeightView*>& mats, uint64_t h, AlignedBytes& arena,
                       std::vector<std::unique_ptr<PackedWeights>>& packed,
                       std::vector<std::unique_ptr<FloatPanels>>& panels, ThreadPool& pool, int load_threads,
                       ArenaCache& cache, const std::set<const uint8_t*>* sampled = nullptr);


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
    // load_threads: the threads that pack the weights at load, when more than `threads`
    // (pack_and_hash); the model's own pool otherwise
    Model(Config cfg, const std::vector<TensorIn>& tensors, std::vector<float> rope_inv_freq, int threads,
          const CacheSpec& cache = {}, int load_threads = 0);

    const Config cfg;
    WeightView tok_embd;   // (vocab, n_embd)
    WeightView output;     // (vocab, n_embd): token_embd when tied
    const float* output_norm = nullptr;
    std::vector<Layer> layers;
    std::vector<float> inv_freq;  // (head_dim / 2)
    uint64_t fingerprint = 0;     // config + every tensor's name, type, shape and bytes
    int64_t n_params = 0;
    mutable ThreadPool pool;

    size_t weight_bytes() const { return arena_bytes_; }  // the arena: what the matmuls read
    const ArenaCache& weight_cache() const { return cache_; }
    void finish_weight_cache() { cache_.finish(); }  // waits for a background cache write

  private:
    // the matrices' own copies (quantized ones repacked, see PackedWeights; float ones in
    // panels, see FloatPanels), one arena; WeightView::data still points at the file's rows,
    // whose pages are released once copied (pack_and_hash). The paths that read those rows (the
    // f32 matmul of quantized weights, the reference tier) fault them back in from the file.
    AlignedBytes arena_;
    size_t arena_bytes_ = 0;
    std::vector<std::unique_ptr<PackedWeights>> packed_;
    std::vector<std::unique_ptr<FloatPanels>> panels_;
    ArenaCache cache_;  // after arena_: destroyed first, stopping the promotion that moves its pages

    WeightView matrix(const std::map<std::string, const TensorIn*>& by_name, const std::string& name,
                      int64_t rows, int64_t cols) const;
    const float* vector_f32(const std::map<std::string, const TensorIn*>& by_name,
                            const std::string& name, int64_t n) const;
};

uint64_t hash_bytes(const void* data, size_t n, uint64_t seed);

// hash_bytes over a byte stream fed in pieces (the total length known up front): the same value
// as one hash_bytes call over the concatenation, so the fingerprint does not depend on how a
// load is striped.
class StreamHash {
  public:
    StreamHash(uint64_t seed, size_t n) : h_{seed ^ n, seed + kK, seed * 3 + 1, ~seed} {}
    void update(const uint8_t* p, size_t n) {
        if (held_) {  // complete the held partial word group first
            const size_t take = std::min(n, 32 - held_);
            std::memcpy(buf_ + held_, p, take);
            held_ += take, p += take, n -= take;
            if (held_ < 32) return;
            mix(buf_), held_ = 0;
        }
        for (; n >= 32; p += 32, n -= 32) mix(p);
        std::memcpy(buf_, p, n), held_ = n;
    }
    uint64_t finish() const {
        uint64_t out = h_[0] ^ (h_[1] * 31) ^ (h_[2] * 37) ^ (h_[3] * 41);
        for (size_t i = 0; i < held_; ++i) out = (out ^ buf_[i]) * 0x100000001B3ull;
        out ^= out >> 33;
        return out * kK;
    }
  private:
    static constexpr uint64_t kK = 0x9E3779B97F4A7C15ull;
    void mix(const uint8_t* p) {
        for (int l = 0; l < 4; ++l) {
            uint64_t w;
            std::memcpy(&w, p + 8 * l, 8);
            h_[l] = (h_[l] ^ w) * kK;
            h_[l] ^= h_[l] >> 29;
        }
    }
    uint64_t h_[4];
    uint8_t buf_[32];
    size_t held_ = 0;
};


}  // namespace zen5
