"""The KV cache owned by C++: one batch, token by token, rewind-and-recompute and a snapshot
restored in a fresh process must all give the same logits; snapshots refuse foreign or damaged
data with typed errors; the context limit is a typed error that leaves the cache usable."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import zen5
from zen5.engine import Engine

pytestmark = pytest.mark.model
TEXT = "<|im_start|>user\nList three prime numbers and explain why they are prime.<|im_end|>\n"


def test_batch_vs_token_by_token_vs_rewind(smollm2):
    eng = smollm2
    toks = eng.tokenizer.encode(TEXT)
    eng.reset()
    batch = eng.ctx.eval(toks, all_logits=True)
    eng.reset()
    single = np.stack([eng.ctx.eval([t], all_logits=True)[0] for t in toks])
    # one kernel path, same summation order per token: bit-identical
    assert np.array_equal(batch, single)
    # rewind to the middle and recompute the second half
    half = len(toks) // 2
    eng.ctx.rewind(half)
    again = eng.ctx.eval(toks[half:], all_logits=True)
    assert np.array_equal(again, batch[half:])
    eng.reset()


def test_long_batch_equals_tokens_one_by_one_across_splits(smollm2):
    """Past 256 positions attention runs in cache splits, prefill in 256-token chunks and
    several tokens' queries per kernel call; none of it may change a token's bits."""
    eng = smollm2
    toks = (eng.tokenizer.encode(TEXT) * 40)[:620]
    eng.reset()
    whole = eng.ctx.eval(toks, all_logits=True)  # chunks 0-255, 256-511, 512-619
    eng.ctx.rewind(497)                          # a split, a chunk and a key tile boundary inside
    batch = eng.ctx.eval(toks[497:], all_logits=True)
    eng.ctx.rewind(497)
    single = np.stack([eng.ctx.eval([t], all_logits=True)[0] for t in toks[497:]])
    assert np.array_equal(batch, whole[497:])
    assert np.array_equal(single, whole[497:])
    eng.reset()


def test_thread_count_does_not_change_logits(smollm2_path):
    toks = Engine.load(smollm2_path, ctx=128, threads=1).tokenizer.encode(TEXT)
    out = [Engine.load(smollm2_path, ctx=128, threads=n).ctx.eval(toks, all_logits=True) for n in (1, 2, 3)]
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2])


def test_snapshot_restore_in_fresh_process(smollm2, smollm2_path, tmp_path):
    eng = smollm2
    toks = eng.tokenizer.encode(TEXT)
    eng.reset()
    eng.ctx.eval(toks)
    before = eng.ctx.logits()
    snap = eng.ctx.snapshot()
    eng.ctx.eval([42])
    after_next = eng.ctx.logits()
    (tmp_path / "kv.bin").write_bytes(snap)
    script = f"""
import numpy as np, zen5
from zen5.engine import Engine
e = Engine.load({smollm2_path!r}, ctx=1024)
e.ctx.restore(open({str(tmp_path / 'kv.bin')!r}, 'rb').read())
np.save({str(tmp_path / 'a.npy')!r}, e.ctx.logits())
e.ctx.eval([42])
np.save({str(tmp_path / 'b.npy')!r}, e.ctx.logits())
print(e.ctx.n_past)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) == len(toks) + 1
    assert np.array_equal(np.load(tmp_path / "a.npy"), before)       # bit for bit
    assert np.array_equal(np.load(tmp_path / "b.npy"), after_next)   # and the cache too
    eng.reset()


def test_snapshot_is_refused_when_damaged_or_foreign(smollm2, tiny_deepseek_dir):
    eng = smollm2
    eng.reset()
    eng.ctx.eval(eng.tokenizer.encode("Hello there"))
    snap = eng.ctx.snapshot()
    with pytest.raises(zen5.BadSnapshot, match="too short|bytes"):
        eng.ctx.restore(snap[: len(snap) // 2])
    flipped = bytearray(snap)
    flipped[len(snap) // 2] ^= 0x40
    with pytest.raises(zen5.BadSnapshot, match="checksum"):
        eng.ctx.restore(bytes(flipped))
    with pytest.raises(zen5.BadSnapshot, match="magic"):
        eng.ctx.restore(b"X" * len(snap))
    other = Engine.load(str(tiny_deepseek_dir), ctx=64)
    other.ctx.eval([0, 1, 2])
    with pytest.raises(zen5.ModelMismatch, match="different model"):
        eng.ctx.restore(other.ctx.snapshot())
    # nothing above touched the live state
    assert eng.ctx.n_past == len(eng.tokenizer.encode("Hello there"))
    eng.reset()


def test_context_overflow_is_typed_and_harmless(smollm2_path):
    eng = Engine.load(smollm2_path, ctx=32)
    toks = eng.tokenizer.encode("one two three four five six seven eight nine ten")
    eng.ctx.eval(toks)
    n = eng.ctx.n_past
    with pytest.raises(zen5.ContextOverflow, match="exceed the context of 32"):
        eng.ctx.eval(list(range(100, 140)))
    assert eng.ctx.n_past == n  # refused before touching the cache
    with pytest.raises(zen5.ContextOverflow):
        eng.generate("word " * 100, max_tokens=4)
    with pytest.raises(zen5.ZenError, match="rewind"):
        eng.ctx.rewind(n + 1)
    with pytest.raises(zen5.ZenError, match="vocabulary"):
        eng.ctx.eval([10**6])


def test_generation_stops_at_the_context_limit(smollm2_path):
    eng = Engine.load(smollm2_path, ctx=24)
    out = eng.generate("Count: 1 2 3 4 5", max_tokens=100, temperature=0)
    assert out.finish_reason == "length"
    assert out.prompt_tokens + out.completion_tokens <= 24 + 1


def test_snapshot_refuses_the_other_matmul_path(smollm2_path):
    a = Engine.load(smollm2_path, ctx=64, matmul="int8")
    b = Engine(a.weights, ctx=64, matmul="f32")
    a.ctx.eval([1, 2, 3])
    with pytest.raises(zen5.ModelMismatch, match="int8 matmuls"):
        b.ctx.restore(a.ctx.snapshot())
