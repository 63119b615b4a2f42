"""Every architecture variant and weight type through the real loaders and the engine, against
the PyTorch oracle, on tiny random models (fast, no downloaded weights).

GGUF llama files use the interleaved RoPE layout and Qwen files the neox one; HF directories are
always neox. Weights are random with unit scale, so logits are large: the tolerance is relative
to the largest logit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch_ref import TorchRef, load_for_reference

import tiny_gguf
from tiers import TIERS
from zen5 import _native
from zen5.engine import Engine

ISAS = TIERS  # every tier this machine runs (tests/tiers.py)
TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1}
TOKENS = [5, 70, 71, 72, 3, 200, 17, 9, 120, 121, 33, 44, 1, 250, 8, 19, 60, 61]


def check(path: str, isa: str, matmul: str = "f32") -> float:
    """Within 1e-4 of the largest logit on the exact (f32) matmul path. The int8 path is pinned
    per type by tests/test_kernels.py (exact integer emulation) and on real weights by
    test_reference_agreement.py: random unit-scale networks amplify its rounding chaotically."""
    cfg, tensors = load_for_reference(path)
    with torch.no_grad():
        ref = TorchRef(cfg, tensors).forward(TOKENS).numpy()
    eng = Engine.load(path, n_ctx=64, isa=isa, threads=2, matmul=matmul)
    ours = eng.native_ctx.eval(TOKENS, all_logits=True)
    rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert rel < (1e-4 if matmul == "f32" else 5e-2), f"{path} {isa} {matmul}: relative difference {rel:.3g}"
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= (0.95 if matmul == "f32" else 0.8)
    return rel


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", list(TYPES))
def test_gguf_arch_and_type(tmp_path, arch, kind, isa):
    path = tiny_gguf.write_gguf(tmp_path / f"{arch}-{kind}.gguf", arch=arch, tied=(arch != "qwen2"),
                                matrix_type=TYPES[kind])
    check(path, isa)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_safetensors_arch_and_dtype(tmp_path, arch, dtype):
    path = tiny_gguf.write_hf_dir(tmp_path / f"{arch}-{dtype}", arch=arch, tied=(arch == "qwen3"), dtype=dtype)
    for isa in ISAS:
        check(path, isa)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_rope_scaling(tmp_path, scaling):
    path = tiny_gguf.write_hf_dir(tmp_path / "scaled", config_overrides={"rope_scaling": scaling})
    assert Engine.load(path, n_ctx=64).config.rope_scaling is not None
    check(path, ISAS[-1])


def test_q8_cache_refuses_a_head_size_its_layout_cannot_hold(tmp_path):
    """The q8_0 cache keeps a head's channels in quads: head size 6 is refused by name, while
    the default cache serves the same model."""
    path = tiny_gguf.write_gguf(tmp_path / "hd6.gguf", matrix_type=Q.F32, head_dim=6)
    with pytest.raises(_native.ZenError, match="multiple of 4 and at most 512, not 6"):
        Engine.load(path, n_ctx=32, kv_type="q8_0")
    assert Engine.load(path, n_ctx=32).generate("hi", max_tokens=2, temperature=0).completion_tokens >= 1
