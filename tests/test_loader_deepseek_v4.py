"""DeepSeek V4 directory loader: tiny checkpoints with the official tensor names written here (a
minimal safetensors writer, single file and sharded), the config parser and its refusals, the RoPE
tables against transformers' own, and one refusal per kind of bad tensor, each naming the tensor."""
from __future__ import annotations

import copy
import json
import struct

import numpy as np
import pytest

from zen5.config import UnsupportedModelError
from zen5.deepseek_v4_config import DeepSeekV4Config
from zen5.loader import BadModelFile, LoadedWeights, load_weights
from zen5.loader.deepseek_v4 import DeepSeekV4Weights, expected_deepseek_v4_tensors, load_deepseek_v4_dir
from zen5.loader.safetensors import load_safetensors_dir

TINY = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
    "o_groups": 2, "o_lora_rank": 128,
    "sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 0],
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 4, "index_head_dim": 128, "index_topk": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 128, "num_hash_layers": 1,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True,
    "swiglu_limit": 0.75, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
    "bos_token_id": 0, "eos_token_id": 1,
}

NATIVE_KEYS = {"vocab_size", "hidden", "n_layers", "n_heads", "head_dim", "rope_dim", "q_rank", "o_groups", "o_rank",
               "window", "ratios", "index_heads", "index_dim", "index_topk", "n_experts", "top_k", "moe_inter",
               "n_hash_layers", "route_scale", "swiglu_limit", "hc_mult", "hc_iters", "hc_eps", "rms_eps",
               "n_ctx_train"}


# --- a minimal checkpoint writer (independent of the loader's inventory) -------------------------

def inventory(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Official name -> (shape, file dtype) of the plain variant, written from spec 4.3."""
    d, hc, v, n = cfg["hidden_size"], cfg["hc_mult"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, qr, h, g, orank = (cfg["head_dim"], cfg["q_lora_rank"], cfg["num_attention_heads"], cfg["o_groups"],
                           cfg["o_lora_rank"])
    ih, idim, e, k, inter = (cfg["index_n_heads"], cfg["index_head_dim"], cfg["n_routed_experts"],
                             cfg["num_experts_per_tok"], cfg["moe_intermediate_size"])
    mix = (2 + hc) * hc
    t = {"embed.weight": ((v, d), "BF16"), "head.weight": ((v, d), "BF16"), "norm.weight": ((d,), "BF16"),
         "hc_head_fn": ((hc, hc * d), "F32"), "hc_head_base": ((hc,), "F32"), "hc_head_scale": ((1,), "F32")}
    for i, r in enumerate(cfg["compress_ratios"][:n]):
        p = f"layers.{i}."
        for part in ("attn", "ffn"):
            t[f"{p}hc_{part}_fn"] = ((mix, hc * d), "F32")
            t[f"{p}hc_{part}_base"] = ((mix,), "F32")
            t[f"{p}hc_{part}_scale"] = ((3,), "F32")
        t[p + "attn_norm.weight"] = ((d,), "BF16")
        t[p + "ffn_norm.weight"] = ((d,), "BF16")
        t[p + "attn.wq_a.weight"] = ((qr, d), "BF16")
        t[p + "attn.q_norm.weight"] = ((qr,), "BF16")
        t[p + "attn.wq_b.weight"] = ((h * hd, qr), "BF16")
        t[p + "attn.wkv.weight"] = ((hd, d), "BF16")
        t[p + "attn.kv_norm.weight"] = ((hd,), "BF16")
        t[p + "attn.wo_a.weight"] = ((g * orank, h * hd // g), "BF16")
        t[p + "attn.wo_b.weight"] = ((d, g * orank), "BF16")
        t[p + "attn.attn_sink"] = ((h,), "F32")
        comps = [("attn.compressor.", hd)] if r else []
        if r == 4:
            comps.append(("attn.indexer.compressor.", idim))
            t[p + "attn.indexer.wq_b.weight"] = ((ih * idim, qr), "BF16")
            t[p + "attn.indexer.weights_proj.weight"] = ((ih, d), "BF16")
        for q, dim in comps:
            coff = 2 if r == 4 else 1
            t[p + q + "wkv.weight"] = ((coff * dim, d), "BF16")
            t[p + q + "wgate.weight"] = ((coff * dim, d), "BF16")
            t[p + q + "norm.weight"] = ((dim,), "BF16")
            t[p + q + "ape"] = ((r, coff * dim), "F32")
        t[p + "ffn.gate.weight"] = ((e, d), "BF16")
        if i < cfg["num_hash_layers"]:
            t[p + "ffn.gate.tid2eid"] = ((v, k), "I64")
        else:
            t[p + "ffn.gate.bias"] = ((e,), "F32")
        for q in [f"ffn.experts.{j}." for j in range(e)] + ["ffn.shared_experts."]:
            t[p + q + "w1.weight"] = ((inter, d), "BF16")
            t[p + q + "w3.weight"] = ((inter, d), "BF16")
            t[p + q + "w2.weight"] = ((d, inter), "BF16")
    return t


_NP = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64, "I8": np.int8,
       "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}


def make_array(name, shape, dtype, rng, n_experts=8) -> np.ndarray:
    """The tensor's bytes as an array of the file dtype (BF16 as uint16 bit patterns)."""
    if dtype in ("I32", "I64"):
        return rng.integers(0, n_experts, size=shape).astype(_NP[dtype])
    if dtype in ("I8", "F8_E4M3", "F8_E8M0"):
        return rng.integers(0, 120, size=shape).astype(_NP[dtype])
    vals = rng.standard_normal(shape).astype(np.float32)
    if name.endswith("norm.weight"):
        vals = 1 + 0.1 * vals
    if dtype == "BF16":
        return (vals.view(np.uint32) >> 16).astype(np.uint16)
    return vals.astype(_NP[dtype])


def write_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def write_tokenizer(folder, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<bos>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}))


def make_checkpoint(folder, cfg=None, shards=1, edit=None, tokenizer=True, mtp=True, seed=0):
    """Write a tiny plain DeepSeek V4 checkpoint; `edit(tensors)` may change name -> (dtype, array)."""
    cfg = copy.deepcopy(TINY if cfg is None else cfg)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {name: (dt, make_array(name, shape, dt, rng, cfg["n_routed_experts"]))
               for name, (shape, dt) in inventory(cfg).items()}
    if mtp:  # a few MTP tensors (FP8 among them): ignored whatever their format
        d = cfg["hidden_size"]
        tensors["mtp.0.e_proj.weight"] = ("F8_E4M3", make_array("e", (d, d), "F8_E4M3", rng))
        tensors["mtp.0.e_proj.scale"] = ("F8_E8M0", make_array("s", (d // 128, d // 128), "F8_E8M0", rng))
        tensors["mtp.0.enorm.weight"] = ("BF16", make_array("mtp.0.enorm.weight", (d,), "BF16", rng))
    if edit:
        edit(tensors)
    (folder / "config.json").write_text(json.dumps(cfg))
    names = list(tensors)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors)
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            write_safetensors(folder / file, {n: tensors[n] for n in part})
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        write_tokenizer(folder, cfg["vocab_size"])
    return tensors


def f32_of(dtype, arr) -> np.ndarray:
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def is_memmapped(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base if isinstance(a, np.ndarray) else None
    return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv4") / "tiny"
    return folder, make_checkpoint(folder)


# --- loading ------------------------------------------------------------------------------------

def test_loads_single_file(tiny):
    folder, written = tiny
    w = load_weights(folder)
    assert isinstance(w, DeepSeekV4Weights) and isinstance(w, LoadedWeights)
    assert isinstance(w.config, DeepSeekV4Config)
    assert set(w.tensors) == {n for n in written if not n.startswith("mtp.")}
    assert w.metadata["format"] == "safetensors" and w.metadata["path"] == str(folder)
    assert w.metadata["ignored_tensors"] == sorted(n for n in written if n.startswith("mtp."))
    assert w.metadata["add_bos_token"] is False
    for name, t in w.tensors.items():
        dtype, arr = written[name]
        assert t.shape == arr.shape and t.name == name
        if arr.ndim == 2 and dtype == "BF16":  # matrices: the file's bytes, memory-mapped
            assert t.ggml_type == 30 and is_memmapped(t.data) and t.data.tobytes() == arr.tobytes()
        elif dtype == "I64":  # tid2eid -> I32
            assert t.ggml_type == 26 and np.array_equal(t.data.view(np.int32).reshape(arr.shape), arr)
        else:  # norms (BF16) and hc_*/ape/attn_sink/gate.bias (F32) -> F32
            assert t.ggml_type == 0
            assert np.array_equal(t.data.view(np.float32).reshape(arr.shape), f32_of(dtype, arr))
    native = w.native_tensors()
    assert len(native) == len(w.tensors)
    for name, dtype, shape, data in native:
        assert dtype in ("F32", "F16", "BF16", "I32") and isinstance(shape, list)
        assert data.dtype == np.uint8 and data.ndim == 1
        assert data.nbytes == int(np.prod(shape)) * {"F32": 4, "F16": 2, "BF16": 2, "I32": 4}[dtype]
    assert {d for _, d, _, _ in native} == {"F32", "BF16", "I32"}
    assert w.tokenizer is not None and w.tokenizer.bos_id == 0 and 1 in w.tokenizer.eos_ids
    assert w.tokenizer.encode("t5 t7") == [5, 7]  # no BOS added (add_bos_token false)
    assert w.chat_template.startswith("{{ bos_token }}")


def test_loads_sharded_same_tensors(tiny, tmp_path):
    folder, _ = tiny
    written = make_checkpoint(tmp_path / "sharded", shards=3)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    a, b = load_weights(folder), load_weights(tmp_path / "sharded")
    assert a.config == b.config and list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        assert b.tensors[name].data.tobytes() == t.data.tobytes(), name
    assert b.metadata["ignored_tensors"] == sorted(n for n in written if n.startswith("mtp."))


def test_dispatch_on_model_type(tiny):
    folder, _ = tiny
    assert isinstance(load_weights(str(folder)), DeepSeekV4Weights)
    with pytest.raises(UnsupportedModelError, match="a DeepSeek V4 directory: load it with zen5.loader.load_weights"):
        load_safetensors_dir(folder)  # the Llama-family reader says where to go instead


def test_tokenizer_required_unless_asked(tmp_path):
    make_checkpoint(tmp_path / "m", tokenizer=False, mtp=False)
    with pytest.raises(BadModelFile, match="no tokenizer.json"):
        load_weights(tmp_path / "m")
    w = load_deepseek_v4_dir(tmp_path / "m", require_tokenizer=False)
    assert w.tokenizer is None and w.chat_template is None and w.metadata["ignored_tensors"] == []


def test_accepts_other_float_types_and_i32_ids(tmp_path):
    def edit(t):
        t["layers.0.attn.wq_a.weight"] = ("F32", t["layers.0.attn.wq_a.weight"][1].astype(np.float32))
        t["layers.0.attn.wkv.weight"] = ("F16", np.ones((128, 256), np.float16))
        t["hc_head_base"] = ("BF16", np.array([0x3F80, 0x4000, 0xBF80, 0], np.uint16))  # 1, 2, -1, 0
        t["layers.0.ffn.gate.tid2eid"] = ("I32", t["layers.0.ffn.gate.tid2eid"][1].astype(np.int32))
        t["layers.0.attn.q_norm.weight"] = ("F32", np.full(128, 1.5, np.float32))
    make_checkpoint(tmp_path / "m", edit=edit)
    w = load_weights(tmp_path / "m")
    assert w.tensors["layers.0.attn.wq_a.weight"].ggml_type == 0
    assert w.tensors["layers.0.attn.wkv.weight"].ggml_type == 1
    assert w.tensors["hc_head_base"].data.view(np.float32).tolist() == [1.0, 2.0, -1.0, 0.0]
    assert w.tensors["layers.0.ffn.gate.tid2eid"].ggml_type == 26
    assert w.tensors["layers.0.attn.q_norm.weight"].data.view(np.float32).tolist() == [1.5] * 128


# --- the config ---------------------------------------------------------------------------------

def test_config_round_trip():
    c = DeepSeekV4Config.from_hf(TINY)
    n = c.to_native()
    assert set(n) == NATIVE_KEYS
    assert n == {"vocab_size": 512, "hidden": 256, "n_layers": 4, "n_heads": 4, "head_dim": 128, "rope_dim": 64,
                 "q_rank": 128, "o_groups": 2, "o_rank": 128, "window": 128, "ratios": [0, 4, 128, 4],
                 "index_heads": 4, "index_dim": 128, "index_topk": 8, "n_experts": 8, "top_k": 2, "moe_inter": 128,
                 "n_hash_layers": 1, "route_scale": 1.5, "swiglu_limit": 0.75, "hc_mult": 4, "hc_iters": 20,
                 "hc_eps": 1e-6, "rms_eps": 1e-6, "n_ctx_train": 4096}
    for k in ("route_scale", "swiglu_limit", "hc_eps", "rms_eps"):
        assert type(n[k]) is float
    assert all(type(r) is int for r in n["ratios"])
    # what the rest of zen5 reads from a ModelConfig
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.vocab_size, c.n_ctx_train,
            c.tied_output, c.rope_theta, c.rms_eps) == ("deepseek_v4", 4, 256, 4, 1, 128, 512, 4096, False,
                                                        10000.0, 1e-6)
    assert (c.bos_token_id, c.eos_token_id, c.yarn_factor, c.norm_topk_prob) == (0, 1, 16.0, True)
    again = DeepSeekV4Config.from_hf(json.loads(json.dumps(TINY)))
    assert c == again and hash(c) == hash(again)


def _cfg(**changes):
    cfg = copy.deepcopy(TINY)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


@pytest.mark.parametrize("changes,match", [
    ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
    ({"compress_ratios": [0, 4, 64, 4, 0]}, r"compress_ratios\[2\] is 64; .*0, 4 or 128"),
    ({"compress_ratios": [0, 4, 128]}, "compress_ratios has 3 entries for 4 layers"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"n_shared_experts": 2}, "n_shared_experts must be 1"),
    ({"o_groups": 3}, "not divisible by o_groups 3"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim 63 must be even"),
    ({"qk_rope_head_dim": 256}, "at most head_dim 128"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds n_routed_experts 8"),
    ({"num_hash_layers": 5}, r"num_hash_layers 5 is not in \[0, 4\]"),
    ({"hidden_size": 0}, "hidden_size must be positive"),
    ({"head_dim": None}, "head_dim missing"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "RoPE scaling type 'linear'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config .* is not the official one"),
    ({"eos_token_id": 512}, r"eos_token_id 512 is outside the vocabulary"),
    ({"rope_scaling": dict(TINY["rope_scaling"], attention_factor=1.3)}, "attention factor / mscale"),
])
def test_config_refusals(changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        DeepSeekV4Config.from_hf(_cfg(**changes), "/m")


def test_rope_parameters_variants_agree():
    want = DeepSeekV4Config.from_hf(TINY).rope_tables()
    yarn = dict(TINY["rope_scaling"], rope_type="yarn")
    flat = _cfg(rope_scaling=None, rope_theta=None, rope_parameters={**yarn, "rope_theta": 10000})
    nested = _cfg(rope_scaling=None, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000},
        "compress": {**yarn, "rope_theta": 160000}})
    for cfg in (flat, nested):
        got = DeepSeekV4Config.from_hf(cfg).rope_tables()
        assert all(np.array_equal(a, b) for a, b in zip(want, got))
    plain = DeepSeekV4Config.from_hf(_cfg(rope_scaling=None))
    assert plain.yarn_factor is None
    main, comp = plain.rope_tables()
    assert np.allclose(comp, 1 / 160000 ** (np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_transformers_spelling_loads():
    """save_pretrained's spelling: layer_types / compress_rates / mlp_layer_types, nested rope_parameters."""
    cfg = _cfg(compress_ratios=None, num_hash_layers=None, rope_scaling=None, compress_rope_theta=None,
               layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
               mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
               rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.5},
                                "compress": {**TINY["rope_scaling"], "rope_type": "yarn", "rope_theta": 160000,
                                             "partial_rotary_factor": 0.5, "attention_factor": 1.0}})
    assert DeepSeekV4Config.from_hf(cfg) == DeepSeekV4Config.from_hf(TINY)
    with pytest.raises(UnsupportedModelError, match="'hash_moe' layers followed by 'moe'"):
        DeepSeekV4Config.from_hf(dict(cfg, mlp_layer_types=["moe", "hash_moe", "moe", "moe"]))
    with pytest.raises(UnsupportedModelError, match=r"layer_types\[1\] is 'full_attention'"):
        DeepSeekV4Config.from_hf(dict(cfg, layer_types=["sliding_attention", "full_attention"] * 2))
    tr = pytest.importorskip("transformers")
    if hasattr(tr, "DeepseekV4Config"):  # what transformers itself writes
        assert DeepSeekV4Config.from_hf(tr.DeepseekV4Config(**copy.deepcopy(TINY)).to_dict()) == \
            DeepSeekV4Config.from_hf(TINY)


def test_rope_tables_match_transformers():
    pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    if not hasattr(tr, "DeepseekV4Config"):
        pytest.skip(f"transformers {tr.__version__} has no DeepSeek V4")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    for cfg in (TINY, _cfg(max_position_embeddings=1 << 20, compress_rope_theta=160000,
                           rope_scaling=dict(TINY["rope_scaling"], factor=16, beta_fast=24, beta_slow=2))):
        rot = DeepseekV4RotaryEmbedding(tr.DeepseekV4Config(**copy.deepcopy(cfg)))
        main, comp = DeepSeekV4Config.from_hf(cfg).rope_tables()
        assert main.dtype == comp.dtype == np.float32 and main.shape == comp.shape == (32,)
        # transformers computes theta**(2i/d) in float32, ours in float64 then cast: a few ulp apart
        np.testing.assert_allclose(main, rot.main_inv_freq.numpy(), rtol=4e-7, atol=0)
        np.testing.assert_allclose(comp, rot.compress_inv_freq.numpy(), rtol=4e-7, atol=0)
        assert rot.compress_attention_scaling == 1.0  # no mscale


def test_inventory_matches_transformers_model():
    """The loader's shapes equal transformers' DeepseekV4ForCausalLM parameters under its own
    official-name conversion rules (experts merged there; compared as stacks)."""
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    if not hasattr(tr, "DeepseekV4ForCausalLM"):
        pytest.skip(f"transformers {tr.__version__} has no DeepSeek V4")
    import re

    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming
    with torch.device("meta"):
        model = tr.DeepseekV4ForCausalLM(tr.DeepseekV4Config(**copy.deepcopy(TINY)))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    renames = [(r.source_patterns[0], r.target_patterns[0].replace("\\", ""))
               for r in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(r, WeightRenaming)]
    c = DeepSeekV4Config.from_hf(TINY)
    ours, experts = {}, {}
    for name, (shape, _) in expected_deepseek_v4_tensors(c).items():
        m = re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w\d)\.weight", name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), []).append(shape)
            continue
        for src, dst in renames:
            name = re.sub(src, dst, name)
        ours[name if name.startswith("lm_head") else "model." + name] = shape
    for (layer, w), shapes in experts.items():
        assert len(shapes) == c.n_routed_experts and len(set(shapes)) == 1
        if w == "w2":
            ours[f"model.layers.{layer}.mlp.experts.down_proj"] = (len(shapes), *shapes[0])
        elif w == "w1":
            ours[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = (len(shapes), 2 * shapes[0][0], shapes[0][1])
    assert ours == theirs


# --- refusals, each naming the tensor -----------------------------------------------------------

def _set(name, dtype, arr):
    def edit(t):
        t[name] = (dtype, arr)
    return edit


def _drop(name):
    def edit(t):
        del t[name]
    return edit


def _fp8(t):
    w = "layers.1.attn.wq_a.weight"
    t[w] = ("F8_E4M3", np.zeros((128, 256), np.uint8))
    t["layers.1.attn.wq_a.scale"] = ("F8_E8M0", np.full((1, 2), 127, np.uint8))


def _packed_expert(t):
    t["layers.1.ffn.experts.0.w1.weight"] = ("I8", np.zeros((128, 128), np.int8))
    t["layers.1.ffn.experts.0.w1.scale"] = ("F8_E8M0", np.full((128, 8), 127, np.uint8))


def _without(name, edit):
    def both(t):
        edit(t)
        del t[name]
    return both


def _with(name, dtype, arr, edit):
    def both(t):
        edit(t)
        t[name] = (dtype, arr)
    return both


def _tid(value, dtype="I64"):
    def edit(t):
        ids = t["layers.0.ffn.gate.tid2eid"][1].astype(_NP[dtype])
        ids[7, 1] = value
        t["layers.0.ffn.gate.tid2eid"] = (dtype, ids)
    return edit


@pytest.mark.parametrize("edit,exc,match", [
    (_drop("layers.2.attn.compressor.ape"), BadModelFile, r"missing tensor layers\.2\.attn\.compressor\.ape"),
    (_drop("layers.3.ffn.experts.7.w2.weight"), BadModelFile, r"missing tensor layers\.3\.ffn\.experts\.7\.w2"),
    (_drop("hc_head_scale"), BadModelFile, "missing tensor hc_head_scale"),
    (_set("layers.2.attn.indexer.wq_b.weight", "BF16", np.zeros((512, 128), np.uint16)), BadModelFile,
     r"unexpected tensor layers\.2\.attn\.indexer\.wq_b\.weight"),  # ratio 128: no indexer
    (_set("layers.0.ffn.gate.bias", "F32", np.zeros(8, np.float32)), BadModelFile,
     r"unexpected tensor layers\.0\.ffn\.gate\.bias"),  # hash layer: tid2eid, no bias
    (_set("layers.1.attn.wo_a.weight", "BF16", np.zeros((256, 512), np.uint16)), BadModelFile,
     r"tensor layers\.1\.attn\.wo_a\.weight has shape \[256, 512\], expected \[256, 256\]"),
    (_set("layers.1.attn.compressor.ape", "F32", np.zeros((4, 128), np.float32)), BadModelFile,
     r"layers\.1\.attn\.compressor\.ape has shape \[4, 128\], expected \[4, 256\]"),
    (_set("layers.1.attn.attn_sink", "F16", np.zeros(4, np.float16)), UnsupportedModelError,
     r"tensor layers\.1\.attn\.attn_sink has dtype F16, expected one of F32, BF16"),
    (_set("embed.weight", "I32", np.zeros((512, 256), np.int32)), UnsupportedModelError,
     r"tensor embed\.weight has dtype I32, expected one of BF16, F16, F32"),
    (_set("layers.0.ffn.gate.tid2eid", "F32", np.zeros((512, 2), np.float32)), UnsupportedModelError,
     r"tensor layers\.0\.ffn\.gate\.tid2eid has dtype F32, expected one of I32, I64"),
    # the official formats: each quantized matrix needs its E8M0 scale tensor, of the right shape
    (_without("layers.1.attn.wq_a.scale", _fp8), BadModelFile, r"missing tensor layers\.1\.attn\.wq_a\.scale"),
    (_without("layers.1.ffn.experts.0.w1.scale", _packed_expert), BadModelFile,
     r"missing tensor layers\.1\.ffn\.experts\.0\.w1\.scale"),
    (_with("layers.1.attn.wq_a.scale", "F8_E8M0", np.zeros((2, 2), np.uint8), _fp8), BadModelFile,
     r"layers\.1\.attn\.wq_a\.scale has shape \[2, 2\], expected \[1, 2\]"),
    (_with("layers.1.attn.wq_a.scale", "F32", np.zeros((1, 2), np.float32), _fp8), UnsupportedModelError,
     r"layers\.1\.attn\.wq_a\.scale has dtype F32, expected one of F8_E8M0"),
    (_with("layers.1.ffn.experts.0.w1.weight", "I8", np.zeros((128, 256), np.int8), _packed_expert), BadModelFile,
     r"experts\.0\.w1\.weight has shape \[128, 256\], expected \[128, 128\]"),  # pairs: half the inputs
    (_set("embed.weight", "F8_E4M3", np.zeros((512, 256), np.uint8)), UnsupportedModelError,
     r"tensor embed\.weight has dtype F8_E4M3, expected one of BF16, F16, F32"),
    (_with("layers.1.attn.wq_b.scale", "F8_E8M0", np.zeros((4, 1), np.uint8), _fp8), BadModelFile,
     r"unexpected tensor layers\.1\.attn\.wq_b\.scale"),  # a scale for a BF16 matrix
    (_tid(8), BadModelFile, r"tensor layers\.0\.ffn\.gate\.tid2eid holds expert id 8, expected ids in \[0, 8\)"),
    (_tid(-1, "I32"), BadModelFile, r"tensor layers\.0\.ffn\.gate\.tid2eid holds expert id -1"),
])
def test_tensor_refusals(tmp_path, edit, exc, match):
    make_checkpoint(tmp_path / "m", edit=edit, mtp=False)
    with pytest.raises(exc, match=match):
        load_weights(tmp_path / "m")


@pytest.mark.parametrize("changes,match", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "quantization_config"),
    ({"compress_ratios": [0, 4, 16, 4, 0]}, r"compress_ratios\[2\] is 16"),
    ({"num_key_value_heads": 4}, "num_key_value_heads must be 1"),
])
def test_config_refusals_from_a_directory(tmp_path, changes, match):
    folder = tmp_path / "m"
    make_checkpoint(folder, mtp=False, tokenizer=False)
    (folder / "config.json").write_text(json.dumps(_cfg(**changes)))
    with pytest.raises(UnsupportedModelError, match=match) as e:
        load_weights(folder)
    assert str(folder) in str(e.value)


def test_the_official_formats_load_memory_mapped(tmp_path):
    """An F8_E4M3 projection and a packed-e2m1 expert with their scales: handed on in place as
    "F8_E4M3" / "MXFP4" / "F8_E8M0" (the native engine repacks them, tests/test_dsv4_formats.py)."""
    make_checkpoint(tmp_path / "m", edit=lambda t: (_fp8(t), _packed_expert(t)), mtp=False)
    w = load_weights(tmp_path / "m")
    native = {name: (dt, shape) for name, dt, shape, _ in w.native_tensors()}
    assert native["layers.1.attn.wq_a.weight"] == ("F8_E4M3", [128, 256])
    assert native["layers.1.attn.wq_a.scale"] == ("F8_E8M0", [1, 2])
    assert native["layers.1.ffn.experts.0.w1.weight"] == ("MXFP4", [128, 128])
    assert native["layers.1.ffn.experts.0.w1.scale"] == ("F8_E8M0", [128, 8])
    for name in ("layers.1.attn.wq_a.weight", "layers.1.ffn.experts.0.w1.weight", "layers.1.attn.wq_a.scale"):
        assert not w.tensors[name].data.flags.owndata, name  # a view of the mapped file, not a copy
