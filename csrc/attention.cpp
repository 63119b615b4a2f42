// Causal attention for the n new tokens at positions n_past .. n_past+n-1 (whose k/v are already
// in the cache). At long context decode is bound by reading K and V, and prefill by the
// arithmetic. A unit of work is tb = kQB / group of the chunk's tokens: for each kv head its
// tb x group queries are scored together (each key tile loaded once for all of them, positions
// in the lanes) and summed together (each value row loaded once). The cache is cut into splits
// of kSplit positions, and a task is one (unit, split); it leaves per query a partial softmax
// (max, sum of exp, unnormalized output). Splits let a single decoded token use every thread and
// keep the score rows in L2 at any context length. The task that finishes a unit's last split
// merges its partials in split order (flash-decoding). A query's arithmetic depends only on its
// own length, never on the batch or the thread that ran it, so a batch equals the tokens one by
// one, bit for bit.
//
// Only reading the cache depends on its type: one reader per KV type (below) scores a kv head's
// queries against a run of positions and sums their values; the plan, the softmax and the merge
// are shared. attention() is the one place that picks the reader.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "decoder.h"

namespace zen5 {

static_assert(Context::kSplit % kKeyTile == 0, "a split starts on a key tile");
static_assert(Context::kSplit == KvCache::kBlock, "a split is a block of the cache");

namespace {

// What a reader is bound to for one call: a layer's cache and the call's strides. A call's
// positions [p0, p0 + cnt) lie in one block of the cache (a split: KvCache::kBlock), so a kv
// head's keys and values there are each one run of memory (kv_cache.h).
struct ReaderBase {
    const KvCache& cache;
    int layer, hd;
    float scale;      // of the scores
    int64_t lds;      // between score rows
    int64_t ldp;      // between the queries' partials (the values' output rows)
};

// fp32 and fp16 caches: K in key tiles and V in rows of T (kernels.h, kKeyTile), the kernels of
// that element type. A values call may start at any position.
template <typename T>
struct FloatReader : ReaderBase {
    using ScoresFn = void (*)(const float*, int, const T*, int64_t, int, int, float, float*, int64_t);
    using ValuesFn = void (*)(const float*, int64_t, int, const T*, int64_t, int, int, float*, int64_t);
    static constexpr int kValueBlock = 1;
    ScoresFn attn_scores;
    ValuesFn attn_values;

    void scores(const float* q, int nq, int kvh, int p0, int cnt, float* out) const {  // p0: tile aligned
        attn_scores(q, nq, reinterpret_cast<const T*>(cache.keys(layer, kvh, p0)), int64_t(hd) * kKeyTile, cnt, hd,
                    scale, out, lds);
    }
    void values(const float* p, int nq, int kvh, int p0, int cnt, float* out) const {
        attn_values(p, lds, nq, reinterpret_cast<const T*>(cache.values(layer, kvh, p0)), hd, cnt, hd, out, ldp);
    }
};

// The q8_0 cache: int8 K and V in their vpdpbusd layouts with a scale per position and kv head
// (kernels.h, key_q8_index). Its values kernel quantizes the weights per 32 positions from the
// call's first, so a call must start on a multiple of 32 to give the bits of one longer call.
struct Q8Reader : ReaderBase {
    static constexpr int kValueBlock = 32;
    const Kernels& k;

    void scores(const float* q, int nq, int kvh, int p0, int cnt, float* out) const {  // p0: tile aligned
        k.attn_scores_q8(q, nq, cache.keys(layer, kvh, p0), cache.key_scales(layer, kvh) + p0,
                         int64_t(hd) * kKeyTile, cnt, hd, scale, out, lds);
    }
    void values(const float* p, int nq, int kvh, int p0, int cnt, float* out) const {  // p0 % 32 == 0
        k.attn_values_q8(p, lds, nq, reinterpret_cast<const int8_t*>(cache.values(layer, kvh, p0)),
                         cache.value_scales(layer, kvh) + p0, int64_t(hd) * 4, cnt, hd, out, ldp);
    }
};

}  // namespace

// The shapes of one attention call.
struct Context::AttnPlan {
    int n, hd, group;
    int tb, units;              // tokens per unit, units
    int splits;                 // splits of the last token
    int kvt, heads;             // tasks per (unit, split), kv heads per task
    int n_splits_max, pstride;  // partials: per query, n_splits_max splits of hd + 2 floats
    int64_t ldp;                // between the queries' partials
    // offset of the score row of query vector 0 of the unit's token i on kv head kvh in a
    // thread's (n_head_kv, tb x group, kSplit) scores
    size_t srow(int kvh, int i) const { return (size_t(kvh) * tb + i) * group * kSplit; }
};

void Context::attention(int layer, int n) {
    const Config& c = model_->cfg;
    AttnPlan a;
    a.n = n, a.hd = c.head_dim, a.group = c.n_head / c.n_head_kv;
    a.tb = std::max(1, kQB / a.group), a.units = (n + a.tb - 1) / a.tb;
    a.splits = (n_past_ + n + kSplit - 1) / kSplit;
    // A task is (unit, split), or (unit, split, kv head) when those are fewer than twice the
    // threads (a decoded token near the start of the cache; a short batch): a whole split's task
    // reads every kv head of the split together, and SmolLM2-135M decoded at depth 2048 / 8192 on
    // 2 threads of the Zen 3 at 143-145 -> 168-170 / 59-64 -> 69-70 tok/s (f16 cache; q8_0 at 8192
    // 67-68 -> 79-84) with them than with a task per kv head at any depth (measured when the heads
    // still shared each tile and row, before the block layout of kv_cache.h). (Which task computes
    // what never changes the arithmetic.)
    a.kvt = a.units * a.splits < 2 * model_->pool.size() ? c.n_head_kv : 1, a.heads = c.n_head_kv / a.kvt;
    a.n_splits_max = (n_ctx_ + kSplit - 1) / kSplit, a.pstride = a.hd + 2;
    a.ldp = int64_t(a.n_splits_max) * a.pstride;
    // scores in base-2 units: softmax_partial and the merge use exp2 (kernels.h)
    const float scale = kLog2e / std::sqrt(float(a.hd));
    const ReaderBase b{cache_, layer, a.hd, scale, kSplit, a.ldp};
    switch (cache_.type()) {
        case KvType::F32:
            return attend(FloatReader<float>{b, k_.attn_scores, k_.attn_values}, a);
        case KvType::F16:
            return attend(FloatReader<uint16_t>{b, k_.attn_scores_h, k_.attn_values_h}, a);
        case KvType::Q8_0:
            return attend(Q8Reader{b, k_}, a);
    }
}

template <class Reader>
void Context::attend(const Reader& kv, const AttnPlan& a) {
    for (int u = 0; u < a.units; ++u) {
        const int t1 = std::min(a.n, (u + 1) * a.tb);
        pending_[u].store((len_of(t1 - 1) + kSplit - 1) / kSplit * a.kvt, std::memory_order_relaxed);
    }
    // split-major: the two threads work on neighbouring cache positions
    model_->pool.run(a.units * a.splits * a.kvt, [&](int task, int thread) { attention_task(kv, a, task, thread); });
}

float* Context::partial(const AttnPlan& a, int t, int kvh, int split) {
    return part_.data() + ((size_t(kvh) * kChunk + t) * a.group * a.n_splits_max + split) * a.pstride;
}

template <class Reader>
void Context::attention_task(const Reader& kv, const AttnPlan& a, int task, int thread) {
    const int group = a.group, hd = a.hd;
    const int u = task % a.units, split = task / a.units / a.kvt, h0 = task / a.units % a.kvt * a.heads, h1 = h0 + a.heads;
    const int t0 = u * a.tb, t1 = std::min(a.n, t0 + a.tb), nq = (t1 - t0) * group;
    const int c0 = split * kSplit, c1 = std::min(c0 + kSplit, len_of(t1 - 1));
    if (c0 >= c1) return;  // no token of this unit reaches this split
    // cnt[i]: positions of this split token t0 + i sees (<= 0: it ends before c0)
    int cnt[kQB];
    for (int t = t0; t < t1; ++t) cnt[t - t0] = std::min(len_of(t), c1) - c0;
    // positions every token of the unit sees, cut to whole value blocks (the tokens' own calls
    // then start on a block, and a token's blocks are the same as when it runs alone)
    const int common = std::max(0, cnt[0]) / Reader::kValueBlock * Reader::kValueBlock;
    float* S = scores_.data() + size_t(thread) * a.tb * model_->cfg.n_head * kSplit;  // this thread's score rows
    for (int kvh = h0; kvh < h1; ++kvh)  // the kv head's queries of the unit, side by side
        kv.scores(qh_.data() + (size_t(kvh) * kChunk + t0) * group * hd, nq, kvh, c0, c1 - c0, S + a.srow(kvh, 0));
    for (int t = t0; t < t1; ++t)
        for (int kvh = h0; cnt[t - t0] > 0 && kvh < h1; ++kvh)
            for (int g = 0; g < group; ++g) {
                float* P = partial(a, t, kvh, split) + size_t(g) * a.ldp;
                P[1] = k_.softmax_partial(S + a.srow(kvh, t - t0) + size_t(g) * kSplit, cnt[t - t0], &P[0]);
                std::memset(P + 2, 0, sizeof(float) * hd);
            }
    for (int kvh = h0; kvh < h1; ++kvh) {
        // positions all of the unit's tokens see, then each token's own remainder (the
        // diagonal): a query's sum runs over its positions in order either way
        if (common > 0) kv.values(S + a.srow(kvh, 0), nq, kvh, c0, common, partial(a, t0, kvh, split) + 2);
        for (int t = t0; t < t1; ++t)
            if (cnt[t - t0] > common)
                kv.values(S + a.srow(kvh, t - t0) + common, group, kvh, c0 + common, cnt[t - t0] - common,
                          partial(a, t, kvh, split) + 2);
    }
    if (pending_[u].fetch_sub(1, std::memory_order_acq_rel) == 1) merge_unit(a, t0, t1);  // the unit's last split
}

void Context::merge_unit(const AttnPlan& a, int t0, int t1) {
    // each query's partials in split order: one max, then the weighted sum
    const int n_head = model_->cfg.n_head, hd = a.hd;
    const size_t pstride = a.pstride;  // between a query's splits
    for (int t = t0; t < t1; ++t)
        for (int h = 0; h < n_head; ++h) {
            const float* P0 = partial(a, t, h / a.group, 0) + size_t(h % a.group) * a.ldp;
            const int ns = (len_of(t) + kSplit - 1) / kSplit;
            float mx = P0[0];
            for (int s = 1; s < ns; ++s) mx = std::max(mx, P0[s * pstride]);
            float* out = att_.data() + (size_t(t) * n_head + h) * hd;
            std::memset(out, 0, sizeof(float) * hd);
            float sum = 0.0f;
            for (int s = 0; s < ns; ++s) {
                const float* P = P0 + s * pstride;
                const float w = std::exp2(P[0] - mx);
                sum += P[1] * w;
                k_.axpy(w, P + 2, out, hd);
            }
            const float inv = 1.0f / sum;
            for (int d = 0; d < hd; ++d) out[d] *= inv;
        }
}

}  // namespace zen5
