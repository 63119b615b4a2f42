"""Loader tests: real models (SmolLM2 GGUF, dsml-tiny safetensors), tiny synthetic files for every
refusal path, and fuzzing that damaged files only ever raise clear ValueError-family exceptions.
"""
import os
import shutil
import struct
import sys
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, os.path.dirname(__file__))
import tiny_gguf  # noqa: E402
from zen5.config import GGML_F32, SUPPORTED_TYPES, ModelConfig, UnsupportedModelError  # noqa: E402
from zen5.loader import BadModelFile, expected_tensors, load_weights, row_bytes, validate_tensors  # noqa: E402
from zen5.loader.gguf import read_header  # noqa: E402
from zen5.registry import ModelNotFound, resolve_model  # noqa: E402

CLEAN_ERRORS = (BadModelFile, UnsupportedModelError, ValueError)


@pytest.fixture(scope="module")
def smol_path():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def smol(smol_path):
    return load_weights(smol_path)


@pytest.fixture(scope="module")
def dsml_path():
    try:
        return resolve_model("dsml-tiny")
    except ModelNotFound as e:
        pytest.skip(f"dsml-tiny not available: {e}")


# --- real models ------------------------------------------------------------------------------

def test_smollm2_config(smol):
    c = smol.config
    assert (c.arch, c.n_layer, c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim) == \
        ("llama", 30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.n_ctx_train, c.rope_theta, c.tied_output) == \
        (49152, 8192, 100000.0, True)
    assert c.rope_neox is False and not c.qkv_bias and not c.qk_norm and c.rope_scaling is None
    assert abs(c.rms_eps - 1e-5) < 1e-9
    assert smol.metadata["format"] == "gguf" and smol.metadata["ignored_tensors"] == []
    assert "<|im_start|>" in smol.chat_template


def test_smollm2_tensors(smol, smol_path):
    assert set(smol.tensors) == set(expected_tensors(smol.config))
    reader = gguf.GGUFReader(smol_path)
    raw = {t.name: t for t in reader.tensors}
    for name, t in smol.tensors.items():
        assert t.data.dtype == np.uint8 and t.data.flags.c_contiguous and t.data.ndim == 1
        assert t.ggml_type in SUPPORTED_TYPES
        if len(t.shape) == 1:
            assert t.ggml_type == GGML_F32
            np.testing.assert_array_equal(t.data.view(np.float32), raw[name].data)
        else:
            assert not t.data.flags.owndata  # a view of the file mapping, not a copy
            assert t.data.nbytes == t.shape[0] * row_bytes(t.ggml_type, t.shape[1])
            np.testing.assert_array_equal(t.data[:64], raw[name].data.reshape(-1)[:64])
    assert smol.tensors["token_embd.weight"].ggml_type == Q.Q8_0
    assert smol.tensors["blk.0.attn_q.weight"].ggml_type == Q.Q4_1


def test_dsml_tiny_safetensors(dsml_path):
    import torch
    from safetensors.torch import load_file
    w = load_weights(dsml_path)
    c = w.config
    assert (c.arch, c.n_layer, c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim) == \
        ("llama", 4, 192, 576, 6, 2, 32)
    assert (c.vocab_size, c.n_ctx_train, c.rope_theta, c.tied_output, c.rope_neox) == \
        (129280, 2048, 10000.0, True, True)
    assert w.metadata["format"] == "safetensors" and w.chat_template is None
    emb = w.tensors["token_embd.weight"]
    assert emb.ggml_type == 30 and emb.shape == (129280, 192) and not emb.data.flags.owndata
    ref = load_file(os.path.join(dsml_path, "model.safetensors"))
    norm = w.tensors["blk.2.ffn_norm.weight"]
    assert norm.ggml_type == GGML_F32
    np.testing.assert_array_equal(
        norm.data.view(np.float32),
        ref["model.layers.2.post_attention_layernorm.weight"].to(torch.float32).numpy())
    q = ref["model.layers.1.self_attn.q_proj.weight"].view(torch.int16).numpy().view(np.uint8)
    np.testing.assert_array_equal(w.tensors["blk.1.attn_q.weight"].data, q.reshape(-1))
    assert w.tokenizer.eos_ids == frozenset({1})


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_weights(missing)


# --- tiny GGUFs -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_tiny_gguf_archs(tmp_path, arch, tied):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", arch=arch, tied=tied)
    w = load_weights(path)
    c = w.config
    assert (c.arch, c.tied_output, c.rope_neox) == (arch, tied, arch != "llama")
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert ("output.weight" in w.tensors) == (not tied)
    assert c.rope_theta == 50000.0 and c.n_ctx_train == 512
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    for name, t in w.tensors.items():
        if len(t.shape) == 1:  # F16 in the file, F32 for the engine
            assert t.ggml_type == GGML_F32
            np.testing.assert_array_equal(t.data.view(np.float32),
                                          raw[name].data.astype(np.float32))


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.F64, Q.I8])
def test_unsupported_tensor_type_refused(tmp_path, qtype):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", types={"blk.1.ffn_down.weight": qtype})
    with pytest.raises(UnsupportedModelError) as e:
        load_weights(path)
    assert "blk.1.ffn_down.weight" in str(e.value) and qtype.name in str(e.value)
    assert "F32, F16, BF16, Q8_0, Q4_0, Q4_1" in str(e.value)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_every_supported_matrix_type(tmp_path, qtype):
    w = load_weights(tiny_gguf.write_gguf(tmp_path / "m.gguf", matrix_type=qtype))
    assert w.tensors["blk.0.attn_q.weight"].ggml_type == qtype


def test_unknown_architecture_refused(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_weights(path)


def test_rope_freqs_tensor_refused(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", types={"rope_freqs.weight": Q.F32},
                                extra_tensors={"rope_freqs.weight": (8,)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_weights(path)


def test_linear_rope_scaling(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert load_weights(path).config.rope_scaling == {"type": "linear", "factor": 4.0}


def test_yarn_rope_scaling_refused(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_weights(path)


def test_missing_tensor_named(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", drop={"blk.1.attn_v.weight"})
    with pytest.raises(BadModelFile, match=r"blk\.1\.attn_v\.weight"):
        load_weights(path)


def test_wrong_shape_named(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf",
                                extra_tensors={"blk.0.attn_k.weight": (64, 64)})
    with pytest.raises(BadModelFile, match=r"blk\.0\.attn_k\.weight has shape \(64, 64\)"):
        load_weights(path)


def test_unknown_tensors_ignored_and_reported(tmp_path):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf", extra_tensors={"blk.0.extra.weight": (64,)})
    w = load_weights(path)
    assert "blk.0.extra.weight" not in w.tensors
    assert w.metadata["ignored_tensors"] == ["blk.0.extra.weight"]


def _config(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layer=1, n_embd=48, n_ff=64, n_head=2, n_head_kv=2, head_dim=24,
                vocab_size=10, n_ctx_train=128, rms_eps=1e-5, rope_theta=1e4, rope_neox=False)
    return ModelConfig(**{**base, **kw})


def _f32_specs(config):
    return {n: (0, s, int(np.prod(s)) * 4) for n, s in expected_tensors(config).items()}


def test_validate_quantized_needs_whole_blocks():
    cfg = _config()
    specs = _f32_specs(cfg)
    specs["blk.0.attn_q.weight"] = (8, (48, 48), 48 * 51)  # 48 columns: 1.5 Q8_0 blocks
    with pytest.raises(BadModelFile, match="multiple"):
        validate_tensors(cfg, specs)


def test_validate_byte_size():
    cfg = _config()
    specs = _f32_specs(cfg)
    specs["blk.0.ffn_up.weight"] = (0, (64, 48), 64 * 48 * 4 - 4)
    with pytest.raises(BadModelFile, match="blk.0.ffn_up.weight holds"):
        validate_tensors(cfg, specs)
    assert validate_tensors(cfg, {**_f32_specs(cfg), "x": (99, (1,), 1)}) == ["x"]


def test_expected_tensor_names():
    cfg = _config(n_layer=2, arch="qwen3", qk_norm=True, tied_output=False)
    names = expected_tensors(cfg)
    assert names["blk.1.attn_q_norm.weight"] == (24,) and names["output.weight"] == (10, 48)
    assert len(names) == 3 + 2 * 11


# --- damaged files ------------------------------------------------------------------------------

def _load_fails_cleanly(path, allow_success=True, seconds=10.0):
    t0 = time.monotonic()
    try:
        load_weights(path)
        ok = True
    except CLEAN_ERRORS:
        ok = False
    assert time.monotonic() - t0 < seconds, "loader took too long on a damaged file"
    assert allow_success or not ok, "damaged file loaded without an error"


def test_truncated_real_gguf(tmp_path, smol_path):
    path = tmp_path / "trunc.gguf"
    shutil.copyfile(smol_path, path)
    size, data_offset = os.path.getsize(path), read_header(smol_path).data_offset
    rng = np.random.default_rng(1)
    cuts = {0, 1, 3, 4, 7, 8, 16, 23, 24, 25, data_offset, data_offset - 1, size - 1}
    cuts |= set(rng.integers(0, data_offset, 40).tolist())
    cuts |= set(rng.integers(data_offset, size, 10).tolist())
    for cut in sorted(cuts, reverse=True):  # shrink the one copy step by step
        os.truncate(path, cut)
        with pytest.raises(BadModelFile):
            load_weights(path)


def _flip(path, offset, xor):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ xor]))


def test_byte_flips_tiny_gguf(tmp_path):
    clean = tiny_gguf.write_gguf(tmp_path / "clean.gguf")
    end = read_header(clean).data_offset
    rng = np.random.default_rng(2)
    path = tmp_path / "flip.gguf"
    failures = 0
    for _ in range(300):
        shutil.copyfile(clean, path)
        for off in rng.integers(0, end, rng.integers(1, 4)):
            _flip(path, int(off), int(rng.integers(1, 256)))
        try:
            load_weights(path)
        except CLEAN_ERRORS:
            failures += 1
    assert failures > 100  # most flips in the header must be detected


def test_byte_flips_real_gguf_header(tmp_path, smol_path):
    data_offset = read_header(smol_path).data_offset
    head = open(smol_path, "rb").read(data_offset)
    kv_end = head.index(b"tokenizer.ggml.tokens") - 8         # scalar metadata before the vocab
    info_start = head.rindex(b"token_embd.weight") - 8         # first tensor info
    path = tmp_path / "flip.gguf"
    shutil.copyfile(smol_path, path)
    t0 = time.monotonic()
    load_weights(path)  # a flip the loader accepts costs a whole load: the bound scales with it
    limit = max(10.0, 4 * (time.monotonic() - t0))
    rng = np.random.default_rng(3)
    for off in [*rng.integers(0, kv_end, 10), *rng.integers(info_start, data_offset, 10)]:
        xor = int(rng.integers(1, 256))
        _flip(path, int(off), xor)
        _load_fails_cleanly(path, seconds=limit)
        _flip(path, int(off), xor)  # restore


def _patch_array_length(path, key: bytes, new_len: int):
    """Overwrite the u64 length of the metadata array stored under `key`."""
    data = bytearray(open(path, "rb").read())
    at = data.index(key) + len(key) + 4 + 4  # key, value type (ARRAY), item type
    data[at:at + 8] = struct.pack("<Q", new_len)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("key", [b"tokenizer.ggml.tokens", b"tokenizer.ggml.token_type"])
@pytest.mark.parametrize("new_len", [2 ** 63, 2 ** 32, 10 ** 6, 265])
def test_inflated_array_length_fails_fast(tmp_path, key, new_len):
    path = tiny_gguf.write_gguf(tmp_path / "m.gguf")
    _patch_array_length(path, key, new_len)
    _load_fails_cleanly(path, allow_success=False, seconds=2.0)


def test_empty_and_garbage_files(tmp_path):
    for name, content in [("empty.gguf", b""), ("magic.gguf", b"GGUF"),
                          ("junk.gguf", os.urandom(4096)), ("hdr.gguf", b"GGUF" + b"\xff" * 60)]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(BadModelFile):
            load_weights(tmp_path / name)


# --- HF safetensors directories ---------------------------------------------------------------

@pytest.mark.parametrize("arch,tied,shards,dtype", [
    ("llama", True, 1, "bfloat16"), ("qwen2", False, 3, "float16"), ("qwen3", False, 2, "float32")])
def test_tiny_hf_dirs(tmp_path, arch, tied, shards, dtype):
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf", arch=arch, tied=tied, shards=shards,
                                    dtype=dtype)
    w = load_weights(folder)
    c = w.config
    assert (c.arch, c.tied_output, c.rope_neox, c.rope_theta) == (arch, tied, True, 1e6)
    assert set(w.tensors) == set(expected_tensors(c))
    want = {"bfloat16": 30, "float16": 1, "float32": 0}[dtype]
    assert w.tensors["blk.0.ffn_up.weight"].ggml_type == want
    assert all(t.ggml_type == GGML_F32 for t in w.tensors.values() if len(t.shape) == 1)


def test_hf_unmapped_tensor_ignored(tmp_path):
    import torch
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf",
                                    extra={"model.rotary_emb.inv_freq": torch.ones(8)})
    assert load_weights(folder).metadata["ignored_tensors"] == ["model.rotary_emb.inv_freq"]


def test_hf_unsupported_dtype_named(tmp_path):
    import torch
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf", extra={
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.float64)})
    with pytest.raises(UnsupportedModelError, match=r"q_proj\.weight has type F64"):
        load_weights(folder)


def test_hf_unknown_model_type(tmp_path):
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf", config_overrides={"model_type": "mamba"})
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_weights(folder)


def test_hf_rope_scaling(tmp_path):
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf", config_overrides={"rope_scaling": sc})
    assert load_weights(folder).config.rope_scaling == {"type": "llama3", **{
        k: v for k, v in sc.items() if k != "rope_type"}}


def test_hf_untied_without_lm_head(tmp_path):
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf", tied=True,
                                    config_overrides={"tie_word_embeddings": False})
    with pytest.raises(BadModelFile, match="lm_head"):
        load_weights(folder)


def test_hf_damaged_safetensors(tmp_path):
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf")
    st = os.path.join(folder, "model.safetensors")
    good = open(st, "rb").read()
    n = struct.unpack("<Q", good[:8])[0]
    for bad in [good[:len(good) // 2], good[:8 + n // 2], good[:5],
                struct.pack("<Q", 2 ** 40) + good[8:], good[:8] + b"{" * n + good[8 + n:]]:
        open(st, "wb").write(bad)
        with pytest.raises(BadModelFile):
            load_weights(folder)
