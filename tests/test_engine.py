"""The in-process API and the CLI on the default model: generate/stream, seeds, stop strings,
logprobs, prefix reuse between calls, and the command-line front doors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import zen5
from tiers import TIERS

pytestmark = pytest.mark.model
CHAT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


def test_generate_returns_text_reason_and_counts(smollm2):
    out = smollm2.generate(CHAT, max_tokens=12, temperature=0)
    assert out.finish_reason in ("stop", "length")
    assert out.prompt_tokens == len(smollm2.tokenizer.encode(CHAT))
    assert out.completion_tokens == len(out.token_ids) == 12
    assert out.text == smollm2.tokenizer.decode(out.token_ids)
    assert out.usage.prefill_tps > 0 and out.usage.decode_tps > 0


def test_stream_equals_non_stream(smollm2):
    full = smollm2.generate(CHAT, max_tokens=20, temperature=0.9, seed=3)
    chunks = list(smollm2.generate(CHAT, max_tokens=20, temperature=0.9, seed=3, stream=True))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == full.finish_reason and chunks[-1].usage is not None
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_seed_reproducible(smollm2):
    a = smollm2.generate(CHAT, max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    b = smollm2.generate(CHAT, max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    c = smollm2.generate(CHAT, max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_truncates_and_is_not_streamed(smollm2):
    free = smollm2.generate(CHAT, max_tokens=40, temperature=0)
    words = free.text.split()
    assert len(words) > 3
    stop = words[2]
    out = smollm2.generate(CHAT, max_tokens=40, temperature=0, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    streamed = "".join(c.text for c in smollm2.generate(CHAT, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == out.text


def test_eos_finishes_with_stop(smollm2_path):
    from zen5.engine import Engine

    smollm2 = Engine.load(smollm2_path, n_ctx=512, matmul="f32")  # where this reply ends early
    out = smollm2.generate("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", max_tokens=200,
                           temperature=0)
    assert out.finish_reason == "stop" and out.completion_tokens < 200
    assert "<|im_end|>" not in out.text


def test_logprobs(smollm2):
    out = smollm2.generate(CHAT, max_tokens=5, temperature=0, logprobs=3)
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert len(lp.top) == 3


def test_prefix_reuse_between_calls(smollm2):
    smollm2.generate(CHAT, max_tokens=4, temperature=0)
    out = smollm2.generate(CHAT + "The sea", max_tokens=4, temperature=0)
    assert out.usage.reused_tokens >= len(smollm2.tokenizer.encode(CHAT)) - 1


def test_chat_template_renders_smollm2_format(smollm2):
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "zen5", *args], capture_output=True, text=True,
                          timeout=300, env=e)


def test_cli_generate_streams_reply():
    # the exact fp32 path: "Paris" wins there by a clear margin (on the int8 default path the
    # model's top two first tokens are 0.08 logits apart and may swap; see README)
    r = _cli("generate", "--model", "smollm2", "--max-tokens", "16", "--temperature", "0",
             "--prompt", "What is the capital of France?", env={"ZEN5_MATMUL": "f32"})
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr
    r = _cli("generate", "--model", "smollm2", "--max-tokens", "8", "--temperature", "0",
             "--prompt", "Hello")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


@pytest.mark.parametrize("force", [None, "ref"])
def test_cli_info_reports_isa(force):
    r = _cli("info", "--model", "smollm2", env={"ZEN5_FORCE_ISA": force} if force else None)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    expect = force or TIERS[-1]  # the best tier this machine supports
    assert info["isa"] == expect and info["model"]["isa"] == expect
    m = info["model"]
    assert (m["architecture"], m["vocab_size"], m["context_length"]) == ("llama", 49152, 8192)
    assert 130e6 < m["parameters"] < 140e6
    assert set(m["weight_types"]) == {"F32", "Q4_1", "Q8_0"}
    assert info["version"] == zen5.__version__


def test_cli_errors_are_clear(tmp_path):
    r = _cli("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x")
    assert r.returncode == 2 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr
    r = _cli("info", env={"ZEN5_FORCE_ISA": "bogus"})
    assert r.returncode != 0 and "ZEN5_FORCE_ISA=bogus" in r.stderr


def test_watch_sees_every_evaluation_chunks_long_prefill_and_can_stop_it(smollm2):
    """Engine.watch is how the server cancels a request and logs prefill progress: the watcher
    runs before every evaluation (a long prefill in WATCH_CHUNK pieces, with the same logits as
    one batch) and once after; raising stops the work with the cache holding what was done."""
    prompt = smollm2.tokenizer.encode(CHAT * 60)
    n = len(prompt)
    assert n > 2 * zen5.engine.Engine.WATCH_CHUNK
    smollm2.reset()
    smollm2.append(prompt)
    whole = smollm2.native_ctx.logits().copy()

    calls = []
    smollm2.reset()
    with smollm2.watch(lambda done, total: calls.append((done, total))):
        smollm2.append(prompt)
    chunk = zen5.engine.Engine.WATCH_CHUNK
    assert calls == [(i, n) for i in range(0, n, chunk)] + [(n, n)]
    assert (smollm2.native_ctx.logits() == whole).all()

    class Stop(Exception):
        pass

    def stop_at_second_chunk(done, total):
        if done >= chunk:
            raise Stop

    smollm2.reset()
    with pytest.raises(Stop), smollm2.watch(stop_at_second_chunk):
        smollm2.append(prompt)
    assert smollm2.tokens == tuple(prompt[:chunk]) and smollm2.native_ctx.n_past == chunk
    smollm2.append(prompt[chunk:])   # nothing lost: the rest continues from there
    assert (smollm2.native_ctx.logits() == whole).all()
    smollm2.reset()


def test_environment_is_read_in_one_place():
    """Settings are arguments; the ZEN5_* variables are documented overrides read only by
    zen5/overrides.py (the tier by the native module), and every one is in the README."""
    import pathlib
    import re

    from zen5 import overrides

    package = pathlib.Path(zen5.__file__).parent
    readers = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                     if re.search(r"os\.environ|getenv", p.read_text()))
    assert readers == ["overrides.py"], readers
    readme = (package.parents[1] / "README.md").read_text()
    assert [n for n in overrides.DOCUMENTED if n not in readme] == []
    with pytest.raises(KeyError):
        overrides.get("ZEN5_UNDOCUMENTED")
