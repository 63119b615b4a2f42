"""Model loading: turn a GGUF file or a Hugging Face safetensors directory into `LoadedWeights`.

Every format ends in the same shape (docs/internal-interfaces.md): a validated `ModelConfig`,
tensors under GGUF names as raw uint8 bytes in GGML layout (matrices memory-mapped, never copied;
norm weights and biases converted to F32), a tokenizer and a chat template. All checks the
native engine relies on (names, types, exact shapes, byte sizes) happen here, in Python, so a bad
file becomes a clear exception instead of an out-of-bounds read in C++.

DeepSeek V4 directories (config.json `model_type: "deepseek_v4"`) are the exception: they load into
`DeepSeekV4Weights` (loader/deepseek_v4.py) with the official tensor names and a `DeepSeekV4Config`.
"""
from __future__ import annotations

import json
import os

from zen5.config import UnsupportedModelError
from zen5.loader.deepseek_v4 import DeepSeekV4Weights, load_deepseek_v4_dir
from zen5.loader.gguf import load_gguf
from zen5.loader.safetensors import load_safetensors_dir
from zen5.loader.tensors import (
    BadModelFile,
    LoadedWeights,
    Tensor,
    expected_tensors,
    prepare_tensors,
    row_bytes,
    type_name,
    validate_tensors,
)

__all__ = ["Tensor", "LoadedWeights", "BadModelFile", "UnsupportedModelError", "load_weights",
           "expected_tensors", "validate_tensors", "prepare_tensors", "row_bytes", "type_name",
           "DeepSeekV4Weights", "load_deepseek_v4_dir"]


def load_weights(path) -> LoadedWeights:
    """Load a `.gguf` file or a Hugging Face directory (config.json + *.safetensors); a DeepSeek V4
    directory gives `DeepSeekV4Weights`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    if os.path.isdir(path):
        cfg = _hf_config(path)
        if isinstance(cfg, dict) and cfg.get("model_type") == "deepseek_v4":
            return load_deepseek_v4_dir(path, cfg)
        return load_safetensors_dir(path)
    if path.lower().endswith(".gguf") or _has_gguf_magic(path):
        return load_gguf(path)
    raise BadModelFile(path, "not a GGUF file (no GGUF magic) and not a model directory")


def _hf_config(folder: str):
    """config.json's contents, or None when there is none (the directory loader then says so)."""
    cfg = os.path.join(folder, "config.json")
    if not os.path.exists(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise BadModelFile(cfg, f"not valid JSON: {e}") from None


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
