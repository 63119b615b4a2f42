"""The whole decoder pinned to an independent implementation: PyTorch fp32 (tests/reference) on
the same dequantized weights. Logits must agree within a documented tolerance at every position
of several prompts, on both kernel paths, and greedy continuations must be token-identical.

Two matmul paths are pinned:
- `matmul="f32"` (quantized weights dequantized to fp32): the engine and the reference sum in
  different orders, which moves logits by ~1e-4 on SmolLM2 (logit range ~40). We allow 2e-3
  absolute: two orders of magnitude of margin, and still far below what any real bug (a wrong
  RoPE pair, a missed bias, an off-by-one in the cache) produces (> 1). Greedy continuations are
  token-identical.
- `matmul="int8"` (the default: activations quantized to int8 per 32-value block, as llama.cpp
  does): each matmul carries ~0.5% relative error, so logits move by up to ~1.5 and near-ties
  (top-2 within a few tenths) can flip. Documented tolerance: max |logit diff| < 3, and the top
  token agrees with the reference at every position where the reference's top-2 margin is > 1.

The q8_0 KV cache is pinned in three steps. Its attention (int8 K/V with scales, int8 queries,
u8 weights per 32 positions, per-split softmax) is written plainly in the reference
(`torch_ref.q8_attention`) and must match the engine's kernels composed the way the decoder
composes them to 1e-5. Layer 0's cache bytes are checked bit for bit in test_kv_cache.py. The whole
model against `TorchRef(kv_type="q8_0")` can only agree statistically: a value within rounding
error of a quantization step lands on either side of it and moves by a whole step, so 1e-6 of
noise in the weights moves the reference's own logits by 0.07-0.09 on average (measured). Bound:
mean |logit diff| < 0.15, max < 1.5, top-1 equal where the reference's margin is > 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_ref import TorchRef, load_for_reference

from tiers import TIERS
from zen5._native import testing
from zen5.engine import Engine

pytestmark = pytest.mark.model
TOL = 2e-3
ISAS = TIERS  # every tier this machine runs (tests/tiers.py)

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Unicode: naïve café, 東京, emoji 🚀 and numbers 3.14159 26535.",
]


@pytest.fixture(scope="module")
def smol_ref(smollm2_path):
    cfg, tensors = load_for_reference(smollm2_path)
    return TorchRef(cfg, tensors)


@pytest.mark.parametrize("isa", ISAS)
def test_smollm2_logits_match_reference(smollm2_path, smol_ref, isa):
    eng = Engine.load(smollm2_path, n_ctx=512, isa=isa, matmul="f32")
    worst = 0.0
    for prompt in PROMPTS:
        toks = eng.tokenizer.encode(prompt)
        eng.reset()
        ours = eng.native_ctx.eval(toks, all_logits=True)           # (n, vocab), every position
        with torch.no_grad():
            ref = smol_ref.forward(toks).numpy()
        diff = np.abs(ours - ref).max(axis=1)
        worst = max(worst, float(diff.max()))
        assert diff.max() < TOL, f"{isa}: positions {np.nonzero(diff >= TOL)[0]} differ by {diff.max()}"
        assert (ours.argmax(1) == ref.argmax(1)).all()
    print(f"SmolLM2 {isa}: worst logit difference {worst:.3g} over {len(PROMPTS)} prompts")


def test_smollm2_greedy_64_tokens_identical(smollm2_path, smol_ref):
    eng = Engine.load(smollm2_path, n_ctx=512, matmul="f32")
    prompt = eng.tokenizer.encode(PROMPTS[0].replace("capital of France", "best way to learn Python"))
    ours = eng.generate(prompt, max_tokens=64, temperature=0, stop=None)
    with torch.no_grad():
        ref = smol_ref.greedy(prompt, 64, stop=eng.tokenizer.eos_ids)
    n = len(ours.token_ids)
    assert ours.token_ids == ref[:n]
    assert n == 64 or ref[n - 1] in eng.tokenizer.eos_ids or len(ref) == n
    print(f"greedy: {n} tokens identical")


@pytest.mark.parametrize("isa", ISAS)
def test_smollm2_int8_path_within_documented_tolerance(smollm2_path, smol_ref, isa):
    eng = Engine.load(smollm2_path, n_ctx=512, isa=isa, matmul="int8")
    worst, checked = 0.0, 0
    for prompt in PROMPTS:
        toks = eng.tokenizer.encode(prompt)
        eng.reset()
        ours = eng.native_ctx.eval(toks, all_logits=True)
        with torch.no_grad():
            ref = smol_ref.forward(toks).numpy()
        worst = max(worst, float(np.abs(ours - ref).max()))
        top2 = np.sort(ref, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1.0
        assert (ours.argmax(1) == ref.argmax(1))[clear].all()
        checked += int(clear.sum())
    print(f"SmolLM2 int8 {isa}: worst logit difference {worst:.3g}; top-1 agrees at all {checked} clear positions")
    assert worst < 3.0


@pytest.mark.parametrize("isa", ISAS)
def test_tiny_deepseek_matches_reference(tiny_deepseek_dir, isa):
    cfg, tensors = load_for_reference(tiny_deepseek_dir)
    ref = TorchRef(cfg, tensors)
    eng = Engine.load(str(tiny_deepseek_dir), n_ctx=256, isa=isa, matmul="f32")
    assert eng.config.vocab_size == 129280
    toks = eng.tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>Call the weather tool for Paris."
                                "<｜Assistant｜><think>")
    ours = eng.native_ctx.eval(toks, all_logits=True)
    with torch.no_grad():
        theirs = ref.forward(toks).numpy()
    assert np.abs(ours - theirs).max() < TOL
    eng.reset()
    out = eng.generate(toks, max_tokens=64, temperature=0)
    with torch.no_grad():
        expect = ref.greedy(toks, 64, stop=eng.tokenizer.eos_ids)
    assert out.token_ids == expect[: len(out.token_ids)]


def test_dsml_tiny_matches_reference():
    """The trained DeepSeek-format model from ../shared/models, when present."""
    from zen5.registry import ModelNotFound, resolve_model

    try:
        path = resolve_model("dsml-tiny")
    except ModelNotFound as e:
        pytest.skip(str(e))
    cfg, tensors = load_for_reference(path)
    ref = TorchRef(cfg, tensors)
    eng = Engine.load(path, n_ctx=256)
    toks = eng.tokenizer.encode("<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Weather in Lisbon?"
                                "<｜Assistant｜><think>")
    ours = eng.native_ctx.eval(toks, all_logits=True)
    with torch.no_grad():
        assert np.abs(ours - ref.forward(toks).numpy()).max() < TOL


def test_chat_logprobs_match_reference(smollm2_path, smol_ref):
    """The chat session's reported logprobs (ChatRequest.logprobs) are log-softmax of the model's
    logits at the position that sampled each token: pinned to the reference's logits over the
    prompt plus the sampled tokens (the f32 path's 2e-3 logit tolerance moves a logprob by at
    most twice that)."""
    from zen5.chat_types import ChatRequest, Message, SampledToken, TextDelta
    from zen5.session import ChatSession

    eng = Engine.load(smollm2_path, n_ctx=512, matmul="f32")
    session = ChatSession(eng)
    events = list(session.chat(ChatRequest((Message.text("user", "Name a colour."),), max_tokens=10, logprobs=4)))
    sampled = [e for e in events if isinstance(e, SampledToken)]
    assert "".join(e.token for e in sampled) == "".join(e.text for e in events if isinstance(e, TextDelta))
    toks = list(eng.tokens)
    n = len(sampled)
    with torch.no_grad():
        ref = torch.log_softmax(smol_ref.forward(toks).double(), dim=-1).numpy()
    rows = ref[len(toks) - n - 1: len(toks) - 1]     # the positions that produced the sampled tokens
    for tok_id, row, e in zip(toks[-n:], rows, sampled):
        assert eng.tokenizer.decode([tok_id]) == e.token
        assert abs(row[tok_id] - e.logprob) < 4e-3
        # the sorted top values agree even where near-ties swap two tokens; the tokens are among
        # the reference's best six
        best = np.argsort(-row)
        assert np.abs(row[best[:4]] - [v for _, _, v in e.top]).max() < 4e-3
        assert {t for t, _, _ in e.top} <= {eng.tokenizer.decode([int(i)]) for i in best[:6]}


@pytest.mark.parametrize("isa", ISAS)
def test_q8_attention_kernels_match_the_reference_algorithm(isa):
    """torch_ref.q8_attention (the whole q8_0 attention, written plainly) against the engine's
    two kernels composed as the decoder does: per 512-position split the scores, their
    unnormalized softmax, the weighted values; then the splits merged."""
    from torch_ref import q8_attention, q8_split
    rng = np.random.default_rng(3)
    n, hd, split = 600, 64, 512
    q, k, v = (torch.tensor(rng.standard_normal((1, n, hd)) * 2, dtype=torch.float32) for _ in range(3))
    ref = q8_attention(q, k, v)[0].numpy()
    (ki, kd), (vi, vd) = q8_split(k[0]), q8_split(v[0])
    k8, v8 = ki.numpy().astype(np.int8), vi.numpy().astype(np.int8)
    ks, vs = kd[:, 0].numpy(), vd[:, 0].numpy()
    for t in (0, 5, 255, 256, 300, 511, 512, 599):
        parts = []
        for c0 in range(0, t + 1, split):
            c1 = min(c0 + split, t + 1)
            sc = testing.kernel_attn_scores_q8(isa, q[0, t].numpy(), k8[c0:c1].copy(), ks[c0:c1].copy(), hd,
                                               1 / np.sqrt(hd))
            e = np.exp(sc - sc.max()).astype(np.float32)
            values = testing.kernel_attn_values_q8(isa, e, v8[c0:c1].copy(), vs[c0:c1].copy(), hd)
            parts.append((sc.max(), e.sum(), values))
        top = max(m for m, _, _ in parts)
        out = sum(np.exp(m - top) * o for m, _, o in parts) / sum(np.exp(m - top) * z for m, z, _ in parts)
        assert np.allclose(out, ref[t], atol=1e-5, rtol=1e-5), (t, np.abs(out - ref[t]).max())


@pytest.mark.parametrize("isa", ISAS)
def test_smollm2_q8_cache_matches_the_quantized_reference(smollm2_path, isa):
    cfg, tensors = load_for_reference(smollm2_path)
    ref8, ref = TorchRef(cfg, tensors, kv_type="q8_0"), TorchRef(cfg, tensors)
    eng = Engine.load(smollm2_path, n_ctx=512, isa=isa, matmul="f32", kv_type="q8_0")
    ours_to_q8, q8_to_f32 = [], []
    for prompt in PROMPTS:
        toks = eng.tokenizer.encode(prompt)
        eng.reset()
        ours = eng.native_ctx.eval(toks, all_logits=True)
        with torch.no_grad():
            r8, r = ref8.forward(toks).numpy(), ref.forward(toks).numpy()
        diff = np.abs(ours - r8)
        assert diff.mean() < 0.15 and diff.max() < 1.5, f"{isa}: mean {diff.mean():.3g}, max {diff.max():.3g}"
        top2 = np.sort(r8, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1.0
        assert (ours.argmax(1) == r8.argmax(1))[clear].all()
        ours_to_q8.append(diff.mean())
        q8_to_f32.append(np.abs(r - r8).mean())
    print(f"SmolLM2 q8_0 cache {isa}: mean |diff| {np.mean(ours_to_q8):.3g} to the q8_0 reference, "
          f"which is {np.mean(q8_to_f32):.3g} from the f32 reference")
