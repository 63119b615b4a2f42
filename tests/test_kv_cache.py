"""The KV cache owned by C++: one batch, token by token, rewind-and-recompute and a snapshot
restored in a fresh process must all give the same logits; snapshots refuse foreign or damaged
data with typed errors; the context limit is a typed error that leaves the cache usable."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import zen5
from tiers import FAST_TIERS
from zen5.engine import Engine

pytestmark = pytest.mark.model
# the SIMD tiers this machine runs (the reference is checked on the short test only: it is slow)
KV_TIERS = FAST_TIERS or ["ref"]
TEXT = "<|im_start|>user\nList three prime numbers and explain why they are prime.<|im_end|>\n"


@pytest.mark.parametrize("isa", ["ref", *FAST_TIERS])
def test_batch_vs_token_by_token_vs_rewind(smollm2, isa):
    eng = Engine(smollm2.weights, n_ctx=256, isa=isa)
    toks = eng.tokenizer.encode(TEXT)
    eng.reset()
    batch = eng.native_ctx.eval(toks, all_logits=True)
    eng.reset()
    single = np.stack([eng.native_ctx.eval([t], all_logits=True)[0] for t in toks])
    # one kernel path, same summation order per token: bit-identical
    assert np.array_equal(batch, single)
    # rewind to the middle and recompute the second half
    half = len(toks) // 2
    eng.native_ctx.rewind(half)
    again = eng.native_ctx.eval(toks[half:], all_logits=True)
    assert np.array_equal(again, batch[half:])
    eng.reset()


@pytest.mark.parametrize("isa", KV_TIERS)
def test_long_batch_equals_tokens_one_by_one_across_splits(smollm2, isa):
    """Past 512 positions attention runs in cache splits, prefill in 256-token chunks and
    several tokens' queries per kernel call; none of it may change a token's bits."""
    eng = Engine(smollm2.weights, n_ctx=1024, isa=isa)
    toks = (eng.tokenizer.encode(TEXT) * 40)[:620]
    eng.reset()
    whole = eng.native_ctx.eval(toks, all_logits=True)  # chunks 0-255, 256-511, 512-619
    eng.native_ctx.rewind(497)                          # a split, a chunk and a key tile boundary inside
    batch = eng.native_ctx.eval(toks[497:], all_logits=True)
    eng.native_ctx.rewind(497)
    single = np.stack([eng.native_ctx.eval([t], all_logits=True)[0] for t in toks[497:]])
    assert np.array_equal(batch, whole[497:])
    assert np.array_equal(single, whole[497:])
    eng.reset()


@pytest.mark.parametrize("isa", KV_TIERS)
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_small_batches_equal_tokens_one_by_one_across_splits(smollm2, kv_type, isa):
    """Batches of 2-8 tokens (a speculative decoder's verifications) take decode's task layout,
    a task per (split, kv head); across a split boundary they still give each token's bits."""
    eng = Engine(smollm2.weights, n_ctx=1024, kv_type=kv_type, isa=isa)
    toks = (eng.tokenizer.encode(TEXT) * 40)[:560]
    whole = eng.native_ctx.eval(toks, all_logits=True)
    pos = 500
    eng.native_ctx.rewind(pos)
    for size in (2, 7, 3, 8, 5, 4, 1, 6, 8, 2):   # 500 -> 546: crosses 512 inside a batch
        rows = eng.native_ctx.eval(toks[pos:pos + size], all_logits=True)
        assert np.array_equal(rows, whole[pos:pos + size]), (kv_type, pos, size)
        pos += size
    assert pos == 546


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_decode_deep_in_the_cache_equals_the_batch(smollm2, kv_type, threads):
    """A decoded token's attention tasks are (split, kv head) while the splits are fewer than
    twice the threads and whole splits beyond: decoding through both layouts (from 3 to 5
    splits) gives the bits of one batch."""
    eng = Engine(smollm2.weights, n_ctx=2304, kv_type=kv_type, threads=threads)
    toks = (eng.tokenizer.encode(TEXT) * 160)[:2070]
    whole = eng.native_ctx.eval(toks, all_logits=True)
    eng.native_ctx.rewind(1530)
    for pos in (1530, 2060):  # 3 splits then 4 (2 threads: per head, then per split), then 5
        eng.native_ctx.eval(toks[eng.native_ctx.n_past:pos])
        single = np.stack([eng.native_ctx.eval([t], all_logits=True)[0] for t in toks[pos:pos + 10]])
        assert np.array_equal(single, whole[pos:pos + 10]), (kv_type, threads, pos)


def test_thread_count_does_not_change_logits(smollm2_path):
    toks = Engine.load(smollm2_path, n_ctx=128, threads=1).tokenizer.encode(TEXT)
    out = [Engine.load(smollm2_path, n_ctx=128, threads=n).native_ctx.eval(toks, all_logits=True) for n in (1, 2, 3)]
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2])


@pytest.mark.parametrize("matmul", ["int8", "f32"])
def test_any_thread_count_gives_every_row(tmp_path, matmul):
    """Matmuls are cut into row slices per thread (4 per thread in prefill): with FFN rows 4,864
    wide, 74 or more threads once made more slices than a fixed table held and the rows past it
    were never computed. Prefill and decode at every count, oversubscribed on this machine, give
    one thread's logits bit for bit."""
    import tiny_gguf

    path = tiny_gguf.write_gguf(tmp_path / "wide-ffn.gguf", n_ff=4864)
    toks = list(range(3, 35))

    def run(threads):
        eng = Engine.load(path, n_ctx=64, threads=threads, matmul=matmul)
        prefill = eng.native_ctx.eval(toks, all_logits=True)
        decode = np.stack([eng.native_ctx.eval([t], all_logits=True)[0] for t in (40, 41, 42)])
        return prefill, decode

    one = run(1)
    for threads in (2, 3, 7, 64, 74, 128, 192, 256):
        got = run(threads)
        assert np.array_equal(got[0], one[0]), (threads, "prefill")
        assert np.array_equal(got[1], one[1]), (threads, "decode")


def test_snapshot_restore_in_fresh_process(smollm2, smollm2_path, tmp_path):
    eng = smollm2
    toks = eng.tokenizer.encode(TEXT)
    eng.reset()
    eng.native_ctx.eval(toks)
    before = eng.native_ctx.logits()
    snap = eng.native_ctx.snapshot()
    eng.native_ctx.eval([42])
    after_next = eng.native_ctx.logits()
    (tmp_path / "kv.bin").write_bytes(snap)
    script = f"""
import numpy as np, zen5
from zen5.engine import Engine
e = Engine.load({smollm2_path!r}, n_ctx=1024)
e.native_ctx.restore(open({str(tmp_path / 'kv.bin')!r}, 'rb').read())
np.save({str(tmp_path / 'a.npy')!r}, e.native_ctx.logits())
e.native_ctx.eval([42])
np.save({str(tmp_path / 'b.npy')!r}, e.native_ctx.logits())
print(e.native_ctx.n_past)
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
    eng.native_ctx.eval(eng.tokenizer.encode("Hello there"))
    snap = eng.native_ctx.snapshot()
    with pytest.raises(zen5.BadSnapshot, match="too short|bytes"):
        eng.native_ctx.restore(snap[: len(snap) // 2])
    flipped = bytearray(snap)
    flipped[len(snap) // 2] ^= 0x40
    with pytest.raises(zen5.BadSnapshot, match="checksum"):
        eng.native_ctx.restore(bytes(flipped))
    with pytest.raises(zen5.BadSnapshot, match="magic"):
        eng.native_ctx.restore(b"X" * len(snap))
    other = Engine.load(str(tiny_deepseek_dir), n_ctx=64)
    other.native_ctx.eval([0, 1, 2])
    with pytest.raises(zen5.ModelMismatch, match="different model"):
        eng.native_ctx.restore(other.native_ctx.snapshot())
    # nothing above touched the live state
    assert eng.native_ctx.n_past == len(eng.tokenizer.encode("Hello there"))
    eng.reset()


def test_context_overflow_is_typed_and_harmless(smollm2_path):
    eng = Engine.load(smollm2_path, n_ctx=32)
    toks = eng.tokenizer.encode("one two three four five six seven eight nine ten")
    eng.native_ctx.eval(toks)
    n = eng.native_ctx.n_past
    with pytest.raises(zen5.ContextOverflow, match="exceed the context of 32"):
        eng.native_ctx.eval(list(range(100, 140)))
    assert eng.native_ctx.n_past == n  # refused before touching the cache
    with pytest.raises(zen5.ContextOverflow):
        eng.generate("word " * 100, max_tokens=4)
    with pytest.raises(zen5.ZenError, match="rewind"):
        eng.native_ctx.rewind(n + 1)
    with pytest.raises(zen5.ZenError, match="vocabulary"):
        eng.native_ctx.eval([10**6])


def test_generation_stops_at_the_context_limit(smollm2_path):
    eng = Engine.load(smollm2_path, n_ctx=24)
    out = eng.generate("Count: 1 2 3 4 5", max_tokens=100, temperature=0)
    assert out.finish_reason == "length"
    assert out.prompt_tokens + out.completion_tokens <= 24 + 1


def test_snapshot_refuses_the_other_matmul_path(smollm2_path):
    a = Engine.load(smollm2_path, n_ctx=64, matmul="int8")
    b = Engine(a.weights, n_ctx=64, matmul="f32")
    a.native_ctx.eval([1, 2, 3])
    with pytest.raises(zen5.ModelMismatch, match="int8 matmuls"):
        b.native_ctx.restore(a.native_ctx.snapshot())


# ---- the q8_0 cache (int8 values + one f32 scale per position and kv head) --------------------

def _snapshot_layers(blob: bytes, eng: Engine, elem: np.dtype, scales: bool) -> list[tuple]:
    """Per layer (K rows, V rows[, K scales, V scales]) from a Context.snapshot() blob: the
    header (its size is at byte 12), then per layer K then V rows (n_past, kv_dim) and, for
    q8_0, the K then V scales (n_head_kv, n_past)."""
    c, n = eng.config, eng.native_ctx.n_past
    kvd = c.n_head_kv * c.head_dim
    at = int.from_bytes(blob[12:16], "little")
    out = []
    for _ in range(c.n_layer):
        part = []
        for shape, dt in [((n, kvd), elem)] * 2 + ([((c.n_head_kv, n), np.float32)] * 2 if scales else []):
            size = int(np.prod(shape)) * np.dtype(dt).itemsize
            part.append(np.frombuffer(blob, dt, count=int(np.prod(shape)), offset=at).reshape(shape))
            at += size
        out.append(tuple(part))
    return out


def test_q8_cache_stores_each_head_as_int8_and_a_scale(smollm2_path):
    """Layer 0's K and V depend only on the embeddings, so an f32 cache and a q8_0 cache fed the
    same tokens must hold the same vectors before quantization: the q8_0 rows must be exactly
    round(x / d) with d = max|x| / 127 per position and head (round half to even), computed here
    in numpy from the f32 cache's rows."""
    f32 = Engine.load(smollm2_path, n_ctx=128, matmul="f32", kv_type="f32")
    q8 = Engine(f32.weights, n_ctx=128, matmul="f32", kv_type="q8_0")
    assert (f32.kv_type, q8.kv_type) == ("f32", "q8_0")
    toks = f32.tokenizer.encode(TEXT)
    f32.native_ctx.eval(toks)
    q8.native_ctx.eval(toks)
    c = f32.config
    k, v = _snapshot_layers(f32.native_ctx.snapshot(), f32, np.float32, False)[0]
    kq, vq, ks, vs = _snapshot_layers(q8.native_ctx.snapshot(), q8, np.int8, True)[0]
    for x, xq, xs in ((k, kq, ks), (v, vq, vs)):
        heads = x.reshape(len(toks), c.n_head_kv, c.head_dim)
        d = (np.abs(heads).max(axis=2) / np.float32(127)).astype(np.float32)   # (n, heads)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        expect = np.clip(np.rint(heads * inv[:, :, None]), -127, 127).astype(np.int8)
        assert np.array_equal(xs.T, d)
        assert np.array_equal(xq.reshape(heads.shape), expect)
    # and the whole cache costs 8 bits + 32 bits per 64 values instead of fp16's 16
    assert q8.native_ctx.kv_bytes_per_token == c.n_layer * 2 * (c.n_head_kv * c.head_dim + 4 * c.n_head_kv)
    f16 = Engine(f32.weights, n_ctx=128)
    assert f16.kv_type == "f16" and f16.native_ctx.kv_bytes_per_token == c.n_layer * 2 * c.n_head_kv * c.head_dim * 2


@pytest.mark.parametrize("isa", KV_TIERS)
def test_q8_cache_batch_equals_tokens_one_by_one_and_snapshots_are_exact(smollm2, isa):
    """The q8_0 kernels keep the engine's guarantees: a batch across chunk, split and key-tile
    boundaries equals the tokens one by one, bit for bit, and a snapshot restores exactly."""
    eng = Engine(smollm2.weights, n_ctx=1024, kv_type="q8_0", isa=isa)
    toks = (eng.tokenizer.encode(TEXT) * 40)[:620]
    whole = eng.native_ctx.eval(toks, all_logits=True)
    eng.native_ctx.rewind(497)
    single = np.stack([eng.native_ctx.eval([t], all_logits=True)[0] for t in toks[497:]])
    assert np.array_equal(single, whole[497:])
    snap = eng.native_ctx.snapshot()
    nxt = eng.native_ctx.eval([42], all_logits=True)
    other = Engine(eng.weights, n_ctx=1024, kv_type="q8_0", isa=isa)
    other.native_ctx.restore(snap)
    assert np.array_equal(other.native_ctx.logits(), whole[-1])
    assert np.array_equal(other.native_ctx.eval([42], all_logits=True), nxt)
    f16 = Engine(eng.weights, n_ctx=1024, isa=isa)
    f16.native_ctx.eval(toks)
    assert len(snap) < 0.54 * len(f16.native_ctx.snapshot())   # 68 bytes per 64 values instead of 128
    with pytest.raises(zen5.ModelMismatch, match="q8_0 KV cache; this context's is f16"):
        f16.native_ctx.restore(snap)
    with pytest.raises(zen5.ModelMismatch, match="f16 KV cache; this context's is q8_0"):
        other.native_ctx.restore(f16.native_ctx.snapshot())
    assert other.native_ctx.n_past == 621   # a refused restore leaves the state alone


def test_unknown_kv_type_is_a_clear_error(smollm2_path):
    with pytest.raises(zen5.ZenError, match="f32, f16 or q8_0, got 'q4_0'"):
        Engine.load(smollm2_path, n_ctx=64, kv_type="q4_0")
