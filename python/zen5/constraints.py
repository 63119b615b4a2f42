"""Constrained decoding: forced tool calls, forbidden calls, JSON outputs, custom-tool grammars.

Why this module exists: a client that sets `tool_choice: "required"` or a `json_schema` response
format must get output that parses and validates, from any model at any temperature. Asking
nicely in the prompt is not enough for a 135M model at temperature 1, so each request that
demands structure gets a grammar, and every sampling step masks the logits to the tokens the
grammar allows (llguidance: a Rust Earley parser with a token-trie lexer; JSON Schema and Lark).

How a request becomes a grammar:

* `demand_of(request)` reads the neutral fields (tool_choice, parallel_tool_calls,
  response_format, tools' kind/strict/grammar, thinking_budget) into a `Demand`, or None when the
  request is unconstrained (the common case: no cost at all).
* The session's dialect writes one Lark grammar for it in its own output syntax, byte for byte
  what its parser reads (`Dialect.grammar`: dialects/chatml_grammar.py,
  dialects/deepseek_v4_grammar.py), from the building blocks and schema narrowing in grammar.py.
  This module knows no dialect.

`TokenConstraint` is the per-request runtime: the mask for the next token, advanced by each
sampled token. The mask for step n+1 is computed right after token n is sampled, while the
engine evaluates token n (llguidance releases the GIL), so decode does not wait for it.
"""
from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from zen5.chat_types import ChatRequest, ToolSpec
from zen5.grammar import ConstraintError, Demand

__all__ = ["ConstraintError", "Demand", "TokenConstraint", "demand_of", "llg_tokenizer"]


# ---- what a request demands ------------------------------------------------------------------
def demand_of(request: ChatRequest) -> Demand | None:
    """The request's structural demands, or None when it needs no constraint (tool_choice auto
    with parallel calls allowed and no custom or strict tools, no response_format, no thinking
    budget)."""
    calls, tools = _calls_of(request.tool_choice, tuple(request.tools))
    answer, strict = _answer_schema(request.response_format)
    budget = request.thinking_budget
    single = bool(tools) and not request.parallel_tool_calls   # "at most one call" under auto too
    if calls == "auto" and not any(t.kind == "custom" or t.strict for t in tools) \
            and not single and answer is None and budget is None:
        return None
    if calls == "auto" and not tools:
        calls = "none"
    return Demand(calls, tools, request.parallel_tool_calls, answer, strict, budget)


def _calls_of(choice, tools: tuple[ToolSpec, ...]) -> tuple[str, tuple[ToolSpec, ...]]:
    """("none" | "auto" | "forced", the tools a call may name) for a neutral tool_choice."""
    if isinstance(choice, dict):
        picked = tuple(t for t in tools if t.name == choice.get("name"))
        if not picked:
            raise ConstraintError(f"tool_choice names {choice.get('name')!r}, which is not among "
                                  "the tools")
        return "forced", picked
    if choice == "required":
        if not tools:
            raise ConstraintError('tool_choice "required" needs at least one tool')
        return "forced", tools
    if choice in ("auto", "none"):
        return choice, tools
    raise ConstraintError(f'tool_choice must be "auto", "none", "required" or {{"name": ...}}, '
                          f"got {choice!r}")


def _answer_schema(fmt: dict | None) -> tuple[dict | None, bool]:
    """(JSON schema the answer must follow, strict) for a response_format."""
    if fmt is None or fmt.get("type") == "text":
        return None, True
    if fmt.get("type") == "json_object":
        return {"type": "object"}, True
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError("response_format json_schema needs a schema object")
        if fmt.get("strict"):
            return schema, True
        # not strict: the schema is guidance for the model; the output is still valid JSON
        kind = schema.get("type")
        return ({"type": kind} if isinstance(kind, str) else {}), False
    raise ConstraintError(f"response_format type must be text, json_object or json_schema, "
                          f"got {fmt.get('type')!r}")


# ---- runtime ---------------------------------------------------------------------------------
_LLG_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zen5-mask")
BACKGROUND_MASK = True   # compute the next mask while the engine evaluates (bench: --sync)


def llg_tokenizer(tokenizer):
    """llguidance's view of a zen5 Tokenizer (its token trie), built once per tokenizer (about a
    second for a 129k vocabulary). EOS: every id that ends generation."""
    cached = _LLG_TOKENIZERS.get(tokenizer)
    if cached is None:
        import llguidance
        eos = sorted(tokenizer.eos_ids)
        cached = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                        eos_token=eos or None)
        _LLG_TOKENIZERS[tokenizer] = cached
    return cached


class TokenConstraint:
    """One request's matcher: `mask(logits)` before sampling, `advance(token)` after it. The
    next mask is computed in the background from `advance` on (see the module docstring)."""

    def __init__(self, tokenizer, grammar: str, background: bool | None = None):
        import llguidance
        self._llg = llg_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self._llg, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"cannot constrain this request: {self.matcher.get_error()}")
        self.n_vocab = self._llg.vocab_size
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._background = BACKGROUND_MASK if background is None else background
        self._pending: Future | None = None
        self._start_mask()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        self._wait()
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab,
                                bitorder="little").view(bool)
        if not allowed.any():  # the matcher failed: advance() reports it and drops the constraint
            return logits
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(self.n_vocab, logits.shape[-1])
        np.copyto(out[:n], logits[:n], where=allowed[:n])
        return out

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False (the matcher is then in an error state) if the grammar
        did not allow it. Starts computing the next mask."""
        self._wait()
        ok = self.matcher.consume_token(int(token))
        if ok:
            self._start_mask()  # once the grammar is complete, the mask is the EOS alone
        return ok

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def _start_mask(self) -> None:
        if self._background:
            # the task holds the buffer: a request dropped mid-computation must not free it
            self._pending = _POOL.submit(_fill_mask, self.matcher, self._bits)
        else:
            _fill_mask(self.matcher, self._bits)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def _fill_mask(matcher, bits: np.ndarray) -> None:
    """The matcher's next-token mask written into `bits` (llguidance releases the GIL)."""
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
