"""Neutral chat request and event types: the one shape every front door maps into.

Protocol adapters (OpenAI chat, Responses, Anthropic Messages, the in-process API) translate wire
JSON into a `ChatRequest` and `ChatEvent`s back into wire JSON; everything between (rendering,
the cache ladder, tool IDs, signatures) sees only these types, so every front door behaves the
same.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator, Literal, Union

from zen5.sampling_params import SamplingParams

# A custom tool's free-form input travels as this one string argument (see ToolSpec).
CUSTOM_INPUT = "input"


# ---- message content blocks ----------------------------------------------------------------
@dataclass(frozen=True)
class TextBlock:
    text: str


@dataclass(frozen=True)
class ThinkingBlock:
    text: str
    signature: str | None = None      # ours, from a previous response; verified on replay


@dataclass(frozen=True)
class RedactedThinkingBlock:
    data: str                         # our encrypted blob (opaque to the client)


@dataclass(frozen=True)
class ToolUseBlock:
    id: str
    name: str
    arguments: str                    # JSON object text

    @staticmethod
    def from_input(id: str, name: str, value) -> "ToolUseBlock":
        """Anthropic sends `input` as an object, OpenAI `arguments` as a JSON string."""
        args = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return ToolUseBlock(id, name, args)

    @staticmethod
    def from_custom_input(id: str, name: str, text: str) -> "ToolUseBlock":
        """A custom (free-form) tool call replayed by the client (Responses `custom_tool_call`
        `input`): the dialects render it as a call with one string argument, `input`."""
        return ToolUseBlock(id, name, json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False))


@dataclass(frozen=True)
class ToolResultBlock:
    tool_use_id: str
    content: str
    is_error: bool = False


Block = Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock]
Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(frozen=True)
class Message:
    role: Role
    blocks: tuple[Block, ...]

    @staticmethod
    def text(role: Role, text: str) -> "Message":
        return Message(role, (TextBlock(text),))


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call.

    kind "function": arguments are a JSON object described by `parameters` (JSON Schema);
    `strict` (OpenAI/Anthropic `strict: true`) makes them validate even under tool_choice
    "auto" (a forced call is always constrained to the schema).
    kind "custom" (OpenAI Responses custom tools, e.g. Codex's apply_patch): a free-form text
    input, constrained to `grammar` when given (`grammar_syntax` "lark" or "regex", the wire's
    format.syntax; format {"type": "text"} maps to grammar None). The dialects render and parse
    it as a function call with one string argument, `input`; events report kind "custom".
    """
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    kind: Literal["function", "custom"] = "function"
    grammar: str | None = None
    grammar_syntax: Literal["lark", "regex"] = "lark"
    strict: bool = False

    def __post_init__(self):
        if self.kind not in ("function", "custom"):
            raise ValueError(f"tool kind must be function or custom, got {self.kind!r}")
        if self.grammar_syntax not in ("lark", "regex"):
            raise ValueError(f"grammar_syntax must be lark or regex, got {self.grammar_syntax!r}")

    def openai(self) -> dict:
        fn = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.kind == "function" else self._custom_parameters()
        return {"type": "function", "function": fn}

    def _custom_parameters(self) -> dict:
        about = "The tool input, free-form text."
        if self.grammar:
            about = f"The tool input, text in this {self.grammar_syntax} grammar:\n{self.grammar}"
        return {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": about}},
                "required": [CUSTOM_INPUT]}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str | dict = "auto"          # "auto" | "none" | "required" | {"name": ...}
    parallel_tool_calls: bool = True          # False: at most one call per turn
    # None | {"type": "text"} | {"type": "json_object"}
    #      | {"type": "json_schema", "schema": {...}, "strict": bool, "name": str (unused)}
    # the final answer (not the tool calls) is constrained to JSON / to the schema when strict
    response_format: dict | None = None
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    max_tokens: int = 1024
    stop: tuple[str, ...] = ()
    thinking: bool | None = None              # None: the dialect's default
    reasoning_effort: str | None = None       # DeepSeek V4: None | "high" | "max"
    thinking_budget: int | None = None        # max reasoning tokens (Anthropic budget_tokens)
    redact_thinking: bool = False             # return thinking as an encrypted blob
    id_prefix: str = "call_"                  # "toolu_" for Anthropic, "call_" for OpenAI
    logprobs: int | None = None               # report each sampled token's logprob, with this many alternatives

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.id_prefix not in ("call_", "toolu_"):
            raise ValueError(f"id_prefix must be call_ or toolu_, got {self.id_prefix!r}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ValueError(f"thinking_budget must be >= 0, got {self.thinking_budget}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.logprobs}")

    def text_bytes(self) -> int:
        """A lower bound on the UTF-8 bytes of any rendering of this request: the message text
        and tool results, which every dialect writes verbatim (stripped: a template may trim
        them). Cheap, so an over-long prompt is refused before it is tokenized."""
        return sum(len((b.text if isinstance(b, TextBlock) else b.content).strip().encode())
                   for m in self.messages for b in m.blocks if isinstance(b, (TextBlock, ToolResultBlock)))


# ---- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class ThinkingDone:
    text: str
    signature: str                            # verify-able on replay
    encrypted: str | None = None              # set in redaction mode


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    id: str
    name: str
    index: int
    kind: Literal["function", "custom"] = "function"


@dataclass(frozen=True)
class ToolCallDelta:
    id: str
    fragment: str                             # JSON text; fragments concatenate to the arguments
    index: int


@dataclass(frozen=True)
class ToolCallDone:
    id: str
    name: str
    arguments: str
    index: int
    kind: Literal["function", "custom"] = "function"

    @property
    def input(self) -> str | None:
        """A custom tool call's free-form input (the wire's custom tool call `input`)."""
        if self.kind != "custom":
            return None
        try:
            value = json.loads(self.arguments).get(CUSTOM_INPUT)
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SampledToken:
    """One sampled token's text and log-probability under the model's own distribution (the
    raw logits: neither temperature nor a constraint's mask applies), with its most likely
    alternatives, best first; sent before the text it adds, only when the request asks for
    logprobs. Every sampled token but the end-of-sequence one is reported, tool-call and
    thinking tokens too: the stream has one entry per token the model produced. `raw` is the
    token's bytes (part of a UTF-8 character, where `token` shows U+FFFD)."""
    token: str
    raw: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()   # (token, raw, logprob)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int                        # served from the KV cache (live or restored)
    prefilled_tokens: int                     # computed for this request
    cache_source: str                         # live | token_prefix | text_prefix | disk | cold
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    guessed_tokens: int = 0                   # prompt-lookup guesses evaluated (lookup.py)
    kept_tokens: int = 0                      # of them, tokens the sampler picked


@dataclass(frozen=True)
class Finish:
    reason: Literal["stop", "length", "tool_calls"]
    usage: Usage
    diagnostics: tuple[str, ...] = ()         # degrade notes (bad signature, canonical replay, ...)
    stop_sequence: str | None = None          # the request's stop string that ended the reply


class Planned:
    """An accepted request's events, with the usage its plan predicts before any prefill (what
    an Anthropic stream reports in message_start). The Finish event carries the usage measured;
    it differs only when a planned disk checkpoint fails its checks and the prompt runs cold."""

    def __init__(self, events: Iterator, usage: Usage):
        self.events, self.usage = events, usage

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.events)

    def close(self) -> None:
        self.events.close()


ChatEvent = Union[ThinkingDelta, ThinkingDone, TextDelta, ToolCallStart, ToolCallDelta,
                  ToolCallDone, SampledToken, Finish]


class ChatError(Exception):
    """A request the session refuses. `status` is the HTTP status a server should answer with:
    400 for requests that cannot be served as sent, 409 when live state they relied on is gone."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message
