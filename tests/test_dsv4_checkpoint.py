"""The tiny DeepSeek V4 checkpoint generator and the transformers oracle (tests/dsv4_checkpoint.py).

Why: every engine-vs-oracle test of DeepSeek V4 rests on this checkpoint and oracle, so they must
be what they claim: byte-reproducible from a seed, written under the official tensor names with
the real dtypes and shapes (transformers must load every tensor with nothing left random), with
non-trivial values that expose swapped or ignored parameters, clamps that actually fire, discrete
decisions (experts, indexer rows) far from ties, an indexer that really selects, and an oracle
whose uncached forward equals its own cached decode. Pure numpy/torch/transformers: no zen5.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import dsv4_checkpoint as C

pytest.importorskip("transformers.models.deepseek_v4")


def _files(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and 8 + n <= len(raw)
    return json.loads(raw[8:8 + n])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return C.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "tiny")


@pytest.fixture(scope="module")
def oracle(ckpt):
    return C.load_oracle(ckpt)


# ---------------------------------------------------------------- the files


def test_deterministic(tmp_path):
    a = _files(C.make_checkpoint(tmp_path / "a", seed=3))
    b = _files(C.make_checkpoint(tmp_path / "b", seed=3))
    c = _files(C.make_checkpoint(tmp_path / "c", seed=4))
    assert a == b
    assert a["config.json"] == c["config.json"]
    for f in a:
        if f.endswith(".safetensors"):
            assert a[f] != c[f], f


def test_bf16_is_the_rounded_f32_variant(tmp_path):
    bf = C.read_checkpoint(C.make_checkpoint(tmp_path / "bf", shards=1, dtype="bf16"))
    f32 = C.read_checkpoint(C.make_checkpoint(tmp_path / "f32", shards=1, dtype="f32"))
    assert bf.keys() == f32.keys()
    for name, (dt, arr) in f32.items():
        bdt, barr = bf[name]
        if dt == "F32" and bdt == "BF16":
            np.testing.assert_array_equal(barr, C.bf16_bits_to_f32(C._to_bf16_bits(arr)))
            assert not np.array_equal(barr, arr), name  # really rounded
        else:
            assert dt == bdt and np.array_equal(barr, arr), name


def test_names_dtypes_shapes(ckpt):
    t = C.read_checkpoint(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128, 4, 0] and "quantization_config" not in cfg
    assert not [n for n in t if n.endswith(".scale") or n.startswith("mtp.") or n.startswith("model.")]
    H, V, E = 256, 512, 8
    glob = {"embed.weight": ("BF16", (V, H)), "head.weight": ("BF16", (V, H)), "norm.weight": ("BF16", (H,)),
            "hc_head_fn": ("F32", (4, 4 * H)), "hc_head_base": ("F32", (4,)), "hc_head_scale": ("F32", (1,))}
    for n, (dt, shape) in glob.items():
        assert (t[n][0], t[n][1].shape) == (dt, shape), n
    for i, ratio in enumerate([0, 4, 128, 4]):
        p = f"layers.{i}."
        got = {n[len(p):]: (dt, a.shape) for n, (dt, a) in t.items() if n.startswith(p)}
        want = {
            "hc_attn_fn": ("F32", (24, 1024)), "hc_attn_base": ("F32", (24,)), "hc_attn_scale": ("F32", (3,)),
            "hc_ffn_fn": ("F32", (24, 1024)), "hc_ffn_base": ("F32", (24,)), "hc_ffn_scale": ("F32", (3,)),
            "attn_norm.weight": ("BF16", (H,)), "ffn_norm.weight": ("BF16", (H,)),
            "attn.wq_a.weight": ("BF16", (128, H)), "attn.q_norm.weight": ("BF16", (128,)),
            "attn.wq_b.weight": ("BF16", (4 * 128, 128)), "attn.wkv.weight": ("BF16", (128, H)),
            "attn.kv_norm.weight": ("BF16", (128,)), "attn.wo_a.weight": ("BF16", (2 * 128, 4 * 128 // 2)),
            "attn.wo_b.weight": ("BF16", (H, 256)), "attn.attn_sink": ("F32", (4,)),
            "ffn.gate.weight": ("BF16", (E, H)),
            "ffn.shared_experts.w1.weight": ("BF16", (128, H)), "ffn.shared_experts.w2.weight": ("BF16", (H, 128)),
            "ffn.shared_experts.w3.weight": ("BF16", (128, H)),
        }
        for e in range(E):
            want[f"ffn.experts.{e}.w1.weight"] = ("BF16", (128, H))
            want[f"ffn.experts.{e}.w2.weight"] = ("BF16", (H, 128))
            want[f"ffn.experts.{e}.w3.weight"] = ("BF16", (128, H))
        want["ffn.gate.tid2eid" if i == 0 else "ffn.gate.bias"] = ("I64", (V, 2)) if i == 0 else ("F32", (E,))
        if ratio:
            w = 256 if ratio == 4 else 128
            want.update({"attn.compressor.wkv.weight": ("BF16", (w, H)),
                         "attn.compressor.wgate.weight": ("BF16", (w, H)),
                         "attn.compressor.norm.weight": ("BF16", (128,)), "attn.compressor.ape": ("F32", (ratio, w))})
        if ratio == 4:
            ih = cfg["index_n_heads"]
            want.update({"attn.indexer.wq_b.weight": ("BF16", (ih * 128, 128)),
                         "attn.indexer.weights_proj.weight": ("BF16", (ih, H)),
                         "attn.indexer.compressor.wkv.weight": ("BF16", (256, H)),
                         "attn.indexer.compressor.wgate.weight": ("BF16", (256, H)),
                         "attn.indexer.compressor.norm.weight": ("BF16", (128,)),
                         "attn.indexer.compressor.ape": ("F32", (4, 256))})
        assert got == want, (i, set(got) ^ set(want))
    assert len(t) == len(glob) + sum(1 for n in t if n.startswith("layers."))


def test_tid2eid(ckpt):
    tid = C.read_checkpoint(ckpt)["layers.0.ffn.gate.tid2eid"][1]
    assert tid.dtype == np.int64 and tid.min() >= 0 and tid.max() < 8
    assert all(len(set(r)) == len(r) for r in tid.tolist())  # distinct experts per token
    assert set(np.unique(tid)) == set(range(8))  # every expert reachable


def test_shards_and_index(ckpt, tmp_path):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    files = sorted(ckpt.glob("*.safetensors"))
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    total = 0
    for f in files:
        h = _header(f)
        assert h.pop("__metadata__") == {"format": "pt"}
        assert {n for n, v in wm.items() if v == f.name} == set(h)
        ends = sorted(v["data_offsets"] for v in h.values())
        assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))  # contiguous
        assert 8 + len(json.dumps(h)) <= f.stat().st_size
        total += ends[-1][1]
    assert index["metadata"]["total_size"] == total and len(wm) == len(C.read_checkpoint(ckpt))
    # the safetensors package reads what we wrote, bf16 included
    from safetensors import safe_open
    with safe_open(str(files[0]), framework="pt") as fh:
        name = next(iter(fh.keys()))
        assert fh.get_tensor(name).shape == C.read_checkpoint(ckpt)[name][1].shape
    one = C.make_checkpoint(tmp_path / "one", shards=1)
    assert (one / "model.safetensors").exists() and not (one / "model.safetensors.index.json").exists()
    assert not list(one.glob("model-*"))
    a, b = C.read_checkpoint(one), C.read_checkpoint(ckpt)
    assert a.keys() == b.keys() and all(np.array_equal(a[k][1], b[k][1]) for k in a)


def test_nontrivial_values(ckpt):
    t = C.read_checkpoint(ckpt)
    pooled = []
    for n, (_, a) in t.items():
        a = np.asarray(a, dtype=np.float64)
        assert np.isfinite(a).all(), n
        if n.endswith("norm.weight"):  # 1 + 0.1 N(0, 1): bf16 rounding makes a few entries exactly 1
            assert np.mean(a == 1.0) < 0.1 and 0.05 < a.std() < 0.2, n
        elif n.endswith(("attn_sink", "gate.bias", "_base", ".ape")):  # N(0, 0.5)
            assert np.all(a != 0) and np.unique(a).size > 0.99 * a.size and np.abs(a).max() > 0.1, n
            pooled.append(a.ravel())
        elif n.endswith("_scale"):
            assert np.all((a > 0.5) & (a < 1.5)) and not np.any(a == 1.0), n
        elif a.ndim == 2 and "tid2eid" not in n:  # matrices ~N(0, 1/sqrt(in)) (router 2x, embed 1)
            want = 1.0 if n == "embed.weight" else (2.0 if n.endswith("ffn.gate.weight") else 1.0) / np.sqrt(a.shape[1])
            assert abs(a.std() / want - 1) < 0.1, n
    assert abs(np.concatenate(pooled).std() / 0.5 - 1) < 0.1


def test_tokenizer_variant(tmp_path):
    d = C.make_checkpoint(tmp_path / "tok", shards=1, tokenizer=True)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == C.REAL_VOCAB == 129280
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["add_bos_token"] is False
    assert (d / "tokenizer.json").read_bytes() == (C._tokenizer_dir() / "tokenizer.json").read_bytes()
    h = _header(d / "model.safetensors")
    assert h["embed.weight"]["shape"] == [129280, 256] and h["head.weight"]["shape"] == [129280, 256]
    assert h["layers.0.ffn.gate.tid2eid"]["shape"] == [129280, 2]
    plain = json.loads((C.make_checkpoint(tmp_path / "plain", shards=1) / "tokenizer_config.json").read_text())
    assert plain["add_bos_token"] is False and "begin" in plain["bos_token"] and "end" in plain["eos_token"]


# ---------------------------------------------------------------- the oracle


def test_oracle_loads_every_tensor(oracle, ckpt):
    # load_oracle already asserted: no missing / unexpected / mismatched keys, and every model tensor
    # equal to the file's under the official -> HF renaming. Spot-check the conversion here.
    t = C.read_checkpoint(ckpt)
    sd = oracle.state_dict()
    def tt(name):
        return torch.from_numpy(np.array(t[name][1]))
    assert torch.equal(sd["model.embed_tokens.weight"], tt("embed.weight"))
    assert torch.equal(sd["lm_head.weight"], tt("head.weight"))
    assert torch.equal(sd["model.layers.1.self_attn.compressor.indexer.position_bias"],
                       tt("layers.1.attn.indexer.compressor.ape"))
    assert torch.equal(sd["model.layers.3.self_attn.compressor.kv_norm.weight"],
                       tt("layers.3.attn.compressor.norm.weight"))
    assert torch.equal(sd["model.layers.2.mlp.experts.gate_up_proj"][5][128:], tt("layers.2.ffn.experts.5.w3.weight"))
    assert torch.equal(sd["model.layers.0.mlp.gate.tid2eid"], tt("layers.0.ffn.gate.tid2eid"))
    assert oracle.config.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                         "heavily_compressed_attention", "compressed_sparse_attention"]
    assert oracle.config.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    comp = oracle.config.rope_parameters["compress"]
    assert (comp["rope_type"], comp["rope_theta"], comp["factor"]) == ("yarn", 160000, 16)
    assert comp["attention_factor"] == 1.0  # no YaRN mscale
    assert oracle.config._attn_implementation == "eager" and not oracle.training


def test_oracle_refuses_an_incomplete_checkpoint(tmp_path):
    d = C.make_checkpoint(tmp_path / "bad", shards=1)
    t = C.read_checkpoint(d)
    del t["layers.1.attn.attn_sink"]
    C._write_safetensors(d / "model.safetensors",
                         {n: (dt, C._to_bf16_bits(a) if dt == "BF16" else a) for n, (dt, a) in t.items()})
    with pytest.raises(AssertionError, match="sinks"):
        C.load_oracle(d)


def test_clamps_fire(oracle):
    """swiglu_limit 0.75: the gate clamp (from above) and the up clamp (both sides) must bind in the
    routed and the shared experts, otherwise an engine ignoring the limit would pass."""
    seen = {"routed_gate": 0, "routed_up_hi": 0, "routed_up_lo": 0, "shared_gate": 0, "shared_up_lo": 0}
    lim = oracle.config.swiglu_limit
    assert lim == 0.75
    handles, patched = [], []
    for layer in oracle.model.layers:
        mlp = layer.mlp
        experts = mlp.experts
        orig = experts._apply_gate

        def spy(gate_up, orig=orig):
            g, u = gate_up.chunk(2, dim=-1)
            seen["routed_gate"] += int((g > lim).sum())
            seen["routed_up_hi"] += int((u > lim).sum())
            seen["routed_up_lo"] += int((u < -lim).sum())
            return orig(gate_up)
        experts._apply_gate = spy
        patched.append(experts)
        handles.append(mlp.shared_experts.gate_proj.register_forward_hook(
            lambda m, a, o: seen.__setitem__("shared_gate", seen["shared_gate"] + int((o > lim).sum()))))
        handles.append(mlp.shared_experts.up_proj.register_forward_hook(
            lambda m, a, o: seen.__setitem__("shared_up_lo", seen["shared_up_lo"] + int((o < -lim).sum()))))
    try:
        C.oracle_logits(oracle, C.margin_tokens(64))
    finally:
        for h in handles:
            h.remove()
        for e in patched:
            del e._apply_gate
    assert all(v > 100 for v in seen.values()), seen


def test_selection_margins(oracle):
    """The default seed keeps every expert decision >= MIN_MARGIN (1e-4, spec 4.4) and every indexer
    decision >= INDEXER_MIN_MARGIN (5e-5: see dsv4_checkpoint.DEFAULT_SEED) from a tie over the
    700-token stream, so an engine's rounding cannot flip a decision."""
    r = C.selection_margins(oracle, C.margin_tokens())
    assert r["router"] >= C.MIN_MARGIN, r
    assert r["indexer"] >= C.INDEXER_MIN_MARGIN, r


def test_taps(oracle, ckpt):
    toks = C.margin_tokens()
    taps = C.oracle_taps(oracle, toks)
    tid = C.read_checkpoint(ckpt)["layers.0.ffn.gate.tid2eid"][1]
    assert taps["experts"][0] == [sorted(tid[t].tolist()) for t in toks]  # hash layer: by token id
    for i in range(4):
        ids = taps["experts"][i]
        assert len(ids) == 700 and all(len(set(e)) == 2 for e in ids)
        assert {e for row in ids for e in row} == set(range(8)), i  # every expert used
    assert sorted(taps["indexer"]) == [1, 3]
    for i, sets in taps["indexer"].items():
        for t, s in enumerate(sets):
            visible = (t + 1) // 4
            assert s == set(range(visible)) if visible <= 8 else (len(s) == 8 and max(s) < visible), (i, t)


def test_indexer_really_selects(oracle):
    """At 300 tokens late queries see 75 compressed rows but attend to 8 of them, and the choice is
    not simply the most recent rows."""
    sets = C.oracle_taps(oracle, C.margin_tokens(300))["indexer"]
    for i, s in sets.items():
        late = s[200:]
        assert all(len(x) == 8 < (t + 201) // 4 for t, x in enumerate(late))
        recent = sum(x == set(range((t + 201) // 4 - 8, (t + 201) // 4)) for t, x in enumerate(late))
        assert recent < len(late) // 2, (i, recent)
        assert len({frozenset(x) for x in late}) > 20, i


def test_cached_equals_uncached(oracle):
    """One uncached forward over 300 tokens = a cached run in chunks that start, end and straddle
    ratio-4 and ratio-128 windows and the 128-token sliding window (compressor buffers, ratio-4
    overlap state, sliding cache), single-token decodes included. (A fully token-by-token run is
    the same code path as the single-token chunks here; it is slower, not different.)"""
    toks = C.margin_tokens(300)
    a = C.oracle_logits(oracle, toks)
    chunks = [1, 2, 1, 5, 3, 1, 1, 113, 1, 1, 1, 3, 127, 2, 1, 1, 4, 9, 1, 1, 1, 1]
    assert sum(chunks) == 281
    b = C.oracle_logits_cached(oracle, toks, chunks=chunks)
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(a).max())
    assert (a.argmax(1) == b.argmax(1)).all()


def test_greedy(oracle):
    prompt = C.margin_tokens(40)
    out = C.oracle_greedy(oracle, prompt, 12)
    assert len(out) == 12
    logits = C.oracle_logits(oracle, prompt + out)
    assert logits[len(prompt) - 1:-1].argmax(1).tolist() == out  # no BOS added, greedy = argmax
