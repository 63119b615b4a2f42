// KvCache: the keys and values of one sequence, per layer, in the layouts the attention kernels
// read (kernels.h). It is indexed by position and knows nothing of how many positions are live:
// the Context keeps n_past, so rewinding is forgetting positions, and the next store simply
// overwrites them. A snapshot holds the rows in plain (n, kv_dim) order, independent of these
// layouts, so a file does not change when a layout does.
//
// A layer's K and V each come in blocks of kBlock positions (an attention split), and inside a
// block kv head after kv head: the head's kBlock positions of K in key tiles of its hd channels
// (key_tile_index(p % kBlock, c, hd); q8_0: key_q8_index(p % kBlock, c, hd)), its V in rows of
// hd (q8_0: value_q8_index(p % kBlock, c, hd)). So the attention kernels' calls for one kv head
// of one split each read one run of memory. With every head's channels side by side in one tile
// or row, as before, a head's values were 128-byte slices of rows kv_dim apart, and decode deep
// in the cache waited on them: SmolLM2-135M (3 kv heads) at depth 8192 on the Zen 3 decoded at
// 35.0 / 40.7 -> 46.6 / 45.2 tok/s on 1 thread and 68.5 / 69.7 -> 75.1 / 78.3 on 2 (q8_0 cache:
// 85.4 / 89.2 -> 91.5 / 102.4), and a 1.7B random Llama Q4_0 (32 kv heads, rows of 4 KB) at
// depth 2048 at 11.5 -> 12.6 on 1 thread and 17.7 / 19.3 -> 20.8 / 23.9 on 2; alternating builds,
// the same logits; prefill the same within noise.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model.h"

namespace zen5 {

// How the cache stores K and V: fp32 (the exact path), fp16 (the int8 path's default) or int8
// with one fp32 scale per position and kv head (q8_0: about half of fp16's bytes, the
// attention's memory traffic at long context halved, at a small loss of precision).
enum class KvType : uint32_t { F32 = 0, F16 = 1, Q8_0 = 2 };
KvType kv_type_from_name(const std::string& name);  // "f32" | "f16" | "q8_0"; throws ZenError
const char* kv_type_name(KvType t);

class KvCache {
  public:
    // Room for n_ctx positions of every layer; throws ZenError when n_ctx is not positive or
    // the model's head size does not suit the type.
    // The memory is reserved for n_ctx positions but zeroed by the kernel page by page as the
    // positions are first written (alloc_zeroed), so resident memory follows the positions used.
    KvCache(const Config& c, int n_ctx, KvType type);
    KvType type() const { return type_; }
    size_t bytes_per_token() const;  // K and V of one position over all layers, scales included
    size_t bytes_reserved() const;   // the whole cache's address space
    static size_t bytes_for(const Config& c, int n_ctx, KvType type);  // bytes_reserved, unallocated
    size_t bytes_resident() const;   // of it, the pages in memory (mincore)

    // Writes position pos of a layer: k and v are its kv_dim values each, converted to the type
    // (`kernels` converts to fp16).
    void store(const Kernels& kernels, int layer, int pos, const float* k, const float* v);

    static constexpr int kBlock = kAttnSplit;
    // Kv head `head`'s K from the key tile of position pos (pos a multiple of kKeyTile; tiles of
    // hd channels, hd x kKeyTile elements apart) and its V from the row of pos (rows hd elements
    // apart; q8_0: pos a multiple of 4, quads hd x 4 bytes apart), both up to the end of pos's
    // block; n_ctx rounded up to whole blocks.
    const uint8_t* keys(int layer, int head, int pos) const { return at(k_, layer) + key_at(pos, head) * elem_; }
    const uint8_t* values(int layer, int head, int pos) const { return at(v_, layer) + value_at(pos, head) * elem_; }
    // q8_0: a kv head's scales of a layer, one per position from position 0
    const float* key_scales(int layer, int head) const { return kscale() + scale_index(layer, head); }
    const float* value_scales(int layer, int head) const { return vscale() + scale_index(layer, head); }

    // Snapshot rows of positions [0, n): per layer K then V as (n, kv_dim) elements of the type
    // (q8_0: signed bytes, then the K and the V scales as (n_head_kv, n) fp32); n *
    // bytes_per_token() bytes in all. save appends them to out; load reads them from p.
    void save(int n, std::string& out) const;
    void load(int n, const char* p);

  private:
    size_t layer_bytes() const { return size_t(n_rows_) * kv_dim_ * elem_; }
    uint8_t* at(const AlignedBytes& cache, int layer) const { return cache.get() + layer_bytes() * layer; }
    // channel 0 of position p of kv head h in a layer's K or V, in elements of the type
    size_t key_at(int p, int h) const;
    size_t value_at(int p, int h) const;
    size_t scale_index(int layer, int head) const { return (size_t(layer) * n_head_kv_ + head) * n_rows_; }
    // between the cache's layouts and (n, kv_dim) rows, in either direction
    void copy_rows(int layer, int n, char* krows, char* vrows, bool to_rows);
    // Huge pages for the filled part of a layer's K and V (whole 2 MiB below the block of n):
    // asking for them up front would fault in 2 MiB per layer at the first token (THP), so the
    // cache is mapped on 4 KiB pages and a block is marked once it is full (khugepaged may then
    // merge it). Only a hint.
    void hint_huge(int layer, int n);
    float* kscale() const { return reinterpret_cast<float*>(kscale_.get()); }
    float* vscale() const { return reinterpret_cast<float*>(vscale_.get()); }

    KvType type_;
    int n_layer_, n_head_kv_, head_dim_, kv_dim_;
    int n_rows_;   // n_ctx rounded up to whole blocks
    size_t elem_;  // 4, 2 or 1 bytes
    int huge_every_ = 0;  // positions per 2 MiB of a layer's K or V (hint_huge)
    AlignedBytes k_, v_;            // (n_layer, n_rows, kv_dim) elements each, layouts above
    AlignedBytes kscale_, vscale_;  // q8_0: (n_layer, n_head_kv, n_rows) floats; a head's in position order
};

}  // namespace zen5
