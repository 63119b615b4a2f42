#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace zen5 {

namespace {

constexpr int kBlock = 64;  // one vector pass per block for its max; most blocks go no further

// max and NaN test of x[i0:i1]. GCC does not vectorize a float max without -ffast-math, and a
// scalar pass over 49k logits was nearly all of the sampler's time; SSE2 is the x86-64 baseline.
inline float block_max(const float* x, int i0, int i1, bool* nan) {
    float m = -INFINITY;
    int i = i0;
#if defined(__SSE2__)
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, bad = _mm_setzero_ps();
    for (; i + 8 <= i1; i += 8) {
        const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
        m0 = _mm_max_ps(a, m0);  // a > m0 ? a : m0: a NaN leaves m0 (and is flagged below)
        m1 = _mm_max_ps(b, m1);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, _mm_max_ps(m0, m1));
    for (float v : lanes) m = v > m ? v : m;
    *nan |= _mm_movemask_ps(bad) != 0;
#endif
    for (; i < i1; ++i) {
        m = x[i] > m ? x[i] : m;
        *nan |= x[i] != x[i];
    }
    return m;
}

// Ranks tokens: larger logit first, then lower id.
struct Before {
    const float* x;
    bool operator()(int a, int b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};

// The k most likely tokens (a heap of the best so far: a block whose max does not beat the
// worst kept is skipped after one vector pass), and the max. False on a NaN.
bool top_k_set(const float* x, int n, int k, std::vector<int>& ids, float* top) {
    const Before before{x};
    bool nan = false;
    *top = -INFINITY;
    ids.clear();
    for (int i0 = 0; i0 < n; i0 += kBlock) {
        const int i1 = std::min(n, i0 + kBlock);
        const float m = block_max(x, i0, i1, &nan);
        *top = std::max(*top, m);
        // ids arrive in increasing order, so a value equal to the worst kept ranks after it
        if (int(ids.size()) == k && !(m > x[ids.front()])) continue;
        for (int i = i0; i < i1; ++i) {
            if (int(ids.size()) < k) {
                ids.push_back(i);
                std::push_heap(ids.begin(), ids.end(), before);  // front: the worst kept
            } else if (x[i] > x[ids.front()]) {
                std::pop_heap(ids.begin(), ids.end(), before);
                ids.back() = i;
                std::push_heap(ids.begin(), ids.end(), before);
            }
        }
    }
    return !nan;
}

// Every token at or above cut, and the max; false on a NaN.
bool above(const float* x, int n, double cut, std::vector<int>& ids, float* top) {
    bool nan = false;
    *top = -INFINITY;
    ids.clear();
    for (int i0 = 0; i0 < n; i0 += kBlock) {
        const int i1 = std::min(n, i0 + kBlock);
        const float m = block_max(x, i0, i1, &nan);
        *top = std::max(*top, m);
        if (double(m) < cut) continue;
        for (int i = i0; i < i1; ++i)
            if (double(x[i]) >= cut) ids.push_back(i);
    }
    return !nan;
}

}  // namespace

int sample_token(const float* x, int n, double temperature, int top_k, double top_p, double min_p, double u) {
    const int k = top_k > 0 && top_k < n ? top_k : n;
    const Before before{x};
    // exp of a token's scaled logit: shifted first, so a tiny temperature sends the others to
    // -inf and never the top to +inf; masked tokens (-inf) weigh 0
    auto weight = [&](int i, double top) { return std::exp((double(x[i]) - top) / temperature); };
    std::vector<int> ids;
    std::vector<double> p;  // exp(s - s_top) of ids, then the probabilities
    float top_f;
    double z = 0.0;  // the normalizer: over the top-k set, or over every token when top-k is off
    if (k < n) {
        if (!top_k_set(x, n, k, ids, &top_f) || !std::isfinite(top_f)) return -1;
    } else {
        // Top-k off: only tokens near the top can survive top-p or min-p. Cut at top - w (w in
        // temperature-scaled logits), widening until the cut holds the top-p prefix or every
        // token min-p keeps; past 4096 nothing counts (exp(-4096) is 0 in double).
        bool nan = false;
        const double m = block_max(x, 0, n, &nan);
        double w = top_p >= 1.0 && min_p == 0.0 ? INFINITY : 8.0;  // plain temperature: all
        for (;; w *= 4.0) {
            if (!above(x, n, w > 4096.0 ? -INFINITY : m - w * temperature, ids, &top_f) || !std::isfinite(top_f))
                return -1;
            if (w > 4096.0 || int(ids.size()) == n || (min_p > 0.0 && w >= 1.0 - std::log(min_p))) break;
            if (top_p < 1.0) {  // the cut is a prefix of the ranked vocabulary: is the cutoff in it?
                if (z == 0.0)
                    for (int i = 0; i < n; ++i) z += weight(i, m);
                double cum = 0.0;
                for (int i : ids) cum += weight(i, m) / z;
                if (cum >= top_p) break;
            }
        }
    }
    std::sort(ids.begin(), ids.end(), before);
    p.resize(ids.size());
    for (size_t j = 0; j < ids.size(); ++j) p[j] = weight(ids[j], top_f);
    if (k < n) {
        z = 0.0;
        for (double e : p) z += e;
    } else if (z == 0.0) {
        for (int i = 0; i < n; ++i) z += weight(i, top_f);
    }
    for (double& e : p) e /= z;
    size_t keep = p.size();
    if (top_p < 1.0) {  // the shortest prefix whose mass reaches top_p
        double cum = 0.0;
        for (size_t j = 0; j < p.size(); ++j)
            if ((cum += p[j]) >= top_p) {
                keep = j + 1;
                break;
            }
    }
    if (min_p > 0.0) {  // then only tokens at least min_p times as likely as the top
        const double floor = min_p * p[0];
        size_t m = 0;
        for (size_t j = 0; j < keep; ++j)
            if (p[j] >= floor) ids[m] = ids[j], p[m] = p[j], ++m;
        keep = m;
    }
    // Generator.choice(p=...): probabilities normalized, their cumulative sum divided by its
    // last value, and the first token whose cumulative value exceeds u
    double total = 0.0, last = 0.0, cdf = 0.0;
    for (size_t j = 0; j < keep; ++j) total += p[j];
    for (size_t j = 0; j < keep; ++j) last += p[j] / total;
    for (size_t j = 0; j < keep; ++j)
        if ((cdf += p[j] / total) / last > u) return ids[j];
    return ids[keep - 1];
}

}  // namespace zen5
