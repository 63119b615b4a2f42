"""Lean loading (issue 21): resident memory during and after a load stays near the bytes the
kernels read (the file's pages are released as the matrices are repacked), the KV cache is
resident only for the positions used, and a model that does not fit is refused up front.

Memory is measured in a fresh child process (/proc/self/status): the interpreter with numpy,
gguf, tokenizers and zen5 imported is the baseline, subtracted; VmHWM is reset to it through
/proc/self/clear_refs, so the peak is the load's own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tiny_gguf import write_gguf
from zen5 import _native
from zen5.engine import Engine
from zen5.loader import load_weights
from zen5.memory import InsufficientMemory, available_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")

MIB = 1 << 20
# What the load adds besides the arena, independent of the model's size: the Context's small
# scratch and logits, the thread pool, the loader's Python objects (a tiny vocabulary here), the
# allocator's slack.
ALLOWANCE = 24 * MIB
# hidden 1024, FFN 2816, 8 heads of 128 (4 kv heads), 12 layers: 140 M weights
DIMS = dict(n_layer=12, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, head_dim=128)

CHILD = r"""
import json, sys, time
import gguf, numpy, tokenizers  # the baseline holds the loader's imports
from zen5.engine import Engine
from zen5.loader import load_weights

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out

path, n_ctx, n_tokens, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
base = status()["VmRSS"]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
e = Engine(load_weights(path), n_ctx=n_ctx, threads=1, weight_cache=cache)
s = status()
info = e.info()
while not e.weight_cache["promoted"]:  # a cached arena moving onto huge pages
    time.sleep(0.01)
p = status()
out = dict(peak=s["VmHWM"] - base, after=s["VmRSS"] - base, weight_bytes=info["weight_bytes"],
           cache=info["weight_cache"], peak_promoted=p["VmHWM"] - base, after_promoted=p["VmRSS"] - base,
           kv_reserved=info["kv_bytes_reserved"], kv_resident=info["kv_bytes_resident"],
           kv_per_token=info["kv_bytes_per_token"])
if n_tokens:
    e.append(list(range(3, 3 + n_tokens)))
    out.update(after_eval=status()["VmRSS"] - base, kv_resident_eval=e.info()["kv_bytes_resident"])
print(json.dumps(out))
"""


def _measure(path, n_ctx=512, n_tokens=0, cache="off") -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(n_ctx), str(n_tokens), str(cache)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lean")
    return {t: write_gguf(d / f"big_{t.name}.gguf", matrix_type=t, fast=True, **DIMS)
            for t in (Q.Q8_0, Q.Q4_1, Q.BF16)}


@pytest.mark.parametrize("cached", [False, True], ids=["packed", "from-cache"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.BF16], ids=lambda t: t.name)
def test_peak_rss_during_and_after_load(big_models, qtype, cached, tmp_path):
    """Packing (no weight cache) and mapping the weight cache, then moving it onto huge pages."""
    path = big_models[qtype]
    if cached:
        # written in the background; the child's exit waits for it
        assert _measure(path, cache=tmp_path)["cache"] in ("writing", "written")
    m = _measure(path, cache=tmp_path if cached else "off")
    assert m["cache"] == ("hit" if cached else "off")
    w = m["weight_bytes"]
    assert w > 0.8 * os.path.getsize(path)  # the arena is about the file (the embedding is tiny here)
    # the KV cache is not counted (and none of it is resident before the first token)
    assert m["kv_resident"] == 0
    bound = 1.15 * w + ALLOWANCE
    assert m["peak"] <= bound, (f"peak RSS during load {m['peak'] / MIB:.1f} MiB > "
                                f"1.15 x {w / MIB:.1f} MiB + {ALLOWANCE / MIB:.0f} MiB")
    assert m["after"] <= bound, f"RSS after load {m['after'] / MIB:.1f} MiB, weights {w / MIB:.1f} MiB"
    assert m["peak_promoted"] <= bound and m["after_promoted"] <= bound, m


def test_kv_cache_resident_follows_use(big_models):
    path = big_models[Q.Q4_1]
    short, long = _measure(path, n_ctx=512), _measure(path, n_ctx=8192, n_tokens=40)
    assert long["kv_reserved"] >= 15 * short["kv_reserved"]
    # a long context costs address space, not memory: the same RSS after loading
    assert abs(long["after"] - short["after"]) < 8 * MIB, (long, short)
    # after 40 tokens: those positions' pages (whole key tiles of 16, 4 KiB pages), not n_ctx's
    layers, kv_pos = DIMS["n_layer"], long["kv_per_token"] // DIMS["n_layer"] // 2
    per_layer = -(-48 * kv_pos // 4096) * 4096 + 4096
    assert 0 < long["kv_resident_eval"] <= 2 * layers * per_layer, long
    assert long["after_eval"] - long["after"] < 16 * MIB + long["kv_resident_eval"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_weights(write_gguf(tmp_path_factory.mktemp("tiny") / "t.gguf", n_layer=2, n_embd=256, n_ff=512,
                                   n_head=4, n_head_kv=2, head_dim=64))


def test_refuses_a_model_that_does_not_fit(tiny, monkeypatch):
    built = []
    real = _native.Model
    monkeypatch.setattr(_native, "Model", lambda *a, **k: built.append(1) or real(*a, **k))
    kv_8k = _native.kv_cache_bytes(tiny.config.to_native(), 8192, "f16")
    weights = sum(_native.owned_matrix_bytes(t.ggml_type, *t.shape) for t in tiny.tensors.values()
                  if len(t.shape) == 2)
    monkeypatch.setenv("ZEN5_MEM_AVAILABLE", str(weights // 2))
    assert available_bytes() == (weights // 2, "ZEN5_MEM_AVAILABLE")
    with pytest.raises(InsufficientMemory, match="does not fit in memory.*smaller quantization"):
        Engine(tiny, n_ctx=64, threads=1)
    # the KV cache counts: 8192 f16 positions do not fit, 512 do; the message names the fixes
    monkeypatch.setenv("ZEN5_MEM_AVAILABLE", str(weights + kv_8k // 2))
    with pytest.raises(InsufficientMemory, match=r"smaller context.*q8_0") as e:
        Engine(tiny, n_ctx=8192, threads=1)
    assert "8192 tokens" in str(e.value) and "ZEN5_MEM_AVAILABLE" in str(e.value)
    assert not built, "refused after the weights were allocated"
    Engine(tiny, n_ctx=512, threads=1)
    assert built
    # an UnsupportedModelError (the CLI reports it as a load error) and a MemoryError
    assert isinstance(e.value, ValueError) and isinstance(e.value, MemoryError)


def test_available_memory_reads_the_machine(monkeypatch):
    monkeypatch.delenv("ZEN5_MEM_AVAILABLE", raising=False)
    avail, src = available_bytes()
    assert avail is not None and avail > 0 and src in ("MemAvailable", "the cgroup's memory.max")


def test_info_reports_weights_and_kv(tiny):
    e = Engine(tiny, n_ctx=1000, threads=1, kv_type="q8_0")
    info = e.info()
    assert info["weight_bytes"] == e.native.weight_bytes > 0
    assert info["kv_bytes_reserved"] == _native.kv_cache_bytes(tiny.config.to_native(), 1000, "q8_0")
    assert info["kv_bytes_reserved"] >= 1000 * info["kv_bytes_per_token"]
    e.append([5, 6, 7])
    assert 0 < e.info()["kv_bytes_resident"] <= info["kv_bytes_reserved"]


@pytest.mark.parametrize("piece", [1, 7, 32, 33, 4096])
def test_streamed_fingerprint_hash_matches(piece):
    data = np.random.default_rng(piece).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    whole, streamed = _native.testing.hash_pieces(data, 12345, piece)
    assert whole == streamed


def test_released_pages_read_back(tmp_path):
    """The file's pages are released after packing; everything read from the file later (the
    embedding rows, and every row on the f32 path and the reference tier) faults back in."""
    path = write_gguf(tmp_path / "m.gguf", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64)
    w = load_weights(path)
    copy = {n: type(t)(t.name, t.ggml_type, t.shape, np.array(t.data)) for n, t in w.tensors.items()}
    heap = type(w)(w.config, copy, w.tokenizer, w.chat_template, w.metadata)
    for kw in (dict(), dict(matmul="f32"), dict(isa="ref")):
        a, b = Engine(w, n_ctx=64, threads=1, **kw), Engine(heap, n_ctx=64, threads=1, **kw)
        assert a.native.fingerprint == b.native.fingerprint
        la, lb = a.append([1, 5, 9, 200], all_logits=True), b.append([1, 5, 9, 200], all_logits=True)
        np.testing.assert_array_equal(la, lb)


def test_the_fingerprint_covers_every_byte(tmp_path):
    """The fingerprint (which keys KV snapshots and the weight cache's trailer) changes with any
    one byte of the weights: a matrix's rows enter it as their 16-row groups' hashes, hashed by the
    tasks that pack them, the other tensors as a stream. Identical bytes give the same value."""
    path = write_gguf(tmp_path / "m.gguf", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64)
    w = load_weights(path)

    def fingerprint(name=None, at=0):
        copy = {n: type(t)(t.name, t.ggml_type, t.shape, np.array(t.data)) for n, t in w.tensors.items()}
        if name:
            flat = copy[name].data.reshape(-1).view(np.uint8)
            flat[at % flat.size] ^= 1
        heap = type(w)(w.config, copy, w.tokenizer, w.chat_template, w.metadata)
        return Engine(heap, n_ctx=16, threads=2, weight_cache="off").native.fingerprint

    base = fingerprint()
    assert fingerprint() == base
    emb = w.tensors["token_embd.weight"]
    rows = emb.shape[0]
    row_bytes = emb.data.size * emb.data.itemsize // rows
    flips = [("blk.0.ffn_gate.weight", 0), ("blk.1.ffn_down.weight", 12345), ("blk.1.ffn_down.weight", -1),
             ("token_embd.weight", (rows - 1) * row_bytes + 7),  # the tied head's last (partial) group
             ("blk.0.attn_norm.weight", 5)]
    got = {f: fingerprint(*f) for f in flips}
    assert all(v != base for v in got.values()), got
    assert len(set(got.values())) == len(flips)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.BF16], ids=lambda t: t.name)
def test_a_wider_load_pool_packs_the_same_arena(qtype, tmp_path, monkeypatch):
    """The weights are packed by the default thread count's cores even for a 1-thread engine
    (model.h pack_and_hash): the arena, so every logit, is the one packing on the engine's own thread
    gives (each task writes its own 16-row groups)."""
    import zen5.engine

    path = write_gguf(tmp_path / "m.gguf", matrix_type=qtype, n_layer=2, n_embd=256, n_ff=704, n_head=4,
                      n_head_kv=2, head_dim=64)
    prompt = [5, 17, 42, 9, 33, 2, 71, 8]
    logits = []
    for load_threads in (1, 4):
        monkeypatch.setattr(zen5.engine, "default_threads", lambda n=load_threads: n)
        e = Engine(load_weights(str(path)), threads=1, n_ctx=32, weight_cache="off")
        e.native_ctx.eval(prompt, True)
        logits.append(np.asarray(e.native_ctx.logits()).copy())
    assert np.isfinite(logits[0]).all()
    np.testing.assert_array_equal(logits[0], logits[1])
