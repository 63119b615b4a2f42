"""Sampler semantics on synthetic logits (no model): each filter, seeds, logprobs."""
import numpy as np
import pytest

from zen5.sampling import Sampler, SamplingParams, log_softmax

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def draws(n=4000, **kw):
    s = Sampler(SamplingParams(seed=0, **kw))
    return np.bincount([s.sample(LOGITS) for _ in range(n)], minlength=5) / n


def test_greedy():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS) == 0
    assert Sampler(SamplingParams(temperature=2.0, top_k=1)).sample(LOGITS) == 0


def test_temperature_one_follows_the_distribution():
    freq = draws(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert np.allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)


def test_filters():
    assert draws(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)[2:].sum() == 0
    # top_p=0.7: 0.5 + 0.2 reaches it, so only the first two survive
    assert draws(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0)[2:].sum() == 0
    # min_p=0.25: keep p >= 0.125, i.e. the first three
    f = draws(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25)
    assert f[3:].sum() == 0 and f[2] > 0


def test_seed_reproducible_and_different_seeds_differ():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)

    def run(seed):
        s = Sampler(SamplingParams(seed=seed, temperature=1.0, top_k=0, min_p=0))
        return [s.sample(logits) for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_logprobs():
    s = Sampler(SamplingParams(logprobs=3))
    lp = s.logprob(LOGITS, 1)
    assert lp.token_id == 1 and lp.logprob == pytest.approx(np.log(0.2), abs=1e-6)
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert np.exp(log_softmax(LOGITS)).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-1), dict(logprobs=50)])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_tiny_temperature_with_masked_logits_picks_the_top():
    """A temperature near 0 (the OpenAPI fuzz sent 1e-308) overflows logits / T; with tokens
    masked to -inf (constrained decoding) that once made the probabilities NaN."""
    logits = np.array([1.0, -np.inf, 3.0, 2.5, -np.inf], dtype=np.float32)
    for t in (1e-308, 1e-30, 1e-3):
        for k in (0, 2, 40):
            assert Sampler(SamplingParams(temperature=t, top_k=k, seed=1)).sample(logits) == 2


def test_first_stop_is_the_earliest_match_and_the_first_listed_on_a_tie():
    from zen5.stop_strings import find_stop, first_stop
    assert first_stop("The capital is Paris", ["is", "a", "cap"]) == (4, "cap")
    assert first_stop("abc", ["bc", "b"]) == (1, "bc")      # same index: the first listed
    assert first_stop("abc", ["x"]) is None and find_stop("abc", ["x"]) is None
    assert find_stop("a stop here", ["stop"]) == 2


def _plain_sample(params: SamplingParams, rng: np.random.Generator, logits: np.ndarray) -> int:
    """The filters written plainly over the whole vocabulary, sorted (the oracle for the
    sampler's threshold cut): top-k, top-p, min-p on temperature-scaled probabilities."""
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        x = (x - x.max()) / params.temperature
    ids = np.arange(x.size)
    if params.top_k and params.top_k < x.size:
        ids = np.sort(np.argpartition(-x, params.top_k - 1)[: params.top_k])
    ids = ids[np.argsort(-x[ids], kind="stable")]  # most likely first, ties by id
    probs = np.exp(x[ids] - x[ids[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        ids, probs = ids[:keep], probs[:keep]
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs[0]
        ids, probs = ids[keep], probs[keep]
    return int(ids[rng.choice(len(ids), p=probs / probs.sum())])


@pytest.mark.parametrize("kw", [dict(), dict(top_k=0), dict(top_k=0, min_p=0.0), dict(top_k=5, top_p=1.0, min_p=0.0),
                                dict(temperature=1.7, top_p=0.5), dict(temperature=0.3, top_k=200, min_p=0.0),
                                dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                                dict(temperature=4.0, top_k=0, min_p=0.0)])
def test_the_threshold_cut_samples_what_the_plain_filters_sample(kw):
    """The sampler cuts the vocabulary by a threshold before filtering (sorting all 49k logits
    cost 0.5 ms per token); seeded, it must pick exactly the tokens the plain definition picks,
    for flat and peaked distributions over a real vocabulary size, with masked tokens."""
    rng = np.random.default_rng(7)
    for scale in (0.5, 3.0, 12.0):
        logits = (rng.standard_normal(49152) * scale).astype(np.float32)
        logits[rng.choice(49152, 500, replace=False)] = -np.inf
        params = SamplingParams(seed=11, **kw)
        ours, plain_rng = Sampler(params), np.random.default_rng(11)
        got = [ours.sample(logits) for _ in range(30)]
        assert got == [_plain_sample(params, plain_rng, logits) for _ in range(30)], scale


def test_logprobs_over_a_real_vocabulary_equal_the_full_log_softmax():
    """token_logprob computes log_softmax's values for the reported tokens only, and finds the
    top n by a threshold cut: the same ids, order and bits as the full computation."""
    rng = np.random.default_rng(3)
    for scale in (0.3, 4.0):
        logits = (rng.standard_normal(49152) * scale).astype(np.float32)
        logits[:100] = -np.inf
        full = log_softmax(logits)
        for tok, n in ((5, 0), (123, 1), (40000, 7), (int(np.argmax(logits)), 20)):
            got = Sampler(SamplingParams(logprobs=n)).logprob(logits, tok)
            best = np.argsort(-full, kind="stable")[:n]
            assert got.logprob == full[tok]
            assert [t for t, _ in got.top] == best.tolist() and [v for _, v in got.top] == full[best].tolist()


def test_ties_rank_by_lower_id_and_bad_logits_fall_back_to_the_argmax():
    """Equal logits rank by token id (top_k=3 of a flat vector keeps tokens 0-2); a NaN logit
    makes the native sampler draw nothing and the Sampler fall back to argmax; the native entry
    point refuses out-of-range parameters with a clear error."""
    from zen5 import ZenError, _native
    flat = np.zeros(1000, np.float32)
    s = Sampler(SamplingParams(seed=0, temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert {s.sample(flat) for _ in range(200)} == {0, 1, 2}
    bad = LOGITS.copy()
    bad[3] = np.nan
    assert _native.sample_token(bad, 1.0, 0, 1.0, 0.0, 0.5) == -1
    assert Sampler(SamplingParams(seed=0)).sample(bad) == int(np.argmax(bad))
    assert _native.sample_token(np.full(4, -np.inf, np.float32), 1.0, 2, 1.0, 0.0, 0.5) == -1
    for args in [(0.0, 40, 0.9, 0.0, 0.5), (1.0, 40, 0.0, 0.0, 0.5), (1.0, 40, 0.9, 1.5, 0.5),
                 (1.0, 40, 0.9, 0.0, 1.0)]:
        with pytest.raises(ZenError):
            _native.sample_token(LOGITS, *args)
    with pytest.raises(ZenError):
        _native.sample_token(np.zeros(0, np.float32), 1.0, 0, 1.0, 0.0, 0.5)


def test_the_native_sampler_agrees_with_the_plain_filters_on_random_edge_cases():
    """Differential fuzz: vocabularies of 1 to 1,000 (block tails included), masked tokens,
    temperatures from 1e-30 to 1e30, top_k beyond the vocabulary, top_p down to 1e-9, min_p up
    to 1. Tie-free logits, so the plain definition's choice is unique: the same tokens, and never
    a masked one."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.choice([1, 2, 3, 17, 64, 65, 200, 1000]))
        x = rng.permutation(np.linspace(-1, 1, n) * rng.choice([0.01, 1, 10, 100])).astype(np.float32)
        if rng.random() < 0.3:
            x[rng.random(n) < 0.5] = -np.inf
            x[int(rng.integers(n))] = 0.5 if n > 1 else 0.0
        params = SamplingParams(seed=trial, temperature=float(rng.choice([1e-30, 0.05, 0.8, 5.0, 1e30])),
                                top_k=int(rng.choice([0, 2, 5, 40, 10**6])),
                                top_p=float(rng.choice([1e-9, 0.5, 0.95, 1.0])),
                                min_p=float(rng.choice([0.0, 0.05, 0.5, 1.0])))
        if len(np.unique(x[np.isfinite(x)])) < np.isfinite(x).sum():
            continue  # (the 0.5 may repeat a value)
        ours, plain_rng = Sampler(params), np.random.default_rng(trial)
        got = [ours.sample(x) for _ in range(4)]
        with np.errstate(all="ignore"):
            assert got == [_plain_sample(params, plain_rng, x) for _ in range(4)], (trial, params)
        assert all(np.isfinite(x[g]) for g in got)


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    """A top_k past the vocabulary (Anthropic accepts any integer; 2^32 once overflowed the native
    call into a 500 that leaked its signature) samples exactly as keeping every token does."""
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    for k in (1000, 5000, 2 ** 32, 2 ** 70):
        def draws(top_k):
            return [Sampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, seed=s)).sample(logits)
                    for s in range(20)]
        a, b = draws(k), draws(0)
        assert a == b, k
