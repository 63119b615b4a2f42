"""Tool memory: unguessable tool-call IDs mapped to the exact text the model sampled.

When a client replays an assistant turn, it sends our tool calls back as JSON (often with keys
re-ordered or whitespace changed). Rendering that JSON canonically would produce bytes the model
never saw and break every cache prefix after it. So every call we emit gets an ID with 128 random
bits (nobody can guess or forge one) and we remember ID -> the exact sampled call text; the
renderer uses it whenever every ID of a replayed turn maps to the same sampled block.

Bounded by entry count and total bytes, least recently used evicted first. An evicted entry only
costs a canonical rendering (and a re-prefill from there); correctness never depends on it.
"""
from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolRecord:
    id: str
    name: str
    arguments: str      # JSON text as parsed from the sampled call
    raw: str            # exact sampled text of this call block
    block_raw: str      # exact sampled text of the whole tool-call section it belonged to
    block_id: str       # identifies that one sampled section (several calls share it)
    index: int          # position of the call within its block
    block_size: int     # how many calls the block holds

    @property
    def nbytes(self) -> int:
        return len(self.raw.encode()) + len(self.block_raw.encode()) + len(self.arguments.encode()) + 64


def new_tool_id(prefix: str = "call_") -> str:
    """`toolu_` (Anthropic) or `call_` (OpenAI) + 128 random bits as 32 hex digits."""
    if prefix not in ("toolu_", "call_"):
        raise ValueError(f"unknown tool id prefix {prefix!r}")
    return prefix + secrets.token_hex(16)


class ToolMemory:
    def __init__(self, max_entries: int = 4096, max_bytes: int = 16 << 20):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("tool memory bounds must be positive")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, ToolRecord] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, tool_id: str) -> bool:
        return tool_id in self._items

    @property
    def nbytes(self) -> int:
        return self._bytes

    def remember(self, rec: ToolRecord) -> None:
        old = self._items.pop(rec.id, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._items[rec.id] = rec
        self._bytes += rec.nbytes
        while len(self._items) > self.max_entries or (self._bytes > self.max_bytes and len(self._items) > 1):
            _, gone = self._items.popitem(last=False)
            self._bytes -= gone.nbytes

    def get(self, tool_id: str) -> ToolRecord | None:
        rec = self._items.get(tool_id)
        if rec is not None:
            self._items.move_to_end(tool_id)
        return rec

    def exact_block(self, tool_ids: list[str]) -> str | None:
        """The sampled tool-call section for a replayed turn, if and only if every ID is known,
        all come from one sampled block, and together they are exactly that block's calls in
        order. Otherwise None: the caller renders canonically."""
        recs = [self.get(i) for i in tool_ids]
        if not recs or any(r is None for r in recs):
            return None
        first = recs[0]
        if any(r.block_id != first.block_id for r in recs):
            return None
        if [r.index for r in recs] != list(range(first.block_size)):
            return None  # calls missing, repeated or re-ordered
        return first.block_raw

    def records(self) -> list[ToolRecord]:
        return list(self._items.values())
