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
    from zen5.sampling import find_stop, first_stop
    assert first_stop("The capital is Paris", ["is", "a", "cap"]) == (4, "cap")
    assert first_stop("abc", ["bc", "b"]) == (1, "bc")      # same index: the first listed
    assert first_stop("abc", ["x"]) is None and find_stop("abc", ["x"]) is None
    assert find_stop("a stop here", ["stop"]) == 2
