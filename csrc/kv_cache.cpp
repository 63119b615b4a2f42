// The KV cache's storage and its conversions: a position's k and v into the cache's type and
// layouts (store), and the layouts to and from a snapshot's plain rows (save, load).
#include "kv_cache.h"

#include <algorithm>
#include <cstring>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace zen5 {

KvType kv_type_from_name(const std::string& name) {
    if (name == "f32") return KvType::F32;
    if (name == "f16") return KvType::F16;
    if (name == "q8_0") return KvType::Q8_0;
    throw ZenError("KV cache type must be f32, f16 or q8_0, got '" + name + "'");
}

const char* kv_type_name(KvType t) {
    return t == KvType::F32 ? "f32" : t == KvType::F16 ? "f16" : "q8_0";
}

KvCache::KvCache(const Config& c, int n_ctx, KvType type)
    : type_(type), n_layer_(c.n_layer), n_head_kv_(c.n_head_kv), head_dim_(c.head_dim), kv_dim_(c.kv_dim()) {
    if (n_ctx <= 0) throw ZenError("n_ctx must be positive");
    elem_ = type_ == KvType::F32 ? 4 : type_ == KvType::F16 ? 2 : 1;
    n_rows_ = (n_ctx + kBlock - 1) / kBlock * kBlock;
    k_ = alloc_zeroed(layer_bytes() * n_layer_, false);  // huge pages: hint_huge
    v_ = alloc_zeroed(layer_bytes() * n_layer_, false);
    const size_t pos_bytes = size_t(kv_dim_) * elem_;
    huge_every_ = int(std::max<size_t>(kBlock, (size_t(2) << 20) / pos_bytes / kBlock * kBlock));
    if (type_ == KvType::Q8_0) {
        // a head starts on a channel quad (key_q8_index); store quantizes a head on the stack
        if (head_dim_ % 4 != 0 || head_dim_ > 512)
            throw ZenError("the q8_0 KV cache needs a head size that is a multiple of 4 and at most 512, not " +
                           std::to_string(head_dim_));
        kscale_ = alloc_zeroed(sizeof(float) * n_layer_ * n_head_kv_ * n_rows_, false);
        vscale_ = alloc_zeroed(sizeof(float) * n_layer_ * n_head_kv_ * n_rows_, false);
    }
}

size_t KvCache::bytes_per_token() const {
    return size_t(n_layer_) * 2 * (size_t(kv_dim_) * elem_ + (type_ == KvType::Q8_0 ? 4 * n_head_kv_ : 0));
}

size_t KvCache::bytes_for(const Config& c, int n_ctx, KvType type) {
    const size_t rows = size_t(std::max(n_ctx, 1) + kBlock - 1) / kBlock * kBlock;
    const size_t elem = type == KvType::F32 ? 4 : type == KvType::F16 ? 2 : 1;
    const size_t kv = 2 * rows * c.kv_dim() * elem * c.n_layer;
    return type == KvType::Q8_0 ? kv + 2 * sizeof(float) * c.n_layer * c.n_head_kv * rows : kv;
}

size_t KvCache::bytes_reserved() const {
    const size_t kv = 2 * layer_bytes() * n_layer_;
    return type_ == KvType::Q8_0 ? kv + 2 * sizeof(float) * n_layer_ * n_head_kv_ * n_rows_ : kv;
}

size_t KvCache::bytes_resident() const {
    size_t total = 0;
    for (const AlignedBytes* b : {&k_, &v_, &kscale_, &vscale_}) {
        if (!*b) continue;
        const size_t mapped = b->get_deleter().mapped;
        if (!mapped) {  // a small heap block, zeroed when allocated: all of it
            total += b == &k_ || b == &v_ ? layer_bytes() * n_layer_ : sizeof(float) * n_layer_ * n_head_kv_ * n_rows_;
            continue;
        }
#ifdef __linux__
        const size_t page = size_t(sysconf(_SC_PAGESIZE));
        std::vector<unsigned char> vec((mapped + page - 1) / page);
        if (mincore(b->get(), mapped, vec.data()) != 0) continue;
        for (unsigned char r : vec) total += (r & 1) ? page : 0;
#endif
    }
    return total;
}

void KvCache::hint_huge(int layer, int n) {
#ifdef __linux__
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    const size_t filled = size_t(n / kBlock * kBlock) * kv_dim_ * elem_;  // whole blocks
    for (const AlignedBytes* b : {&k_, &v_}) {
        if (!b->get_deleter().mapped) continue;
        const uintptr_t base = reinterpret_cast<uintptr_t>(at(*b, layer));
        const uintptr_t s = (base + kHuge - 1) / kHuge * kHuge, e = (base + filled) / kHuge * kHuge;
        if (e > s) madvise(reinterpret_cast<void*>(s), e - s, MADV_HUGEPAGE);
    }
#else
    (void)layer, (void)n;
#endif
}

// Channel c's offset from channel 0 of the same position and head: in a key tile kKeyTile
// elements per channel (q8_0: quads of channels, key_q8_index), in a row 1 (q8_0: quads of
// positions, value_q8_index).
static size_t key_step(bool q8, int c) { return q8 ? size_t(c / 4) * 64 + c % 4 : size_t(c) * kKeyTile; }
static size_t value_step(bool q8, int c) { return q8 ? size_t(c) * 4 : size_t(c); }

// The head's run in p's block, then p's place in it (key_tile_index / value rows; q8_0:
// key_q8_index / value_q8_index with the head's hd as the width).
static size_t head_run(int p, int h, int n_head_kv, int hd) {
    return (size_t(p / KvCache::kBlock) * n_head_kv + h) * KvCache::kBlock * hd;
}

size_t KvCache::key_at(int p, int h) const {
    const int i = p % kBlock;
    return head_run(p, h, n_head_kv_, head_dim_) +
           (type_ == KvType::Q8_0 ? key_q8_index(i, 0, head_dim_) : key_tile_index(i, 0, head_dim_));
}

size_t KvCache::value_at(int p, int h) const {
    const int i = p % kBlock;
    return head_run(p, h, n_head_kv_, head_dim_) +
           (type_ == KvType::Q8_0 ? value_q8_index(i, 0, head_dim_) : size_t(i) * head_dim_);
}

void KvCache::store(const Kernels& kernels, int layer, int pos, const float* k, const float* v) {
    if ((pos + 1) % huge_every_ == 0) hint_huge(layer, pos + 1);
    const int hd = head_dim_;
    uint8_t *K = at(k_, layer), *V = at(v_, layer);
    for (int h = 0; h < n_head_kv_; ++h) {
        const float *kh = k + h * hd, *vh = v + h * hd;
        const size_t k0 = key_at(pos, h), v0 = value_at(pos, h);
        if (type_ == KvType::Q8_0) {  // K stored unsigned (k + 128), V signed
            int8_t q[512];
            int32_t sum;
            vscale()[scale_index(layer, h) + pos] = quantize_s8(vh, hd, q, &sum);
            for (int i = 0; i < hd; ++i) V[v0 + value_step(true, i)] = uint8_t(q[i]);
            kscale()[scale_index(layer, h) + pos] = quantize_s8(kh, hd, q, &sum);
            for (int i = 0; i < hd; ++i) K[k0 + key_step(true, i)] = uint8_t(q[i] + 128);
        } else if (type_ == KvType::F16) {
            auto *K16 = reinterpret_cast<uint16_t*>(K), *V16 = reinterpret_cast<uint16_t*>(V);
            kernels.to_f16(vh, hd, V16 + v0);
            uint16_t x[64];
            for (int c0 = 0; c0 < hd; c0 += 64) {
                const int m = std::min(64, hd - c0);
                kernels.to_f16(kh + c0, m, x);
                for (int i = 0; i < m; ++i) K16[k0 + key_step(false, c0 + i)] = x[i];
            }
        } else {
            auto *K32 = reinterpret_cast<float*>(K), *V32 = reinterpret_cast<float*>(V);
            std::memcpy(V32 + v0, vh, sizeof(float) * hd);
            for (int i = 0; i < hd; ++i) K32[k0 + key_step(false, i)] = kh[i];
        }
    }
}

// A position's hd elements of one head between the cache (channel c at k0 + key_step, v0 +
// value_step) and plain rows, in either direction. Bytes are the q8_0 cache, whose K is stored
// as k + 128 and whose rows hold k.
template <typename T>
static void copy_head(T* K, T* V, size_t k0, size_t v0, T* krow, T* vrow, int hd, bool to_rows) {
    constexpr bool q8 = sizeof(T) == 1;
    if constexpr (!q8) {  // a float cache's V row is the plain row
        if (to_rows) std::memcpy(vrow, V + v0, sizeof(T) * hd);
        else std::memcpy(V + v0, vrow, sizeof(T) * hd);
    }
    for (int c = 0; c < hd; ++c) {
        T& kc = K[k0 + key_step(q8, c)];
        if (to_rows) krow[c] = q8 ? T(kc - 128) : kc;
        else kc = q8 ? T(krow[c] + 128) : krow[c];
        if constexpr (q8) {
            T& vc = V[v0 + value_step(q8, c)];
            if (to_rows) vrow[c] = vc;
            else vc = vrow[c];
        }
    }
}

void KvCache::copy_rows(int layer, int n, char* krows, char* vrows, bool to_rows) {
    // Plain rows (q8_0: signed bytes) keep a snapshot independent of the cache's layouts, and
    // hold nothing of the positions past n.
    const int KV = kv_dim_, hd = head_dim_;
    uint8_t *K = at(k_, layer), *V = at(v_, layer);
    for (int p = 0; p < n; ++p)
        for (int h = 0; h < n_head_kv_; ++h) {
            const size_t r = size_t(p) * KV + size_t(h) * hd, k0 = key_at(p, h), v0 = value_at(p, h);
            if (elem_ == 4)
                copy_head(reinterpret_cast<float*>(K), reinterpret_cast<float*>(V), k0, v0,
                          reinterpret_cast<float*>(krows) + r, reinterpret_cast<float*>(vrows) + r, hd, to_rows);
            else if (elem_ == 2)
                copy_head(reinterpret_cast<uint16_t*>(K), reinterpret_cast<uint16_t*>(V), k0, v0,
                          reinterpret_cast<uint16_t*>(krows) + r, reinterpret_cast<uint16_t*>(vrows) + r, hd, to_rows);
            else
                copy_head(K, V, k0, v0, reinterpret_cast<uint8_t*>(krows) + r, reinterpret_cast<uint8_t*>(vrows) + r,
                          hd, to_rows);
        }
}

void KvCache::save(int n, std::string& out) const {
    // copy_rows is one loop for both directions; towards the rows it only reads the cache
    auto* self = const_cast<KvCache*>(this);
    const size_t rows = size_t(n) * kv_dim_ * elem_;
    for (int l = 0; l < n_layer_; ++l) {
        const size_t at = out.size();
        out.resize(at + 2 * rows);
        self->copy_rows(l, n, &out[at], &out[at + rows], true);
        if (type_ != KvType::Q8_0) continue;
        for (const float* s : {kscale(), vscale()})
            for (int kvh = 0; kvh < n_head_kv_; ++kvh)
                out.append(reinterpret_cast<const char*>(s + scale_index(l, kvh)), sizeof(float) * n);
    }
}

void KvCache::load(int n, const char* p) {
    const size_t rows = size_t(n) * kv_dim_ * elem_;
    for (int l = 0; l < n_layer_; ++l) {
        // copy_rows is one loop for both directions; from the rows it only reads them
        copy_rows(l, n, const_cast<char*>(p), const_cast<char*>(p + rows), false), p += 2 * rows;
        if (type_ != KvType::Q8_0) continue;
        for (float* s : {kscale(), vscale()})
            for (int kvh = 0; kvh < n_head_kv_; ++kvh)
                std::memcpy(s + scale_index(l, kvh), p, sizeof(float) * n), p += sizeof(float) * n;
    }
    for (int l = 0; l < n_layer_; ++l) hint_huge(l, n);
}

}  // namespace zen5
