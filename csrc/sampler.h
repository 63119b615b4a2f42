// Token sampling over a logits vector, natively: after a forward pass has streamed ~100 MB of
// weights through the caches, numpy's sampler (a dozen array operations) was a visible share of
// decode from cold caches (the timings: commit b931696). Its semantics are python/zen5/sampling.py's.
#pragma once
#include <cstdint>

namespace zen5 {

// The token drawn from logits[0:n] by the filters in llama.cpp's order: top-k (0 or >= n: off),
// then top-p (1: off), then min-p (0: off), on the probabilities softmax((x - max) / temperature)
// (temperature > 0) computed in double; u in [0, 1) is the caller's uniform draw, mapped as
// numpy's Generator.choice maps it (the first token whose normalized cumulative probability,
// most likely first, exceeds u). Ties rank by lower id; -inf logits (masked tokens) are never
// drawn. Returns -1, drawing nothing, when a logit is NaN or the max is not finite.
int sample_token(const float* logits, int n, double temperature, int top_k, double top_p, double min_p, double u);

}  // namespace zen5
