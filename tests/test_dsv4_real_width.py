"""DeepSeek V4 Flash's real widths, few layers, in the official packed formats (issue 22).

The tiny checkpoints (tests/dsv4_checkpoint.py) are 256 wide; V4 Flash is hidden 4096 with 64
heads of 512, q rank 1024, 8 output groups of rank 1024, an indexer of 64 x 128 and experts of
width 2048. Offsets, block scales per 128 x 128 (32 x 8 blocks of one wq_b), 16-row groups and
thread splits only meet those sizes here. One layer of each kind (window-only and hash-routed,
ratio 4 with the indexer, ratio 128), 4 routed experts (2 per token) and a shared one, a 512-token
vocabulary; written at test time (about 700 M parameters), in the packed formats (FP8 dense
projections, MXFP4 experts; tests/dsv4_formats.py) and as the exactly dequantized BF16 twin.

Checked: the packed model against its twin (the formats at real widths: scale indexing, nibble
order, transposes) and the twin against transformers' DeepseekV4ForCausalLM (the model math at
real widths, QAT simulations off as transformers has none), over 160 tokens (past the 128-row
window, so the ratio-128 layer compresses and the indexer selects).
"""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_formats as fmt
from dsv4_checkpoint import load_oracle, make_checkpoint, oracle_logits
from zen5.engine import Engine
from zen5.loader.deepseek_v4 import load_deepseek_v4_dir

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REAL_WIDTHS = {
    "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "moe_intermediate_size": 2048, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1,
    "vocab_size": 512, "swiglu_limit": 10.0,
}
TOKENS = [int(t) for t in np.random.default_rng(11).integers(2, 512, 160)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dsv4real")
    plain = make_checkpoint(base / "plain", overrides=REAL_WIDTHS, shards=3)
    packed, twin = fmt.packed_twin(plain, base / "packed", base / "twin")
    for f in plain.glob("*.safetensors"):  # the twin holds what the oracle needs: 1.4 GB less on disk
        f.unlink()
    return packed, twin


def run(path):
    e = Engine(load_deepseek_v4_dir(path, require_tokenizer=False), threads=2, n_ctx=256, qat=False,
               weight_cache="off")
    return e, np.asarray(e.native_ctx.eval(TOKENS, True)).copy()


@pytest.fixture(scope="module")
def packed_logits(dirs):
    return run(dirs[0])


@pytest.fixture(scope="module")
def twin_logits(dirs):
    return run(dirs[1])


def test_real_width_packed_model_matches_its_twin(packed_logits, twin_logits):
    ep, lp = packed_logits
    et, lt = twin_logits
    # FP8 as Q8_0 (1.06 bytes) and MXFP4 (0.53) instead of BF16 (2): the weights about halve (the
    # arena, plus the routed experts packed on first use)
    pb, tb = (e.native.weight_bytes + e.native.expert_bytes_total for e in (ep, et))
    assert pb < 0.6 * tb, (pb, tb)
    err = np.abs(lp - lt).max(axis=1) / np.abs(lt).max(axis=1)
    corr = np.corrcoef(lp.ravel(), lt.ravel())[0, 1]
    agree = np.mean(lp.argmax(1) == lt.argmax(1))
    print(f"\nreal widths, packed vs twin: max |diff| / max |logit| per position median {np.median(err):.2e}, "
          f"max {err.max():.2e}; correlation {corr:.5f}; argmax equal at {agree:.1%}; weights "
          f"{pb / 1e6:.0f} MB vs {tb / 1e6:.0f} MB")
    assert np.median(err) < 0.05 and corr > 0.99 and agree > 0.85


def test_real_width_twin_matches_transformers(dirs, twin_logits):
    _, got = twin_logits
    want = oracle_logits(load_oracle(dirs[1]), TOKENS)
    diff = np.abs(got - want).max(axis=1)
    scale = np.maximum(1.0, np.abs(want).max(axis=1))
    agree = np.mean(got.argmax(1) == want.argmax(1))
    print(f"\nreal widths, engine (BF16 twin) vs transformers: max |diff| {diff.max():.2e}, "
          f"relative median {np.median(diff / scale):.2e}; argmax equal at {agree:.1%}")
    assert np.all(diff <= 1e-3 * scale), np.nonzero(diff > 1e-3 * scale)[0][:10]
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_real_width_decode_gives_the_prefill_bits(dirs, packed_logits):
    """Decode splits each token's 64 heads into groups, one task per thread, and gathers the
    token's rows in pieces across the threads (V4Context::attention); the 160-token prefill runs
    whole tokens. Token by token at 3 threads (groups of 22, 22 and 20 heads; the rows in 3
    pieces) must give the prefill's logits bit for bit, before and past the 128-row window and
    the indexer's top-8."""
    _, want = packed_logits
    e = Engine(load_deepseek_v4_dir(dirs[0], require_tokenizer=False), threads=3, n_ctx=256, qat=False,
               weight_cache="off")
    got = np.stack([np.asarray(e.native_ctx.eval([t], True))[-1] for t in TOKENS])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.nonzero((got != want).any(axis=1))[0][:10]
