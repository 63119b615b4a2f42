"""DeepSeek V4 Hugging Face directories: config.json (`model_type: "deepseek_v4"`) + *.safetensors.

Tensors keep their OFFICIAL names (`embed.weight`, `layers.{i}.attn.wq_a.weight`, ...; see
docs/internal-interfaces.md): DeepSeek V4 has no GGUF-named counterpart in zen5, and the native
engine binds these names directly. The expected inventory follows from the config (which layers
have a compressor, which an indexer, which route by token id), and every tensor's presence, dtype
and exact shape is checked here, so a bad directory becomes a clear exception naming the tensor.

Formats: matrices are kept memory-mapped as they are in the file, in BF16/F16/F32 (the plain,
dequantized variant) or in the official formats (spec deepseek-v4-architecture.md 4.3):
F8_E4M3 with an F8_E8M0 `.scale` per 128 x 128 block, and I8 tensors of packed e2m1 pairs (the
routed experts; (out, in / 2) bytes, the even element in the low nibble) with an F8_E8M0 `.scale`
per 32 inputs, handed on as "MXFP4". The native engine repacks both at load (kernels.h). The
token embedding stays a float matrix (it is read a row at a time). Every 1-D norm weight and the
small `hc_*`, `ape`, `attn_sink`, `gate.bias` tensors become F32; `tid2eid` becomes I32.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from zen5.config import GGML_BF16, GGML_F16, GGML_F32, UnsupportedModelError
from zen5.deepseek_v4_config import DeepSeekV4Config
from zen5.loader.safetensors import load_tokenizer, read_chat_template, read_safetensors, shard_files
from zen5.loader.tensors import BadModelFile, LoadedWeights, Tensor

__all__ = ["DeepSeekV4Weights", "load_deepseek_v4_dir", "expected_deepseek_v4_tensors", "GGML_I32",
           "NATIVE_DTYPES"]

log = logging.getLogger("zen5.loader")

GGML_I32 = 26  # ggml's GGML_TYPE_I32 (tid2eid)
# the official formats' type ids (csrc/kernels/kernels.h, deepseek_v4.h; _native.dtype_id agrees)
TYPE_FP8, TYPE_MXFP4, TYPE_E8M0 = 1000, 1001, 1002
NATIVE_DTYPES = {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16", GGML_I32: "I32",
                 TYPE_FP8: "F8_E4M3", TYPE_MXFP4: "MXFP4", TYPE_E8M0: "F8_E8M0"}
_FLOAT = {"F32": GGML_F32, "F16": GGML_F16, "BF16": GGML_BF16}

# Tensor kinds: which file dtypes each accepts and what the loader hands on.
MATRIX = "matrix"  # BF16/F16/F32, kept memory-mapped as in the file
NORM = "norm"      # RMSNorm weights: BF16/F16/F32 -> F32
F32 = "f32"        # hc_*, ape, attn_sink, gate.bias: F32 (BF16 accepted) -> F32
INDEX = "index"    # tid2eid: I32/I64 -> I32, values in [0, n_experts)
SCALE = "scale"    # the E8M0 scales of an F8_E4M3 or packed e2m1 matrix, kept memory-mapped
_ALLOWED = {MATRIX: ("BF16", "F16", "F32"), NORM: ("BF16", "F16", "F32"), F32: ("F32", "BF16"),
            INDEX: ("I32", "I64"), SCALE: ("F8_E8M0",)}
_QUANTIZED = {"F8_E4M3": TYPE_FP8, "I8": TYPE_MXFP4}  # matrices in the official formats, with a .scale


@dataclass
class DeepSeekV4Weights(LoadedWeights):
    """`LoadedWeights` of a DeepSeek V4 directory: official names, `Tensor.ggml_type` one of
    F32/F16/BF16/I32 (`NATIVE_DTYPES`); `tokenizer` is None only when loaded with
    `require_tokenizer=False` from a directory without tokenizer.json."""
    config: DeepSeekV4Config

    def native_tensors(self) -> list[tuple[str, str, list[int], np.ndarray]]:
        """[(name, dtype, shape, flat uint8 array)], dtype "F32" | "F16" | "BF16" | "I32" |
        "F8_E4M3" | "MXFP4" | "F8_E8M0": what the native DeepSeek V4 constructor takes. Matrices
        and scales are the memory-mapped file bytes."""
        return [(t.name, NATIVE_DTYPES[t.ggml_type], list(t.shape), t.data) for t in self.tensors.values()]


# --- the inventory ------------------------------------------------------------------------------

def expected_deepseek_v4_tensors(c: DeepSeekV4Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the engine needs for `c`: official name -> (exact numpy shape, kind)."""
    d, hc, v = c.hidden_size, c.hc_mult, c.vocab_size
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc*hc) mixing weights
    out = {"embed.weight": ((v, d), MATRIX), "head.weight": ((v, d), MATRIX), "norm.weight": ((d,), NORM),
           "hc_head_fn": ((hc, hc * d), F32), "hc_head_base": ((hc,), F32), "hc_head_scale": ((1,), F32)}
    hd, qr, heads = c.head_dim, c.q_lora_rank, c.num_attention_heads
    o_rows = c.o_groups * c.o_lora_rank
    ih, idim = c.index_n_heads, c.index_head_dim
    for i, ratio in enumerate(c.compress_ratios):
        p = f"layers.{i}."
        for part in ("attn", "ffn"):
            out[f"{p}hc_{part}_fn"] = ((mix, hc * d), F32)
            out[f"{p}hc_{part}_base"] = ((mix,), F32)
            out[f"{p}hc_{part}_scale"] = ((3,), F32)
        out.update({
            p + "attn_norm.weight": ((d,), NORM), p + "ffn_norm.weight": ((d,), NORM),
            p + "attn.wq_a.weight": ((qr, d), MATRIX), p + "attn.q_norm.weight": ((qr,), NORM),
            p + "attn.wq_b.weight": ((heads * hd, qr), MATRIX),
            p + "attn.wkv.weight": ((hd, d), MATRIX), p + "attn.kv_norm.weight": ((hd,), NORM),
            p + "attn.wo_a.weight": ((o_rows, heads * hd // c.o_groups), MATRIX),
            p + "attn.wo_b.weight": ((d, o_rows), MATRIX),
            p + "attn.attn_sink": ((heads,), F32),
        })
        if ratio:
            out.update(_compressor(p + "attn.compressor.", ratio, hd, d))
        if ratio == 4:
            out.update({p + "attn.indexer.wq_b.weight": ((ih * idim, qr), MATRIX),
                        p + "attn.indexer.weights_proj.weight": ((ih, d), MATRIX)})
            out.update(_compressor(p + "attn.indexer.compressor.", ratio, idim, d))
        out[p + "ffn.gate.weight"] = ((c.n_routed_experts, d), MATRIX)
        if c.is_hash_layer(i):
            out[p + "ffn.gate.tid2eid"] = ((v, c.num_experts_per_tok), INDEX)
        else:
            out[p + "ffn.gate.bias"] = ((c.n_routed_experts,), F32)
        inter = c.moe_intermediate_size
        experts = [f"{p}ffn.experts.{e}." for e in range(c.n_routed_experts)]
        for q, width in [(e, inter) for e in experts] + [(p + "ffn.shared_experts.", inter * c.n_shared_experts)]:
            out.update({q + "w1.weight": ((width, d), MATRIX), q + "w3.weight": ((width, d), MATRIX),
                        q + "w2.weight": ((d, width), MATRIX)})
    return out


def _compressor(q: str, ratio: int, dim: int, d: int) -> dict:
    width = (2 if ratio == 4 else 1) * dim  # ratio 4 overlaps windows: two halves per row
    return {q + "wkv.weight": ((width, d), MATRIX), q + "wgate.weight": ((width, d), MATRIX),
            q + "norm.weight": ((dim,), NORM), q + "ape": ((ratio, width), F32)}


# --- the directory ------------------------------------------------------------------------------

def load_deepseek_v4_dir(folder, cfg: dict | None = None, require_tokenizer: bool = True,
                         layers: int | None = None) -> DeepSeekV4Weights:
    """Load a DeepSeek V4 directory. `cfg`: its config.json dict when already read.
    `require_tokenizer=False` allows a directory without tokenizer.json (tokenizer None), e.g. the
    tiny random test checkpoints; by default it is refused, like every safetensors directory.
    `layers=k`: only the first k layers, the head right after them (a truncated model, not the
    checkpoint's: for tests and benchmarks of a few real-size layers out of a full checkpoint)."""
    folder = os.fspath(folder)
    if cfg is None:
        cfg_path = os.path.join(folder, "config.json")
        if not os.path.exists(cfg_path):
            raise BadModelFile(folder, "not a model directory (no config.json)")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    if layers is not None:
        if not 0 < layers <= cfg.get("num_hidden_layers", 0):
            raise ValueError(f"layers must be in 1..{cfg.get('num_hidden_layers')}, got {layers}")
        cfg = dict(cfg, num_hidden_layers=layers, compress_ratios=list(cfg.get("compress_ratios", []))[:layers],
                   num_hash_layers=min(layers, cfg.get("num_hash_layers", 0)))
    config = DeepSeekV4Config.from_hf(cfg, folder)
    raw, ignored = _read_all(folder)
    if layers is not None:
        raw = {n: v for n, v in raw.items() if not n.startswith("layers.") or int(n.split(".")[1]) < layers}
    tensors = _validate(config, raw, folder)
    if ignored:
        log.info("%s: ignoring %d MTP tensor(s) (mtp.*): zen5 does not run the optional MTP head",
                 folder, len(ignored))
    tokenizer = None
    if require_tokenizer or os.path.exists(os.path.join(folder, "tokenizer.json")):
        tokenizer = load_tokenizer(folder, config)
    return DeepSeekV4Weights(
        config=config, tensors=tensors, tokenizer=tokenizer, chat_template=read_chat_template(folder),
        metadata={"format": "safetensors", "path": folder, "name": os.path.basename(os.path.normpath(folder)),
                  "ignored_tensors": sorted(ignored), "add_bos_token": _add_bos(folder)})


def _read_all(folder) -> tuple[dict[str, tuple[str, str, tuple, np.ndarray]], list[str]]:
    """name -> (file, dtype, shape, bytes) over all shards, and the ignored mtp.* names."""
    out, ignored = {}, []
    for file in shard_files(folder):
        for name, (dtype, shape, data) in read_safetensors(file).items():
            if name in out:
                raise BadModelFile(file, f"tensor {name} appears in more than one shard")
            if name.startswith("mtp."):
                # The multi-token-prediction block is optional (a draft head; spec 1.7): not loaded.
                ignored.append(name)
                continue
            out[name] = (file, dtype, shape, data)
    return out, ignored


def _validate(c: DeepSeekV4Config, raw: dict, folder) -> dict[str, Tensor]:
    expected = expected_deepseek_v4_tensors(c)
    # a matrix stored in an official format brings its scale tensor (its expected shape follows)
    for name, (shape, kind) in list(expected.items()):
        if kind == MATRIX and name in raw and raw[name][1] in _QUANTIZED and name != "embed.weight":
            rows, cols = shape
            fp4 = raw[name][1] == "I8"
            expected[name[:-len(".weight")] + ".scale"] = (
                (rows, cols // 32) if fp4 else (-(-rows // 128), -(-cols // 128)), SCALE)
    missing = [n for n in expected if n not in raw]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        shape, kind = expected[missing[0]]
        raise BadModelFile(folder, f"missing tensor {missing[0]} ({kind}, shape {list(shape)}){more}")
    extra = sorted(n for n in raw if n not in expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise BadModelFile(raw[extra[0]][0], f"unexpected tensor {extra[0]}{more}: not part of a DeepSeek V4 "
                                             f"model with this config.json")
    out = {}
    for name, (shape, kind) in expected.items():
        file, dtype, actual, data = raw[name]
        allowed = _ALLOWED[kind] + (tuple(_QUANTIZED) if kind == MATRIX and name != "embed.weight" else ())
        if dtype not in allowed:
            raise UnsupportedModelError(f"{file}: tensor {name} has dtype {dtype}, expected one of "
                                        f"{', '.join(allowed)}")
        if dtype == "I8":  # packed e2m1 pairs: half the columns in bytes
            if shape[1] % 32:
                raise BadModelFile(file, f"tensor {name}: packed e2m1 needs a multiple of 32 inputs, got {shape[1]}")
            shape = (shape[0], shape[1] // 2)
        if tuple(actual) != shape:
            raise BadModelFile(file, f"tensor {name} has shape {list(actual)}, expected {list(shape)}")
        out[name] = _convert(name, kind, dtype, shape, data, c, file)
    return out


def _convert(name, kind, dtype, shape, data, c: DeepSeekV4Config, file) -> Tensor:
    if kind == MATRIX:
        return Tensor(name, _QUANTIZED.get(dtype) or _FLOAT[dtype], shape, data)
    if kind == SCALE:
        return Tensor(name, TYPE_E8M0, shape, data)
    if kind == INDEX:
        ids = np.ascontiguousarray(data).view(np.int32 if dtype == "I32" else np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= c.n_routed_experts):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise BadModelFile(file, f"tensor {name} holds expert id {bad}, expected ids in "
                                     f"[0, {c.n_routed_experts})")
        return Tensor(name, GGML_I32, shape, np.array(ids, dtype=np.int32).view(np.uint8))
    raw = np.ascontiguousarray(data)
    if dtype == "F32":
        vals = raw.view(np.float32)
    elif dtype == "F16":
        vals = raw.view(np.float16).astype(np.float32)
    else:  # BF16: the high half of an F32
        vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    vals = np.array(vals, dtype=np.float32, copy=True)  # own the memory (small tensors)
    return Tensor(name, GGML_F32, shape, vals.view(np.uint8))


def _add_bos(folder) -> bool:
    """tokenizer_config.json's add_bos_token (false for DeepSeek V4). zen5's Tokenizer never adds
    BOS by itself (it encodes with add_special_tokens=False; the chat template writes it), so this
    is informational."""
    tc = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(tc):
        return False
    with open(tc, encoding="utf-8") as f:
        return json.load(f).get("add_bos_token") is True
