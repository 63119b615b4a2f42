"""Hugging Face directory loader: config.json + *.safetensors (+ tokenizer.json).

Safetensors is simple enough to read directly (8-byte little-endian header length, a JSON
header, then raw little-endian data), which lets us memory-map the file with numpy and hand the
engine views without copying and without importing torch. HF tensor names are mapped to GGUF
names so the engine knows one naming scheme; F32/F16/BF16 bytes are already GGML's layout.
HF checkpoints keep q/k rows in the "rotate halves" order, hence rope_neox=True.
DeepSeek V4 directories (model_type "deepseek_v4") keep their official names: loader/deepseek_v4.py
reads them (with this module's file readers); `zen5.loader.load_weights` dispatches on model_type.
"""
from __future__ import annotations

import glob
import json
import os
import re
import struct

import numpy as np

from zen5.config import GGML_BF16, GGML_F16, GGML_F32, SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError
from zen5.loader.tensors import BadModelFile, LoadedWeights, Tensor, prepare_tensors, unsupported_type_error

__all__ = ["load_safetensors_dir", "read_safetensors", "config_from_hf", "hf_to_gguf_name", "shard_files",
           "load_tokenizer", "read_chat_template"]

_DTYPES = {"F32": GGML_F32, "F16": GGML_F16, "BF16": GGML_BF16}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 << 20

_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_to_gguf_name(name: str) -> str | None:
    """GGUF name of an HF llama/qwen2/qwen3 tensor, or None for tensors zen5 doesn't use."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


# --- safetensors files ------------------------------------------------------------------------

def read_safetensors_header(path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """HF name -> (dtype, shape, (begin, end) byte offsets in the file), checked, for every
    tensor in one file."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 8:
        raise BadModelFile(path, f"file too small for a safetensors header ({size} bytes)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if not 2 <= n <= min(size - 8, _MAX_HEADER):
            raise BadModelFile(path, f"bad safetensors header length {n} (file has {size} bytes)")
        header = _parse_json(path, f.read(n))
    start = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (b, e) = _entry(path, name, entry, size - start)
        out[name] = (dtype, shape, (start + b, start + e))
    return out


def read_safetensors(path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """HF name -> (dtype, shape, flat uint8 memmap view) for every tensor in one file."""
    header = read_safetensors_header(path)
    data = np.memmap(os.fspath(path), dtype=np.uint8, mode="r")
    return {name: (dtype, shape, np.asarray(data[b:e])) for name, (dtype, shape, (b, e)) in header.items()}


def _parse_json(path, raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadModelFile(path, f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise BadModelFile(path, "safetensors header is not a JSON object")
    return header


def _entry(path, name, entry, data_len):
    """Checked (dtype, shape, (begin, end)) of one header entry."""
    try:
        dtype, shape, offs = entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"])
    except (KeyError, TypeError):
        raise BadModelFile(path, f"malformed header entry for {name}") from None
    ints = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape + offs)
    if not (isinstance(dtype, str) and ints and len(offs) == 2 and offs[0] <= offs[1] <= data_len):
        raise BadModelFile(path, f"tensor {name}: bad header entry {entry!r} "
                                 f"(data section is {data_len} bytes)")
    n = int(np.prod(shape, dtype=np.int64))
    if dtype in _ITEMSIZE and offs[1] - offs[0] != n * _ITEMSIZE[dtype]:
        raise BadModelFile(path, f"tensor {name}: {offs[1] - offs[0]} bytes for {dtype} {shape}")
    return dtype, shape, offs


def shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise BadModelFile(index, "no weight_map")
        files = sorted({os.path.join(folder, v) for v in weight_map.values()})
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise BadModelFile(folder, "no *.safetensors files")
    for f in files:
        if not os.path.exists(f):
            raise BadModelFile(f, "shard listed in model.safetensors.index.json is missing")
    return files


def _gguf_tensors(folder: str) -> tuple[dict[str, Tensor], list[str]]:
    """All shards' tensors under GGUF names; unsupported dtypes refused; returns unmapped names."""
    out, unmapped = {}, []
    for file in shard_files(folder):
        for hf_name, (dtype, shape, data) in read_safetensors(file).items():
            name = hf_to_gguf_name(hf_name)
            if name is None:
                unmapped.append(hf_name)
                continue
            if dtype not in _DTYPES:
                raise unsupported_type_error(file, hf_name, dtype)
            if name in out:
                raise BadModelFile(file, f"tensor {hf_name} appears in more than one shard")
            out[name] = Tensor(name, _DTYPES[dtype], shape, data)
    return out, unmapped


# --- config.json ------------------------------------------------------------------------------

def _req(cfg: dict, key: str, path, kind=int):
    v = cfg.get(key)
    if not isinstance(v, (int, float) if kind is float else int) or isinstance(v, bool):
        raise BadModelFile(path, f"config.json: {key} missing or not a number ({v!r})")
    return kind(v)


def config_from_hf(cfg: dict, tensors: dict, path=None) -> ModelConfig:
    """ModelConfig from a HF config.json dict and the (GGUF-named) tensors present."""
    arch = cfg.get("model_type")
    if arch == "deepseek_v4":
        raise UnsupportedModelError(f"{path}: a DeepSeek V4 directory: load it with zen5.loader.load_weights "
                                    "(or zen5.loader.load_deepseek_v4_dir)")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"{path}: model_type {arch!r} is not supported; zen5 runs "
                                    f"{', '.join(SUPPORTED_ARCHS)}")
    _refuse_variants(cfg, arch, path)
    if "token_embd.weight" not in tensors or len(tensors["token_embd.weight"].shape) != 2:
        raise BadModelFile(path, "missing or malformed model.embed_tokens.weight")
    n_embd, n_head = _req(cfg, "hidden_size", path), _req(cfg, "num_attention_heads", path)
    if n_head <= 0:
        raise BadModelFile(path, f"config.json: num_attention_heads {n_head}")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    fields = dict(
        arch=arch, n_layer=_req(cfg, "num_hidden_layers", path), n_embd=n_embd,
        n_ff=_req(cfg, "intermediate_size", path), n_head=n_head,
        n_head_kv=cfg.get("num_key_value_heads") or n_head,
        head_dim=cfg.get("head_dim") or n_embd // n_head,
        vocab_size=tensors["token_embd.weight"].shape[0],
        n_ctx_train=_req(cfg, "max_position_embeddings", path),
        rms_eps=_req(cfg, "rms_norm_eps", path, float),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_neox=True, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        tied_output=_tied(cfg, tensors, path),
        rope_scaling=_hf_rope_scaling(cfg.get("rope_scaling") or rope, path))
    try:
        return ModelConfig(**fields)
    except (UnsupportedModelError, TypeError, ValueError) as e:  # its checks don't know the file
        raise UnsupportedModelError(f"{path}: config.json: {e}") from None


def _refuse_variants(cfg, arch, path):
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{path}: attention biases are not supported for {arch}")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: MLP biases are not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{path}: sliding-window attention is not supported")


def _tied(cfg, tensors, path) -> bool:
    if "output.weight" not in tensors:
        if cfg.get("tie_word_embeddings") is False:
            raise BadModelFile(path, "lm_head.weight is missing and tie_word_embeddings is false")
        return True
    return cfg.get("tie_word_embeddings") is True


def _hf_rope_scaling(sc, path) -> dict | None:
    if not isinstance(sc, dict):
        return None
    kind = sc.get("rope_type") or sc.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        if not isinstance(sc.get("factor"), (int, float)):
            raise BadModelFile(path, f"config.json: linear rope_scaling without a factor: {sc}")
        return {"type": "linear", "factor": float(sc["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"type": "llama3", **{k: sc[k] for k in keys if k in sc}}
    raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported")


# --- the directory ----------------------------------------------------------------------------

def load_safetensors_dir(folder) -> LoadedWeights:
    folder = os.fspath(folder)
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise BadModelFile(folder, "not a model directory (no config.json)")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    raw, unmapped = _gguf_tensors(folder)
    config = config_from_hf(cfg, raw, folder)
    if config.tied_output:
        raw.pop("output.weight", None)
    tensors, ignored = prepare_tensors(config, raw, folder)
    tokenizer = load_tokenizer(folder, config)
    return LoadedWeights(
        config=config, tensors=tensors, tokenizer=tokenizer,
        chat_template=read_chat_template(folder),
        metadata={"format": "safetensors", "path": folder,
                  "name": os.path.basename(os.path.normpath(folder)),
                  "ignored_tensors": sorted(ignored + unmapped)})


def load_tokenizer(folder, config):
    from zen5.tokenizer import Tokenizer
    tj = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tj):
        raise BadModelFile(folder, "no tokenizer.json")
    tok = Tokenizer.from_files(tj)
    if tok.vocab_size > config.vocab_size:
        raise BadModelFile(folder, f"tokenizer has {tok.vocab_size} tokens but the embedding "
                                   f"only {config.vocab_size} rows")
    return tok


def read_chat_template(folder) -> str | None:
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tc = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(tc):
        return None
    with open(tc, encoding="utf-8") as f:
        t = json.load(f).get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t if isinstance(t, str) else None
