"""The fixed benchmark workload: the text, the tests, the weight files, and zen5's runner.

Tests (same names as llama-bench's):
  ppN   prefill of the first N tokens of TEXT into an empty cache, timed as one eval call;
  tgN   N greedy tokens with EOS suppressed, after a 1-token prompt (llama-bench's tg runs from an
        empty cache too); each step reads the logits, takes the argmax, evaluates that token.
Warm-up, never recorded: pp64 then tg8 before each engine's block of tests, every repetition,
because the engines take turns and each evicts the others' weights from the cache.

The text is fixed: sentences drawn with a seeded generator, so every run, engine and frontier
walk sees exactly the same tokens (any 8k-token prose would do; it must not change).
"""
from __future__ import annotations

import functools
import importlib.util
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QUANTS = ("Q4_1", "Q8_0", "BF16")
WARMUP = ("pp64", "tg8")

_SENTENCES = (
    "The history of computing is a story of abstractions layered on top of one another.",
    "Each generation of engineers hides the details of the previous one behind a cleaner interface.",
    "A cache line holds sixty-four bytes, and a core that waits for memory does no useful work.",
    "The river bends twice before it reaches the old mill, where the water slows and turns green.",
    "She wrote the proof on the back of an envelope and checked every step the next morning.",
    "Compilers translate loops into vector instructions when they can prove the iterations independent.",
    "In the spring the orchard fills with bees, and the farmer counts the blossoms on each branch.",
    "A transformer reads the whole prompt at once but writes its answer one token at a time.",
    "The committee met on Tuesday to decide whether the bridge needed a second inspection.",
    "Bandwidth, not arithmetic, limits how fast a small model can generate text on a CPU.",
    "He kept a notebook of every bug he fixed, with the symptom, the cause and the test that caught it.",
    "The museum's new wing displays maps drawn by sailors who had never seen the coast they charted.",
    "Quantized weights trade a little precision for a large saving in the bytes read per token.",
    "Rain fell all night, and by morning the path to the lighthouse had turned to mud.",
    "A good benchmark states its workload, repeats its measurements and reports the spread.",
    "The library closes at nine, but the reading room upstairs stays open for students until midnight.",
)


def fixed_text(n_sentences: int = 1600, seed: int = 20261130) -> str:
    rng = random.Random(seed)
    paras = []
    for _ in range(n_sentences // 8):
        paras.append(" ".join(rng.choice(_SENTENCES) for _ in range(8)))
    return "\n\n".join(paras)


@functools.lru_cache(maxsize=None)
def model_path(quant: str) -> str:
    """The benchmark's GGUF for `quant`: the shipped Q4_1 file, or its conversion (made on first
    use by scripts/convert_gguf.py, idempotent)."""
    from zen5.registry import cache_dir, resolve_model

    src = resolve_model("smollm2")
    if quant == "Q4_1":
        return src
    spec = importlib.util.spec_from_file_location("convert_gguf", ROOT / "scripts" / "convert_gguf.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    dst = conv.output_path(Path(src), quant, cache_dir())
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        conv.convert(Path(src), dst, quant)
    return str(dst)


@dataclass(frozen=True)
class WeightStats:
    n_params: int          # every weight element (the tied embedding once)
    bytes_per_token: int   # weight bytes one decoded token reads: every tensor once, in its file type

    @property
    def ops_per_token(self) -> float:  # prefill matmul work, the notes' 2 x params convention
        return 2.0 * self.n_params


@functools.lru_cache(maxsize=None)
def weight_stats(path: str) -> WeightStats:
    import gguf

    r = gguf.GGUFReader(path)
    return WeightStats(sum(int(t.n_elements) for t in r.tensors), sum(int(t.n_bytes) for t in r.tensors))


def n_tokens(test: str) -> int:
    return int(test[2:])


def wait_promoted(eng) -> None:
    """Returns once a mapped weight cache has moved onto huge pages (a background thread of
    weight_cache.py does it after the load): every bench times the arena where it stays."""
    while not eng.weight_cache["promoted"]:
        time.sleep(0.01)


class Zen5Runner:
    """One zen5 Engine per (quant, threads), sharing each quant's loaded weights."""

    name = "zen5"

    def __init__(self, max_tokens: int, isa: str | None = None):
        self.max_tokens, self.isa = max_tokens, isa or None
        self.weights: dict[str, object] = {}
        self.engines: dict[tuple[str, int], object] = {}

    def engine(self, quant: str, threads: int):
        from zen5.engine import Engine
        from zen5.loader import load_weights

        key = (quant, threads)
        if key not in self.engines:
            if quant not in self.weights:
                self.weights[quant] = load_weights(model_path(quant))
            eng = Engine(self.weights[quant], threads=threads, n_ctx=self.max_tokens, isa=self.isa)
            wait_promoted(eng)
            self.engines[key] = eng
        return self.engines[key]

    def describe(self, quant: str, threads: int) -> tuple[str, str]:
        """(build, isa) columns."""
        eng = self.engine(quant, threads)
        return f"matmul={eng.matmul}", eng.isa

    def run(self, quant: str, threads: int, tokens: list[int], tests: list[str]) -> dict[str, float]:
        """Seconds per test, after the warm-up tests (not returned)."""
        eng = self.engine(quant, threads)
        eos = sorted(eng.tokenizer.eos_ids)
        out = {}
        for test in list(WARMUP) + list(tests):
            out[test] = time_test(eng.native_ctx, tokens, test, eos)
        return {t: out[t] for t in tests}


def time_test(native_ctx, tokens: list[int], test: str, eos: list[int]) -> float:
    """Seconds for one ppN / tgN test on a native context (see the module doc)."""
    n = n_tokens(test)
    native_ctx.rewind(0)
    if test.startswith("pp"):
        t0 = time.perf_counter()
        native_ctx.eval(tokens[:n])
        dt = time.perf_counter() - t0
    else:
        native_ctx.eval(tokens[:1])
        t0 = time.perf_counter()
        decode(native_ctx, n, eos)
        dt = time.perf_counter() - t0
    native_ctx.rewind(0)
    return dt


def decode(native_ctx, n: int, eos: list[int]) -> None:
    """n greedy steps with EOS suppressed."""
    for _ in range(n):
        logits = native_ctx.logits()
        logits[eos] = -math.inf
        native_ctx.eval([int(np.argmax(logits))])
