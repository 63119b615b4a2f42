"""Validated model configuration: the one description of a decoder that every loader produces.

Loaders (GGUF, safetensors) turn their file's metadata into a `ModelConfig`; the native engine
receives it as a plain dict. Tensor names always follow GGUF's convention (HF names are mapped on
load), so the native side knows exactly one naming scheme.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# GGML type ids (gguf.GGMLQuantizationType values) the engine computes with directly.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
SUPPORTED_TYPES = {GGML_F32: "F32", GGML_F16: "F16", GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1",
                   GGML_Q8_0: "Q8_0", GGML_BF16: "BF16"}


class UnsupportedModelError(ValueError):
    """The file is readable but describes something zen5 cannot run (architecture, type, shape)."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # "llama" | "qwen2" (q/k/v biases) | "qwen3" (per-head q/k RMSNorm)
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    n_ctx_train: int          # the context the model was trained for (default context limit)
    rms_eps: float
    rope_theta: float
    # True: rotate halves (x[i], x[i+d/2]) as in HF checkpoints and Qwen GGUFs.
    # False: rotate adjacent pairs (x[2i], x[2i+1]) as in llama GGUFs, whose convert script
    # permuted the q/k rows into that order.
    rope_neox: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_output: bool = False  # output head shares token_embd.weight
    # None, {"type": "linear", "factor": f} or {"type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {self.arch!r}; zen5 runs {', '.join(SUPPORTED_ARCHS)}")
        for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim",
                     "vocab_size", "n_ctx_train"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_head % self.n_head_kv:
            raise UnsupportedModelError(
                f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim {self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise UnsupportedModelError("rope_theta and rms_eps must be positive")
        kind = (self.rope_scaling or {}).get("type", "none")
        if kind not in ("none", "linear", "llama3"):
            raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r}")

    def rope_inv_freq(self) -> np.ndarray:
        """Per-pair inverse frequencies (float32, head_dim/2), scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        sc = self.rope_scaling or {}
        if sc.get("type") == "linear":
            inv = inv / float(sc["factor"])
        elif sc.get("type") == "llama3":
            factor = float(sc["factor"])
            lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
            old_ctx = float(sc.get("original_max_position_embeddings", 8192))
            lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
            wavelen = 2 * math.pi / inv
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            scaled = np.where(wavelen > lo_wl, inv / factor, inv)
            mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
            inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return inv.astype(np.float32)

    def to_native(self) -> dict:
        d = asdict(self)
        d.pop("rope_scaling")
        return d
