"""The in-process engine: a loaded model, its tokenizer and one native context (KV cache).

`Engine.generate` tokenizes a prompt, keeps whatever prefix of it the context already holds
(rewinding to the common token prefix; the session layer adds the richer cache ladder), prefills
the rest, then samples token by token with stop strings, EOS, the token limit and the context
limit as finish conditions; prompt-lookup guesses (lookup.py) are evaluated alongside,
which changes the speed, never the tokens. Text streams out through an incremental detokenizer
so a multi-byte character split across tokens never leaks half-formed.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from zen5 import _native, cpu_topology, memory, overrides, weight_cache
from zen5.config import SUPPORTED_TYPES, ModelConfig
from zen5.deepseek_v4_config import DeepSeekV4Config
from zen5.loader import LoadedWeights, load_weights
from zen5.lookup import MAX_DRAFT, DraftFeed
from zen5.registry import resolve_model
from zen5.sampling import Sampler, SamplingParams, TokenLogprob
from zen5.stop_strings import find_stop, partial_stop_len
from zen5.tokenizer import StreamDecoder, Tokenizer

DEFAULT_MAX_CTX = 16384  # default context cap: the fp32 KV cache grows linearly with it


def default_threads() -> int:
    """The physical cores of one NUMA node that this process may run on (cpu_topology.py)."""
    return cpu_topology.default_threads()


@dataclass
class GenerationUsage:
    """The counts and timings of one `generate` call (the chat layer reports its own,
    chat_types.Usage)."""
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int        # prompt tokens already in the KV cache
    prefill_seconds: float
    decode_seconds: float
    guessed_tokens: int = 0   # prompt-lookup guesses evaluated (lookup.py)
    kept_tokens: int = 0      # of them, tokens the sampler picked

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.completion_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class Chunk:
    """One streamed piece: new text, the token that produced it, and on the last chunk the
    finish reason ("stop" or "length") and usage."""
    text: str
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    usage: GenerationUsage | None = None


@dataclass
class Generation:
    text: str
    finish_reason: str
    usage: GenerationUsage
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens


class Engine:
    def __init__(self, weights: LoadedWeights, threads: int | None = None, n_ctx: int | None = None,
                 isa: str | None = None, matmul: str | None = None, kv_type: str | None = None,
                 lookup: int | None = None, qat: bool | None = None, weight_cache: str | None = None):
        cfg = weights.config
        self.weights = weights
        self.config: ModelConfig | DeepSeekV4Config = cfg
        self.tokenizer: Tokenizer = weights.tokenizer
        self.threads = int(threads or default_threads())
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.n_ctx = int(n_ctx or min(cfg.n_ctx_train, DEFAULT_MAX_CTX))
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        # isa: a tier name ("ref", "avx2", "avx2vnni", "avx512", "amx") forces a kernel table for this
        # context (tests run each); None uses the one chosen at import (CPUID, or ZEN5_FORCE_ISA).
        self.qat: bool | None = None
        # weight_cache: the directory of packed-weight arenas ("off": none; weight_cache.py)
        self._weight_cache = weight_cache
        if isinstance(cfg, DeepSeekV4Config):
            self._init_deepseek_v4(weights, isa, matmul, kv_type, qat)
        else:
            self._init_llama(weights, isa, matmul, kv_type)
        self.kv_type: str = self.native_ctx.kv_type
        # lookup: guesses per decode batch for prompt-lookup speculative decoding
        # (lookup.py; 0 turns it off). It never changes a reply, only its speed.
        raw = (overrides.get("ZEN5_LOOKUP") or MAX_DRAFT) if lookup is None else lookup
        try:
            self.lookup = int(raw)
        except ValueError:
            self.lookup = -1
        if self.lookup < 0:
            raise ValueError(f"lookup (ZEN5_LOOKUP) must be an integer >= 0, got {raw!r}")
        self.isa: str = self.native_ctx.isa
        self._tokens: list[int] = []  # exactly the tokens whose K/V rows the context holds
        self.state_id = 0              # bumped on every change of the cache (staleness checks)
        self._watch: Callable[[int, int], None] | None = None

    def _init_llama(self, weights, isa, matmul, kv_type):
        # matmul: "int8" (default; quantized weights times int8-quantized activations, as
        # llama.cpp does) or "f32" (dequantize to fp32: the exact path the PyTorch oracle pins).
        self.matmul = matmul or overrides.get("ZEN5_MATMUL") or "int8"
        # kv_type: how the cache stores K/V: "f16" (the int8 path's default), "f32" (the f32
        # path's) or "q8_0" (int8 with a scale per position and head: half of f16's bytes, so
        # long contexts take half the memory and decode deep in them reads half the cache).
        kv = kv_type or overrides.get("ZEN5_KV_TYPE") or ("f16" if self.matmul == "int8" else "f32")
        # Refuse what does not fit before the arena and the cache are allocated (memory.py).
        memory.check_fits(memory.llama_weight_bytes(weights),
                          _native.kv_cache_bytes(self.config.to_native(), self.n_ctx, kv), self.n_ctx, kv,
                          weights.metadata.get("path"))
        tensors = [(t.name, t.ggml_type, list(t.shape), t.data) for t in weights.tensors.values()]
        self.native = self._build(_native.Model, memory.llama_weight_bytes(weights), self.config.to_native(),
                                  tensors, self.config.rope_inv_freq(), self.threads)
        self.native_ctx = _native.Context(self.native, self.n_ctx, isa or "", self.matmul, kv)

    def _init_deepseek_v4(self, weights, isa, matmul, kv_type, qat):
        """DeepSeek V4: float weights (BF16/F32) in f32 math; the state (raw window, compressed and
        indexer rows, compressor inputs) is f32. qat: the official model's FP8/FP4/Hadamard
        simulations (default on; ZEN5_QAT_SIM=0 or qat=False turns them off, which is what
        transformers computes)."""
        if matmul not in (None, "f32") or kv_type not in (None, "f32"):
            raise ValueError("DeepSeek V4 runs f32 matmuls over an f32 state (matmul='f32', kv_type='f32')")
        if qat is None:
            raw = overrides.get("ZEN5_QAT_SIM") or "1"
            if raw not in ("0", "1"):
                raise ValueError(f"ZEN5_QAT_SIM must be 0 or 1, got {raw!r}")
            qat = raw == "1"
        self.qat, self.matmul = bool(qat), "f32"
        main, compress = self.config.rope_tables()
        tensors = weights.native_tensors()
        # the arena: every matrix but the embedding and the routed experts, float ones in panels,
        # FP8 / MXFP4 repacked (an MXFP4 tensor holds two columns per byte); the routed experts are
        # packed on first use (V4Model::prepare_experts), and counted here so a model whose experts
        # cannot all be packed is refused now, not when a token is routed to one too many
        sizes = {name: _native.owned_matrix_bytes(_native.dtype_id(d), shape[0], shape[1] * (2 if d == "MXFP4" else 1))
                 for name, d, shape, _ in tensors
                 if len(shape) == 2 and d in ("F32", "F16", "BF16", "F8_E4M3", "MXFP4") and name != "embed.weight"}
        experts = sum(n for name, n in sizes.items() if ".ffn.experts." in name)
        arena = sum(sizes.values()) - experts
        memory.check_fits(arena + experts, 0, self.n_ctx, "f32", weights.metadata.get("path"))
        self.native = self._build(_native.DeepSeekV4Model, arena, self.config.to_native(), tensors, main, compress,
                                  self.threads)
        self.native_ctx = _native.DeepSeekV4Context(self.native, self.n_ctx, isa or "", self.qat)

    def _build(self, native_model, arena_bytes: int, *args):
        """The native model, its arena mapped from the weight cache when one matches, else packed
        (by every core of the default thread count, even when `threads` is fewer: a load-time
        burst, model.h pack_and_hash) and written there (weight_cache.py)."""
        plan = weight_cache.plan(self.weights.metadata.get("path"), arena_bytes, self._weight_cache)
        model = native_model(*args, cache_path=plan.path, cache_key=plan.key, cache_write=plan.write,
                             load_threads=default_threads())
        # the file is written in the background (arena_cache.h): "writing", or already "written"
        status = model.weight_cache["status"]
        if status in ("writing", "written"):
            weight_cache.prune(plan.path)
        if status == "writing":
            weight_cache.finish_at_exit(model)
        return model

    @property
    def weight_cache(self) -> dict:
        """How the weights were loaded: status "off" | "hit" (mapped from the cache file) |
        "writing" (packed; the cache file is being written in the background) | "written" |
        "not written: <why>"; miss: why an existing cache file was not used; promoted: whether a
        mapped arena has moved onto huge pages yet."""
        return dict(self.native.weight_cache)

    @classmethod
    def load(cls, name_or_path: str = "smollm2", threads: int | None = None, n_ctx: int | None = None,
             isa: str | None = None, matmul: str | None = None, kv_type: str | None = None,
             lookup: int | None = None, qat: bool | None = None, weight_cache: str | None = None):
        return cls(load_weights(resolve_model(name_or_path)), threads=threads, n_ctx=n_ctx, isa=isa,
                   matmul=matmul, kv_type=kv_type, lookup=lookup, qat=qat, weight_cache=weight_cache)

    @property
    def cache_id(self) -> str:
        """Names what a KV snapshot depends on: the model fingerprint, plus the matmul path and
        KV type where they differ from the defaults (int8, f16), so the server keeps checkpoints
        of different layouts in different directories."""
        fp = f"{self.native.fingerprint:016x}"
        if self.qat is not None:  # DeepSeek V4 state: its own kind, with or without the QAT rounding
            return f"{fp}-dsv4" + ("" if self.qat else "-noqat")
        return fp if (self.matmul, self.kv_type) == ("int8", "f16") else f"{fp}-{self.matmul}-{self.kv_type}"

    # ---- prompts -------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.weights.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's own (Jinja) chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass raw text")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ValueError(f"chat template error: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        tok = self.tokenizer
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
            eos_token="")

    # ---- the KV cache --------------------------------------------------------------------
    def _sync(self, tokens: list[int]) -> int:
        """Make the context hold `tokens` with valid logits for the last one. Returns how many
        tokens were reused from the cache (the longest common prefix, at most len - 1 so the
        last token is always evaluated and its logits are fresh)."""
        if len(tokens) > self.n_ctx:
            raise _native.ContextOverflow(
                f"prompt of {len(tokens)} tokens exceeds the context of {self.n_ctx} tokens")
        keep = 0
        limit = min(len(self._tokens), len(tokens) - 1)
        while keep < limit and self._tokens[keep] == tokens[keep]:
            keep += 1
        self.rewind(keep)
        self.append(tokens[keep:])
        return keep

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens the KV cache holds, in order."""
        return tuple(self._tokens)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def rewind(self, n: int, last_logits=None) -> None:
        """Keep only the first n cached tokens. `last_logits`, a row of an `append(...,
        all_logits=True)` batch, makes the logits of token n - 1 current again."""
        self.native_ctx.rewind(n, last_logits)
        if n != len(self._tokens):
            del self._tokens[n:]
            self.state_id += 1

    def append(self, tokens: list[int], all_logits: bool = False):
        """Evaluate tokens after the cached ones (prefill or decode); logits are then fresh.
        With all_logits, returns the (len(tokens), vocab) logits, row i those after token i."""
        if not tokens:
            return None
        if len(self._tokens) + len(tokens) > self.n_ctx:
            raise _native.ContextOverflow(
                f"{len(self._tokens)} cached + {len(tokens)} new tokens exceed the context of "
                f"{self.n_ctx} tokens")
        watch, n = self._watch, len(tokens)
        if watch is None:
            return self._eval(tokens, all_logits)
        step = n if all_logits else self.WATCH_CHUNK   # every row's logits come from one batch
        for i in range(0, n, step):
            watch(i, n)
            rows = self._eval(tokens[i:i + step], all_logits)
        watch(n, n)
        return rows

    def _eval(self, tokens: list[int], all_logits: bool):
        self.state_id += 1
        try:
            rows = self.native_ctx.eval(tokens, all_logits)
        except BaseException:
            # A failed eval may have written part of a chunk: trust only what was there before.
            self.native_ctx.rewind(min(self.native_ctx.n_past, len(self._tokens)))
            raise
        self._tokens.extend(tokens)
        return rows

    # A watched prefill runs in chunks of this many tokens, so a watcher sees it at least that
    # often (the KV cache makes chunked prefill bit-identical to one batch).
    WATCH_CHUNK = 256

    @contextlib.contextmanager
    def watch(self, check: Callable[[int, int], None]):
        """Inside, `check(done, total)` is called before every native evaluation that `append`
        makes (each decode step, each WATCH_CHUNK tokens of a long prefill) and once after the
        last one (done == total). It may raise to stop the work: the cache then holds exactly
        the tokens evaluated so far. The server uses it to stop a request whose client left
        and to log the progress of long prefills."""
        outer, self._watch = self._watch, check
        try:
            yield
        finally:
            self._watch = outer

    def snapshot(self) -> bytes:
        """The native snapshot of the cache (KV rows of every cached token + the last logits)."""
        return self.native_ctx.snapshot()

    def restore(self, tokens, blob: bytes) -> None:
        """Replace the cache with a snapshot of exactly `tokens` (a disk checkpoint). The native
        restore validates the whole blob before touching the cache, so on any error (BadSnapshot,
        ModelMismatch, ContextOverflow) the current state is intact."""
        tokens = [int(t) for t in tokens]
        if len(tokens) > self.n_ctx:
            raise _native.ContextOverflow(
                f"a snapshot of {len(tokens)} tokens exceeds the context of {self.n_ctx} tokens")
        if any(t < 0 or t >= self.config.vocab_size for t in tokens):
            raise _native.BadSnapshot("snapshot token ids outside the vocabulary")
        self.native_ctx.restore(blob)
        self.state_id += 1
        self._tokens = tokens
        if self.native_ctx.n_past != len(tokens):
            self.reset()
            raise _native.BadSnapshot(f"snapshot holds {self.native_ctx.n_past} positions, not the "
                                      f"{len(tokens)} tokens stored with it")

    def reset(self) -> None:
        self.native_ctx.rewind(0)
        self._tokens.clear()
        self.state_id += 1

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_tokens: int = 128, stream: bool = False,
                 stop: list[str] | str | None = None, **sampling) -> Generation | Iterator[Chunk]:
        """Generate from `prompt` (text or token ids). Sampling keywords: temperature, top_k,
        top_p, min_p, seed, logprobs (see SamplingParams). With stream=True, returns an iterator
        of Chunks whose last one carries finish_reason and usage."""
        params = SamplingParams(**sampling)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        it = self._stream(ids, max_tokens, params, stops)
        return it if stream else self._collect(it)

    @staticmethod
    def _collect(chunks: Iterator[Chunk]) -> Generation:
        text, ids, lps, last = [], [], [], None
        for c in chunks:
            text.append(c.text)
            if c.token_id is not None:
                ids.append(c.token_id)
            if c.logprob is not None:
                lps.append(c.logprob)
            last = c
        return Generation("".join(text), last.finish_reason, last.usage, ids, lps or None)

    def _stream(self, ids: list[int], max_tokens: int, params: SamplingParams,
                stops: list[str]) -> Iterator[Chunk]:
        t0 = time.perf_counter()
        reused = self._sync(ids)
        t1 = time.perf_counter()
        sampler, decoder = Sampler(params), StreamDecoder(self.tokenizer)
        eos = self.tokenizer.eos_ids
        held = ""  # decoded text not yet emitted: it may be the start of a stop string
        n_out, finish, stopped_on_text = 0, "length", False
        feed = DraftFeed(self, max_draft=self.lookup)
        try:
            while n_out < max_tokens:
                logits = feed.logits()
                tok = sampler.sample(logits)
                lp = sampler.logprob(logits, tok) if params.logprobs else None
                n_out += 1
                if tok in eos:
                    finish = "stop"
                    break
                held += decoder.push(tok)
                cut = find_stop(held, stops)
                if cut is not None:
                    held, finish, stopped_on_text = held[:cut], "stop", True
                    break
                safe = len(held) - partial_stop_len(held, stops)
                yield Chunk(held[:safe], tok, lp)
                held = held[safe:]
                if feed.n_tokens >= self.n_ctx:
                    break  # context full: finish_reason stays "length"
                feed.push(tok)
        finally:
            feed.close()  # the cache ends at the reply, whatever ended it (a closed stream too)
        if not stopped_on_text:
            held += decoder.flush()
        t2 = time.perf_counter()
        usage = GenerationUsage(len(ids), n_out, reused, t1 - t0, t2 - t1, feed.stats.drafted, feed.stats.accepted)
        yield Chunk(held, None, None, finish, usage)

    # ---- description ---------------------------------------------------------------------
    def info(self) -> dict:
        cfg = self.config
        types = sorted({SUPPORTED_TYPES.get(t.ggml_type, "I32") for t in self.weights.tensors.values()})
        return {
            "path": self.weights.metadata.get("path"),
            "format": self.weights.metadata.get("format"),
            "architecture": cfg.arch,
            "parameters": int(self.native.n_params),
            "weight_types": types,
            "context_length": cfg.n_ctx_train,
            "context": self.n_ctx,
            "vocab_size": cfg.vocab_size,
            "layers": cfg.n_layer,
            "hidden": cfg.n_embd,
            "heads": cfg.n_head,
            "kv_heads": cfg.n_head_kv,
            "tied_output": cfg.tied_output,
            "chat_template": bool(self.chat_template),
            "fingerprint": f"{self.native.fingerprint:016x}",
            "isa": self.isa,
            "matmul": self.matmul,
            "kv_type": self.kv_type,
            "lookup": self.lookup,
            **({"qat_sim": self.qat} if self.qat is not None else {}),
            "kv_bytes_per_token": int(self.native_ctx.kv_bytes_per_token),
            # the weight arena (what the matmuls read; the file's pages are released) and the
            # KV cache: reserved for the whole context, resident only for the positions used
            "weight_bytes": int(self.native.weight_bytes),
            # DeepSeek V4's routed experts, outside the arena: packed on first use
            **({"expert_bytes_packed": int(self.native.expert_bytes_packed),
                "expert_bytes_total": int(self.native.expert_bytes_total)}
               if hasattr(self.native, "expert_bytes_total") else {}),
            "weight_cache": self.weight_cache["status"],
            **({"kv_bytes_reserved": int(self.native_ctx.kv_bytes_reserved),
                "kv_bytes_resident": int(self.native_ctx.kv_bytes_resident)}
               if hasattr(self.native_ctx, "kv_bytes_reserved") else {}),
            "threads": self.threads,
        }
