"""The shape every loader produces: tensors under GGUF names as raw bytes in GGML layout, their
exact expected shapes and byte sizes for a `ModelConfig`, and the checks that turn a bad file
into a clear exception. The format readers (gguf.py, safetensors.py) build on these; the
package's `load_weights` dispatches to them."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np

from zen5.config import GGML_BF16, GGML_F16, GGML_F32, SUPPORTED_TYPES, ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from zen5.tokenizer import Tokenizer

log = logging.getLogger("zen5.loader")

# The order users read in error messages (float types first, then quantized).
_TYPE_DISPLAY_ORDER = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# (elements per block, bytes per block) for the types the engine computes with.
_BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}


class BadModelFile(ValueError):
    """The file is damaged or inconsistent (truncated, corrupted, missing or mis-sized tensors)."""

    def __init__(self, path, reason: str):
        self.path, self.reason = (str(path) if path is not None else None), reason
        super().__init__(f"{self.path}: {reason}" if self.path else reason)


@dataclass
class Tensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # numpy order, e.g. (rows, cols)
    data: np.ndarray         # uint8, C-contiguous raw bytes (memory-mapped view), flat


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, Tensor]
    tokenizer: "Tokenizer"
    chat_template: str | None
    metadata: dict           # {"format": "gguf"|"safetensors", "path": ..., "name": ...}


def type_name(ggml_type: int) -> str:
    if ggml_type in SUPPORTED_TYPES:
        return SUPPORTED_TYPES[ggml_type]
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type#{ggml_type}"


def unsupported_type_error(source, name: str, type_label: str) -> UnsupportedModelError:
    where = f"{source}: " if source else ""
    return UnsupportedModelError(
        f"{where}tensor {name} has type {type_label}, which zen5 does not support "
        f"({', '.join(_TYPE_DISPLAY_ORDER)})")


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of `cols` elements; ValueError when cols doesn't fill whole blocks."""
    block, size = _BLOCK[ggml_type]
    if cols % block:
        raise ValueError(f"{cols} columns is not a multiple of the {type_name(ggml_type)} "
                         f"block size {block}")
    return cols // block * size


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs for `config`, with its exact numpy shape."""
    c = config
    q_rows, kv_rows = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    out = {"token_embd.weight": (c.vocab_size, c.n_embd), "output_norm.weight": (c.n_embd,)}
    if not c.tied_output:
        out["output.weight"] = (c.vocab_size, c.n_embd)
    for i in range(c.n_layer):
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": (c.n_embd,),
            p + "attn_q.weight": (q_rows, c.n_embd),
            p + "attn_k.weight": (kv_rows, c.n_embd),
            p + "attn_v.weight": (kv_rows, c.n_embd),
            p + "attn_output.weight": (c.n_embd, q_rows),
            p + "ffn_norm.weight": (c.n_embd,),
            p + "ffn_gate.weight": (c.n_ff, c.n_embd),
            p + "ffn_up.weight": (c.n_ff, c.n_embd),
            p + "ffn_down.weight": (c.n_embd, c.n_ff),
        })
        if c.qkv_bias:
            out.update({p + "attn_q.bias": (q_rows,), p + "attn_k.bias": (kv_rows,),
                        p + "attn_v.bias": (kv_rows,)})
        if c.qk_norm:
            out.update({p + "attn_q_norm.weight": (c.head_dim,),
                        p + "attn_k_norm.weight": (c.head_dim,)})
    return out


def validate_tensors(config: ModelConfig, specs: Mapping[str, tuple[int, tuple, int]],
                     source=None) -> list[str]:
    """Check name -> (ggml_type, shape, nbytes) against `config`; return the unknown names.

    Raises BadModelFile for a missing tensor, a wrong shape or byte size, and
    UnsupportedModelError for a type the engine does not compute with.
    """
    expected = expected_tensors(config)
    missing = [n for n in expected if n not in specs]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BadModelFile(source, f"missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        _check_one(name, shape, *specs[name], source=source)
    return sorted(n for n in specs if n not in expected)


def _check_one(name, shape, ggml_type, actual_shape, nbytes, source):
    if ggml_type not in SUPPORTED_TYPES:
        raise unsupported_type_error(source, name, type_name(ggml_type))
    if tuple(actual_shape) != tuple(shape):
        raise BadModelFile(source, f"tensor {name} has shape {tuple(actual_shape)}, "
                                   f"expected {tuple(shape)}")
    try:
        want = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(ggml_type, shape[-1])
    except ValueError as e:
        raise BadModelFile(source, f"tensor {name}: {e}") from None
    if nbytes != want:
        raise BadModelFile(source, f"tensor {name} holds {nbytes} bytes, expected {want} "
                                   f"for {type_name(ggml_type)} {tuple(shape)}")


def prepare_tensors(config: ModelConfig, tensors: Mapping[str, Tensor], source=None
                    ) -> tuple[dict[str, Tensor], list[str]]:
    """Validate, convert 1-D tensors to F32, drop unknown ones; returns (tensors, ignored names)."""
    specs = {n: (t.ggml_type, t.shape, t.data.nbytes) for n, t in tensors.items()}
    ignored = validate_tensors(config, specs, source)
    if ignored:
        log.warning("%s: ignoring %d tensor(s) zen5 does not use: %s", source, len(ignored),
                    ", ".join(ignored[:5]) + (" ..." if len(ignored) > 5 else ""))
    out = {}
    for name in expected_tensors(config):
        t = tensors[name]
        out[name] = _to_f32(t) if len(t.shape) == 1 else t
    return out, ignored


def _to_f32(t: Tensor) -> Tensor:
    """Norm weights and biases: small, so the engine only ever sees them as F32."""
    raw = np.ascontiguousarray(t.data).reshape(-1)
    if t.ggml_type == GGML_F32:
        vals = raw.view(np.float32)
    elif t.ggml_type == GGML_F16:
        vals = raw.view(np.float16).astype(np.float32)
    elif t.ggml_type == GGML_BF16:
        vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        vals = dequantize(raw, GGMLQuantizationType(t.ggml_type)).reshape(-1)
    vals = np.array(vals, dtype=np.float32, copy=True)  # own the memory, writeable
    return Tensor(t.name, GGML_F32, t.shape, vals.view(np.uint8))
