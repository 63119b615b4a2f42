"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded, with top-k logprobs.

Filters apply in llama.cpp's order (top-k, then top-p, then min-p, on temperature-scaled
probabilities). Reported logprobs are those of the model's own distribution (log-softmax of the
raw logits), as OpenAI's `logprobs` reports them, independent of the sampling filters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zen5 import _native
from zen5.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob) of the most likely tokens


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


class Sampler:
    """Picks the next token from a logits vector; one per generation (it owns the RNG)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0 or p.top_k == 1:
            return int(np.argmax(logits))
        # One uniform draw, mapped to a token as Generator.choice(p=...) maps it (the filters and
        # the mapping run natively: numpy's version cost ~200 us per decoded token, see sampler.h)
        u = float(self.rng.random())
        # top_k at or past the vocabulary keeps every token (and a huge one must not overflow the
        # native int)
        top_k = min(p.top_k, len(logits))
        tok = _native.sample_token(np.asarray(logits, np.float32), p.temperature, top_k, p.top_p, p.min_p, u)
        return tok if tok >= 0 else int(np.argmax(logits))  # NaN, or no finite max: the argmax

    def logprob(self, logits: np.ndarray, token_id: int) -> TokenLogprob:
        return token_logprob(logits, token_id, self.params.logprobs)


def token_logprob(logits: np.ndarray, token_id: int, n: int) -> TokenLogprob:
    """The model's log-probability of `token_id` and its `n` most likely tokens, best first
    (log_softmax's values, computed for those tokens only)."""
    x = np.asarray(logits)
    top = float(x.max())
    if not np.isfinite(top):
        lp = log_softmax(x)
        return TokenLogprob(token_id, float(lp[token_id]), tuple((int(i), float(lp[i])) for i in
                                                                  np.argsort(-lp, kind="stable")[:n]))
    log_z = np.log(np.exp(x.astype(np.float64) - top).sum())

    def lp(i):
        return (np.float64(x[i]) - top) - log_z

    ids = largest(x, n, top) if n else np.array([], dtype=np.int64)
    ids = ids[np.argsort(-x[ids], kind="stable")]
    return TokenLogprob(token_id, float(lp(token_id)), tuple((int(i), float(lp(i))) for i in ids))


def largest(x: np.ndarray, k: int, top: float) -> np.ndarray:
    """Ids, ascending, of the k largest of x (1 <= k; which of equal values at the k-th is
    arbitrary): a threshold cut widened until it holds k, then a partition of the cut only."""
    if k >= x.size:
        return np.arange(x.size)
    width = 8.0
    while True:
        cand = np.flatnonzero(x >= top - width) if width < 1e30 else np.arange(x.size)
        if cand.size >= k:
            return np.sort(cand[np.argpartition(-x[cand], k - 1)[:k]]) if cand.size > k else cand
        width *= 16.0
