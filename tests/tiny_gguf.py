"""Tiny synthetic models (GGUF and HF safetensors dirs) for loader/tokenizer tests.

Writing the whole file with gguf.GGUFWriter keeps each case explicit (which arch, which tensor
gets which type) and makes every test run in milliseconds instead of loading a 100 MB model.
"""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from zen5.tokenizer import byte_chars

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]


def vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE with specials."""
    tokens = SPECIALS + byte_chars() + ["".join(m) for m in MERGES] + USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def add_tokenizer(w: gguf.GGUFWriter, model="gpt2", pre="smollm"):
    tokens, types, merges = vocab()
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template("{{ messages }}")


DIMS = dict(n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, head_dim=16)


def tensor_shapes(arch="llama", tied=True, **dims) -> dict[str, tuple[int, ...]]:
    d = {**DIMS, **dims}
    q, kv = d["n_head"] * d["head_dim"], d["n_head_kv"] * d["head_dim"]
    e, f = d["n_embd"], d["n_ff"]
    n_vocab = len(vocab()[0])
    out = {"token_embd.weight": (n_vocab, e), "output_norm.weight": (e,)}
    if not tied:
        out["output.weight"] = (n_vocab, e)
    for i in range(d["n_layer"]):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (e,), p + "attn_q.weight": (q, e),
                    p + "attn_k.weight": (kv, e), p + "attn_v.weight": (kv, e),
                    p + "attn_output.weight": (e, q), p + "ffn_norm.weight": (e,),
                    p + "ffn_gate.weight": (f, e), p + "ffn_up.weight": (f, e),
                    p + "ffn_down.weight": (e, f)})
        if arch == "qwen2":
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                        p + "attn_v.bias": (kv,)})
        if arch == "qwen3":
            out.update({p + "attn_q_norm.weight": (d["head_dim"],),
                        p + "attn_k_norm.weight": (d["head_dim"],)})
    return out


def _random_blocks(shape, qtype, rng):
    """Raw blocks of random values built directly (no float matrix, no quantizer): writing a
    model of hundreds of MB this way takes seconds. Scales are small positive f16 values."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if qtype == Q.BF16:
        x = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], cols * 2)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    n_scales = 2 if qtype == Q.Q4_1 else 1  # d (and Q4_1's m), f16 each
    raw[:, :, :2 * n_scales] = np.frombuffer(np.float16(0.01).tobytes() * n_scales, np.uint8)
    return raw.reshape(*shape[:-1], cols // block * size)


def _array(name: str, shape, qtype, rng, fast=False):
    """(data, raw_dtype) for add_tensor: floats for F32/F16, raw blocks otherwise."""
    if fast and len(shape) == 2 and qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16):
        return _random_blocks(shape, qtype, rng), qtype
    x = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return x, None
    if qtype == Q.F16:
        return x.astype(np.float16), None
    if qtype == Q.F64:
        return x.astype(np.float64), None
    if qtype == Q.I8:
        return (x * 10).astype(np.int8), None
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16):
        return gguf.quants.quantize(x, qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]  # e.g. Q5_K: zeros in the right layout
    return np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8), qtype


def write_gguf(path, arch="llama", tied=True, types: dict | None = None, extra_tensors=(),
               metadata=None, pre="smollm", tokenizer_model="gpt2", matrix_type=Q.Q8_0,
               drop=(), fast=False, **dims) -> str:
    """A complete tiny model; `types` overrides the GGML type of named tensors. `fast`: matrices
    are random blocks written directly (_random_blocks), for models of hundreds of MB."""
    d = {**DIMS, **dims}
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(d["n_layer"])
    w.add_context_length(512)
    w.add_embedding_length(d["n_embd"])
    w.add_feed_forward_length(d["n_ff"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_head_kv"])
    w.add_key_length(d["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(50000.0)
    for k, v in (metadata or {}).items():
        (w.add_string if isinstance(v, str) else w.add_float32)(k, v)
    add_tokenizer(w, tokenizer_model, pre)
    shapes = tensor_shapes(arch, tied, **dims)
    shapes.update(dict(extra_tensors))
    for name, shape in shapes.items():
        if name in drop:
            continue
        qtype = (types or {}).get(name, Q.F16 if len(shape) == 1 else matrix_type)
        data, raw = _array(name, shape, qtype, rng, fast)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def hf_tokenizer_json(path):
    """Save the tiny vocabulary as an HF tokenizer.json (built via the GGUF route)."""
    from zen5.loader.gguf import read_tokenizer
    gpath = os.path.join(os.path.dirname(path), "_tok.gguf")
    w = gguf.GGUFWriter(gpath, "llama")
    add_tokenizer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    read_tokenizer(gpath).hf.save(os.fspath(path))
    os.unlink(gpath)


def hf_name(gguf_name: str) -> str:
    """HF name of a GGUF-named tensor: the inverse of the loader's map (the PyTorch oracle keeps
    its own independent map, so a wrong entry there still shows up as a mismatch)."""
    from zen5.loader.safetensors import _LAYER_NAMES, _TOP_NAMES
    top = {v: k for k, v in _TOP_NAMES.items()}
    if gguf_name in top:
        return top[gguf_name]
    _, i, rest = gguf_name.split(".", 2)
    return f"model.layers.{i}.{ {v: k for k, v in _LAYER_NAMES.items()}[rest]}"


def write_hf_dir(folder, arch="llama", tied=True, dtype="bfloat16", shards=1, extra=None,
                 config_overrides=None, **dims) -> str:
    """A tiny HF checkpoint directory: config.json, (sharded) safetensors, tokenizer.json."""
    import torch
    from safetensors.torch import save_file
    d = {**DIMS, **dims}
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {hf_name(n): torch.randn(s, generator=g).to(getattr(torch, dtype))
               for n, s in tensor_shapes(arch, tied, **dims).items()}
    tensors.update(extra or {})
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    if shards == 1:
        files = ["model.safetensors"]
    weight_map = {n: files[k % shards] for k, n in enumerate(names)}
    for f in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == f},
                  os.path.join(folder, f))
    if shards > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    cfg = {"model_type": arch, "num_hidden_layers": d["n_layer"], "hidden_size": d["n_embd"],
           "intermediate_size": d["n_ff"], "num_attention_heads": d["n_head"],
           "num_key_value_heads": d["n_head_kv"], "head_dim": d["head_dim"],
           "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
           "vocab_size": len(vocab()[0])}
    cfg.update(config_overrides or {})
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    hf_tokenizer_json(os.path.join(folder, "tokenizer.json"))
    return os.fspath(folder)
