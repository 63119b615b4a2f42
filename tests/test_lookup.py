"""Prompt-lookup speculative decoding (lookup.py): the lookup against a brute-force search,
and on real weights the one property that matters: a reply is the same token sequence with
lookup on or off (greedy and seeded), and the cache ends exactly at the reply with the logits of
its last token current, however the generation ended."""
from __future__ import annotations

import numpy as np
import pytest

from zen5 import _native
from zen5.chat_types import ChatRequest, Finish, Message, TextDelta
from zen5.engine import Engine
from zen5.lookup import NGRAM_MAX, NGRAM_MIN, DraftFeed, Lookup
from zen5.session import ChatSession


def brute_draft(tokens: list[int], limit: int) -> list[int]:
    """The latest earlier occurrence of the longest tail (NGRAM_MAX..NGRAM_MIN tokens), by scan."""
    n = len(tokens)
    for m in range(min(NGRAM_MAX, n - 1), NGRAM_MIN - 1, -1):
        tail = tokens[n - m:]
        for c in range(n - m - 1, -1, -1):
            if tokens[c:c + m] == tail:
                return tokens[c + m:c + m + limit]
    return []


def test_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    checked = found = 0
    for trial in range(300):
        vocab = int(rng.integers(2, 12))  # small vocabularies repeat n-grams often
        seq = rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist()
        lk = Lookup(seq[:len(seq) // 2], capacity=trial % 5)  # grows past its capacity (0 too)
        for t in seq[len(seq) // 2:]:
            lk.push(t)
        assert len(lk) == len(seq)
        for limit in (0, 1, 3, 7):
            want = brute_draft(seq, limit) if limit else []
            assert lk.draft(limit) == want, (seq, limit)
            checked += 1
            found += bool(want)
    assert found > checked // 3  # the search is really exercised


def test_lookup_prefers_the_longest_then_the_latest_match():
    # tail (7, 8, 9): its 3-gram occurred once (then 1); the 2-gram (8, 9) later (then 2)
    assert Lookup([7, 8, 9, 1, 5, 8, 9, 2, 6, 7, 8, 9], 16).draft(4) == [1, 5, 8, 9]
    assert Lookup([5, 8, 9, 2, 6, 4, 8, 9, 3, 0, 8, 9], 16).draft(2) == [3, 0]  # latest 2-gram
    assert Lookup([1, 2, 3, 4, 5, 6], 16).draft(4) == []          # nothing repeats
    assert Lookup([4, 1, 4, 2, 4], 16).draft(4) == []             # a 1-token tail is not enough
    assert Lookup([3, 3, 3, 3], 16).draft(5) == [3]               # overlapping: stops at the end


# Texts the model continues by copying (greedy and seeded), and one it does not.
REPEAT = "\n".join(f"- item {i}: the quick brown fox jumps over the lazy dog" for i in range(1, 12)) + "\n- item"
CODE = "".join(f"def {f}(a, b):\n    return a {o} b\n\n\n" for f, o in
               (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"))) + "def "


@pytest.fixture
def eng(smollm2):
    lookup = smollm2.lookup
    smollm2.reset()
    yield smollm2
    smollm2.lookup = lookup
    smollm2.reset()


def _generate(eng: Engine, lookup: int, prompt, **kw):
    eng.lookup = lookup
    eng.reset()
    g = eng.generate(prompt, **kw)
    return g, eng.tokens, eng.native_ctx.logits().copy(), g.usage


@pytest.mark.model
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"seed": 11}, {"seed": 5, "temperature": 1.3, "top_k": 0}])
@pytest.mark.parametrize("prompt", [REPEAT, CODE, "Write a short poem about the sea."])
def test_same_reply_and_same_cache_with_lookup_on_or_off(eng, prompt, sampling):
    off, off_tokens, off_logits, _ = _generate(eng, 0, prompt, max_tokens=64, **sampling)
    on, on_tokens, on_logits, usage = _generate(eng, 7, prompt, max_tokens=64, **sampling)
    assert on.token_ids == off.token_ids and on.text == off.text
    assert on.finish_reason == off.finish_reason
    assert on_tokens == off_tokens                   # the cache ends exactly at the reply
    assert np.array_equal(on_logits, off_logits)    # with the last token's logits current
    if prompt in (REPEAT, CODE):  # the text is copied: guesses really are kept
        assert usage.kept_tokens >= (16 if sampling.get("temperature") == 0 else 4)


@pytest.mark.model
@pytest.mark.parametrize("matmul", ["int8", "f32"])
def test_same_reply_on_the_reference_kernels(smollm2_path, matmul):
    """A machine without AVX-512 runs the scalar reference: it is batch-invariant too, so lookup
    keeps replies exact there (and on the exact f32 path)."""
    e = Engine.load(smollm2_path, n_ctx=512, threads=2, isa="ref", matmul=matmul)
    short = REPEAT.split("\n- item 6")[0] + "\n- item"   # 5 items: the scalar path is slow
    for sampling in ({"temperature": 0}, {"seed": 3}):
        res = []
        for lookup in (0, 5):
            e.lookup = lookup
            e.reset()
            g = e.generate(short, max_tokens=24, **sampling)
            res.append((g.token_ids, e.tokens, e.native_ctx.logits().tobytes()))
        assert res[0] == res[1] and g.usage.kept_tokens > 0


@pytest.mark.model
def test_stop_string_and_context_limit_end_at_the_same_place(smollm2_path):
    for n_ctx, kw in ((1024, {"stop": ["item 14"]}), (169 + 37, {})):
        e = Engine.load(smollm2_path, n_ctx=n_ctx, threads=1)
        prompt = e.tokenizer.encode(REPEAT)
        assert len(prompt) == 169
        res = []
        for lookup in (0, 7):
            e.lookup = lookup
            e.reset()
            g = e.generate(prompt, max_tokens=200, temperature=0, **kw)
            res.append((g.token_ids, g.text, g.finish_reason, e.tokens, e.native_ctx.logits().copy()))
        assert res[0][:4] == res[1][:4] and np.array_equal(res[0][4], res[1][4])
        assert g.usage.kept_tokens > 0
        if not kw:
            assert res[1][2] == "length" and len(res[1][3]) == n_ctx  # filled, never overflowed
        else:
            assert res[1][2] == "stop"
            assert res[1][1].endswith("item 13: the quick brown fox jumps over the lazy dog\n- ")


@pytest.mark.model
def test_a_stream_closed_mid_batch_leaves_exactly_the_streamed_tokens(eng, monkeypatch):
    eng.lookup = 7
    prompt = eng.tokenizer.encode(REPEAT)
    dropped = []  # guesses rewound with the kept row handed back
    rewind = eng.rewind

    def recording_rewind(n, last_logits=None):
        if last_logits is not None:
            dropped.append(eng.n_tokens - n)
        rewind(n, last_logits)

    monkeypatch.setattr(eng, "rewind", recording_rewind)
    it = eng.generate(prompt, max_tokens=100, temperature=0, stream=True)
    got = []
    for chunk in it:
        got.append(chunk.token_id)
        if len(got) == 23:
            break
    before = len(dropped)
    it.close()  # a client that disconnects
    assert eng.tokens == tuple(prompt) + tuple(got[:-1])  # the last one was sampled, not yet evaluated
    assert len(dropped) == before + 1 and dropped[-1] > 0  # closed mid-batch: its guesses dropped
    logits, last = eng.native_ctx.logits().copy(), eng.tokens[-1]
    eng.rewind(len(eng.tokens) - 1)
    eng.append([last])  # the logits the cache reports are those of its last token
    assert np.array_equal(eng.native_ctx.logits(), logits)


@pytest.mark.model
def test_batches_never_cross_an_aligned_frontier(eng):
    eng.lookup = 7
    eng.reset()
    eng.append(eng.tokenizer.encode(REPEAT)[:100])
    feed = DraftFeed(eng, max_draft=7, align=16)
    seen = 0
    for _ in range(80):
        tok = int(np.argmax(feed.logits()))
        feed.push(tok)
        if feed.n_tokens % 16 == 0:
            assert not feed.pending and eng.n_tokens == feed.n_tokens
            seen += 1
    feed.close()
    assert seen == 5 and feed.stats.accepted > 0


@pytest.mark.model
def test_rewind_with_logits_is_checked(smollm2):
    native_ctx = smollm2.native_ctx
    smollm2.reset()
    smollm2.append([1, 2, 3])
    with pytest.raises(_native.ZenError, match="vocab_size"):
        native_ctx.rewind(2, np.zeros(5, np.float32))
    with pytest.raises(_native.ZenError, match="rewind\\(0\\)"):
        native_ctx.rewind(0, np.zeros(smollm2.config.vocab_size, np.float32))
    smollm2.reset()


@pytest.mark.model
def test_chat_session_reply_is_the_same_with_lookup(smollm2_path, tmp_path):
    """Through the session layer (the server's path): same events, same live state."""
    msgs = (Message.text("user", "Continue this list up to item 20:\n" + REPEAT),)
    out = []
    for lookup in (0, 7):
        s = ChatSession(Engine.load(smollm2_path, n_ctx=2048, lookup=lookup), "chatml",
                        state_dir=tmp_path / str(lookup))
        events = list(s.chat(ChatRequest(msgs, max_tokens=120)))  # greedy
        fin = events[-1]
        assert isinstance(fin, Finish)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        out.append((text, fin.reason, fin.usage.completion_tokens, s.engine.tokens))
        # the counts travel with the request's usage (the server's /metrics reads them there)
        assert fin.usage.guessed_tokens >= fin.usage.kept_tokens >= (20 if lookup else 0)
        assert lookup or fin.usage.guessed_tokens == 0
    assert out[0] == out[1]


@pytest.mark.model
def test_a_bad_lookup_setting_is_a_clear_error(smollm2, monkeypatch):
    with pytest.raises(ValueError, match="integer >= 0, got -1"):
        Engine(smollm2.weights, n_ctx=64, lookup=-1)
    monkeypatch.setenv("ZEN5_LOOKUP", "lots")
    with pytest.raises(ValueError, match="ZEN5_LOOKUP.*got 'lots'"):
        Engine(smollm2.weights, n_ctx=64)
    monkeypatch.setenv("ZEN5_LOOKUP", "0")
    assert Engine(smollm2.weights, n_ctx=64).lookup == 0
