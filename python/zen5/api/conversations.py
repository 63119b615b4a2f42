"""What the server remembers between requests, beside the session's own live state.

- `Reply` assembles one streamed assistant turn from neutral events. Every adapter builds its
  non-streaming body from it, the stores keep it, the trace logs it: one assembly, so a stored
  turn is exactly what the client was shown.
- `ConversationStore` serves the stateful protocol features (Responses `previous_response_id`,
  Anthropic `thread`): the conversation so far, in neutral form, under the id of the reply that
  ended it. Bounded by the bytes of text it holds (LRU, `MAX_STORED_BYTES`) and by count; an
  evicted or unknown id is a clear 400, and the client replays. Only what the prompt renders is
  kept (the adapters drop unproven thinking first: `signatures.drop_unproven_thinking`).
  Re-rendering a stored conversation reaches the same cache rungs as a client's own replay
  (live tool-ID continuation, prefix), because it holds our IDs and signatures unchanged.
- `ReasoningMemory` lets Chat Completions clients replay `reasoning_content` (a field with no
  room for a signature) exactly: text we emitted maps back to its signature.
All three are touched only on the event-loop thread.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from dataclasses import dataclass, fields

from zen5.chat_types import (
    Finish,
    Message,
    RedactedThinkingBlock,
    SampledToken,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDone,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolSpec,
    ToolUseBlock,
)


class Reply:
    """One assistant turn, built as its events arrive. `parts` keeps the order the model produced:
    ThinkingDone, text (str) and ToolCallDone items. With logprobs, `text_tokens[i]` holds the
    sampled tokens of the i-th text part: the tokens sampled since the previous event, credited
    to the text event that follows them (tokens followed by thinking or a tool call are not)."""

    def __init__(self):
        self.parts: list = []
        self.finish: Finish | None = None
        self.open_calls: dict[str, list] = {}      # id -> [name, arguments so far] (not yet done)
        self.sampled: list[SampledToken] = []      # when the request asked for logprobs
        self.text_tokens: list[list[SampledToken]] = []
        self._pending: list[SampledToken] = []

    def add(self, ev) -> None:
        if not isinstance(ev, (SampledToken, Finish)):
            tokens, self._pending = self._pending, []
        if isinstance(ev, TextDelta):
            if self.parts and isinstance(self.parts[-1], str):
                self.parts[-1] += ev.text
            else:
                self.parts.append(ev.text)
                self.text_tokens.append([])
            self.text_tokens[-1].extend(tokens)
        elif isinstance(ev, (ThinkingDone, ToolCallDone)):
            self.parts.append(ev)
            if isinstance(ev, ToolCallDone):
                self.open_calls.pop(ev.id, None)
        elif isinstance(ev, ToolCallStart):
            self.open_calls[ev.id] = [ev.name, ""]
        elif isinstance(ev, ToolCallDelta) and ev.id in self.open_calls:
            self.open_calls[ev.id][1] += ev.fragment
        elif isinstance(ev, SampledToken):
            self.sampled.append(ev)
            self._pending.append(ev)
        elif isinstance(ev, Finish):
            self.finish = ev

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def thinking(self) -> list[ThinkingDone]:
        return [p for p in self.parts if isinstance(p, ThinkingDone)]

    @property
    def tool_calls(self) -> list[ToolCallDone]:
        return [p for p in self.parts if isinstance(p, ToolCallDone)]

    def message(self) -> Message:
        """The turn as the client would replay it (complete tool calls only)."""
        blocks = []
        for p in self.parts:
            if isinstance(p, str):
                blocks.append(TextBlock(p))
            elif isinstance(p, ThinkingDone):
                blocks.append(RedactedThinkingBlock(p.encrypted) if p.encrypted
                              else ThinkingBlock(p.text, p.signature))
            else:
                blocks.append(ToolUseBlock(p.id, p.name, p.arguments))
        return Message("assistant", tuple(blocks))

    def summary(self) -> dict:
        """The parsed output, for the trace."""
        return {"thinking": "".join(t.text for t in self.thinking), "text": self.text,
                "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls],
                "incomplete_calls": [{"id": k, "name": v[0]} for k, v in self.open_calls.items()]}


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]          # everything so far, the stored reply included
    tools: tuple[ToolSpec, ...] = ()       # Anthropic threads keep the create-time tools
    system: tuple[Message, ...] = ()       # and system prompt (a `continue` may not repeat them)


# 256 MiB of stored text: four whole 64 MiB request bodies, or hundreds of long agent sessions
# (a 128k-token conversation is about 0.5 MB of text). Resident memory is about this plus
# Python's per-object overhead (small: text dominates).
MAX_STORED_BYTES = 256 << 20


def _nbytes(part) -> int:
    """Resident bytes of the text a stored part holds (CPython's own size of each string)."""
    if isinstance(part, Message):
        return sum(_nbytes(b) for b in part.blocks)
    if isinstance(part, ToolSpec):
        return (sys.getsizeof(part.name) + sys.getsizeof(part.description) + sys.getsizeof(part.grammar or "")
                + sys.getsizeof(json.dumps(part.parameters)))
    return sum(sys.getsizeof(v) for v in (getattr(part, f.name) for f in fields(part)) if isinstance(v, str))


class ConversationStore:
    """Conversations by reply id, least recently used evicted first once the text held passes
    `max_bytes` (or the entries pass `max_entries`). A conversation continued by id shares its
    earlier messages with the entry it continued, so each message (and tool) is counted once
    however many entries hold it: `nbytes` is what the store really keeps alive. A conversation
    larger than the whole budget is not kept (its id then answers the not-found 400)."""

    def __init__(self, max_bytes: int = MAX_STORED_BYTES, max_entries: int = 512):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.nbytes = 0
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self._held: dict[int, list] = {}       # id(part) -> [part, entries holding it, its bytes]

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _parts(conv: Conversation) -> tuple:
        return conv.messages + conv.system + conv.tools

    def _hold(self, conv: Conversation) -> int:
        """Count the conversation's parts as held; returns its own bytes (a part already held by
        an earlier entry is not measured again)."""
        total = 0
        for part in self._parts(conv):
            held = self._held.get(id(part))
            if held is None:
                held = self._held[id(part)] = [part, 0, _nbytes(part)]
                self.nbytes += held[2]
            held[1] += 1
            total += held[2]
        return total

    def _release(self, conv: Conversation) -> None:
        for part in self._parts(conv):
            held = self._held[id(part)]
            held[1] -= 1
            if held[1] == 0:
                del self._held[id(part)]
                self.nbytes -= held[2]

    def put(self, key: str, conv: Conversation) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._release(old)
        if self._hold(conv) > self.max_bytes:
            self._release(conv)
            return
        self._items[key] = conv
        while self.nbytes > self.max_bytes or len(self._items) > self.max_entries:
            self._release(self._items.popitem(last=False)[1])

    def get(self, key: str) -> Conversation | None:
        conv = self._items.get(key)
        if conv is not None:
            self._items.move_to_end(key)
        return conv


class ReasoningMemory:
    """sha256(thinking text we emitted) -> its signature, LRU-bounded."""

    def __init__(self, max_entries: int = 2048):
        self.max_entries = max_entries
        self._items: OrderedDict[bytes, str] = OrderedDict()

    @staticmethod
    def _key(text: str) -> bytes:
        return hashlib.sha256(text.encode()).digest()

    def remember(self, text: str, signature: str) -> None:
        self._items[self._key(text)] = signature
        self._items.move_to_end(self._key(text))
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def signature_for(self, text: str) -> str | None:
        return self._items.get(self._key(text))
