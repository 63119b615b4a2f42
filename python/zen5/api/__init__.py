"""Wire protocols: each module translates one API's JSON to the neutral chat types and the
neutral events back to that API's JSON and SSE. Nothing else happens here: ID binding, signatures
and the cache ladder live in the session, so every front door behaves the same, and no protocol
module builds on another (one that did would lose what only its own wire can say).

Each chat adapter (`anthropic`, `openai_chat`, `openai_responses`) provides the same small
surface, which `zen5.server` drives:
    STYLE                          "anthropic" | "openai": the error shape its clients read
    parse(body, api_ctx) -> Turn   validate; Turn has .stream, .model, .request and .start(session)
    body(turn, reply, api_ctx)     the non-streaming response object
    Stream(turn, api_ctx)          .start() / .event(ev) / .keepalive() / .error(err) -> SSE text
    remember(turn, reply, api_ctx) keep protocol state (stored responses, threads) after success
`api_ctx` is the ApiContext below (its `n_ctx` is the context length in tokens).
`openai_completions` is the same surface over the engine's raw text generation.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from zen5.api.conversations import ConversationStore, ReasoningMemory
from zen5.api.errors import bad_request
from zen5.sampling_params import SamplingParams


@dataclass
class ApiContext:
    """What adapters may know about the server: the served model and the protocol-state stores."""
    model: str
    n_ctx: int
    max_output: int | None = None      # server-side cap on tokens generated per request
    max_token_bytes: int | None = None  # Tokenizer.max_token_bytes: bounds a prompt before tokenizing
    conversations: ConversationStore = field(default_factory=ConversationStore)
    reasoning: ReasoningMemory = field(default_factory=ReasoningMemory)

    def max_tokens(self, requested: int | None) -> int:
        """The generation limit for a request: what it asked for (default: the whole context),
        capped by the context and by --max-output."""
        n = min(requested or self.n_ctx, self.n_ctx)
        if self.max_output:
            n = min(n, self.max_output)
        return max(1, n)


    def check_prompt_bytes(self, nbytes: int, param: str) -> None:
        """Refuse a prompt whose text alone cannot fit the context, before anyone tokenizes it:
        B bytes are at least B / max_token_bytes tokens. (Tokenizing megabytes takes seconds of
        worker time and memory for a request that is refused anyway.)"""
        if self.max_token_bytes is None:
            return
        limit = self.n_ctx * self.max_token_bytes
        if nbytes > limit:
            raise bad_request(f"{param}: the prompt's text is {nbytes} bytes, more than the context of "
                              f"{self.n_ctx} tokens can hold (at most {limit} bytes: {self.max_token_bytes} "
                              "bytes per token at best); shorten it", param=param)


def new_id(prefix: str, nbytes: int = 12) -> str:
    return prefix + secrets.token_hex(nbytes)


# Unicode line breaks that a client splitting with str.splitlines() (requests' iter_lines with
# decode_unicode=True does) would cut a data line at; they only occur inside JSON strings, where
# an escape is equivalent. (JSON already escapes the C0 separators \x1c-\x1e.)
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event. Anthropic and Responses streams name each event; Chat Completions
    streams send bare `data:` lines. Non-ASCII text is sent as is, except Unicode line breaks."""
    line = "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS) + "\n\n"
    return f"event: {event}\n{line}" if event else line


SSE_COMMENT = ": keep-alive\n\n"   # ignored by every SSE parser; keeps proxies and clients waiting


def sampling(temperature: float | None, top_p: float | None = None, top_k: int | None = None,
             seed: int | None = None) -> SamplingParams:
    """Sampling settings from a request. No temperature means greedy (the neutral default: tool
    loops on small models are most reliable that way); top_p 0 also means greedy. Any integer
    seed is accepted (OpenAI's are signed 64-bit); it is folded to the unsigned range."""
    if seed is not None:
        seed &= (1 << 64) - 1
    if temperature is None or temperature == 0 or top_p == 0:
        return SamplingParams(temperature=0.0, seed=seed)
    kw = {"temperature": temperature, "seed": seed}
    if top_p is not None:
        kw["top_p"] = top_p
    if top_k is not None:
        kw["top_k"] = top_k
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad_request(str(e)) from None


def logprob_entries(sampled) -> list[dict]:
    """OpenAI's per-token logprob objects (Chat `logprobs.content`, Responses `output_text.logprobs`)
    from SampledToken events: token, logprob, bytes, and the alternatives, best first."""
    entry = lambda token, raw, lp: {"token": token, "logprob": lp, "bytes": list(raw)}  # noqa: E731
    return [{**entry(t.token, t.raw, t.logprob), "top_logprobs": [entry(*alt) for alt in t.top]} for t in sampled]
