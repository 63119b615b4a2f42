"""A custom tool call's input, decoded as its JSON arguments stream.

Why a module of its own: both OpenAI adapters stream a custom tool's input as text (Responses in
`response.custom_tool_call_input.delta` events, Chat Completions in its tool-call deltas), while
the session streams the call's arguments, the JSON text of {"input": "..."}. Adapters never build
on one another (api/__init__.py), so what they share lives beside them.
"""
from __future__ import annotations

import json
import re

__all__ = ["CustomInputStream"]

_LENIENT = json.JSONDecoder(strict=False)   # raw control characters in a string are tolerated
_INPUT_HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')


class CustomInputStream:
    """A custom tool call's input as it streams. The session streams the call's arguments, the
    JSON text of {"input": "..."}, in fragments; `feed` returns the newly decodable part of the
    string: up to the closing quote, never ending inside an escape or a surrogate pair. Text it
    cannot follow yields nothing; `response.custom_tool_call_input.done` carries the whole input
    (Chat Completions, which has no such event, streams the rest at the call's end)."""

    def __init__(self):
        self.raw = ""
        self.pos: int | None = None            # where the undecoded rest of the string begins
        self.closed = False

    def feed(self, fragment: str) -> str:
        self.raw += fragment
        if self.pos is None:
            m = _INPUT_HEAD.match(self.raw)
            if m is None:
                return ""
            self.pos = m.end()
        if self.closed:
            return ""
        raw, i, n = self.raw, self.pos, len(self.raw)
        while i < n:
            c = raw[i]
            if c == '"':
                self.closed = True
                break
            if c != "\\":
                i += 1
                continue
            if i + 1 >= n:
                break
            if raw[i + 1] != "u":
                i += 2
                continue
            if i + 6 > n:
                break
            width = 6
            if raw[i + 2] in "dD" and raw[i + 3] in "89abAB":   # a high surrogate: take its pair
                width = 12
                if i + 12 > n:
                    break
            i += width
        try:
            text = _LENIENT.decode('"' + raw[self.pos:i] + '"')
        except ValueError:
            self.closed = True
            return ""
        self.pos = i
        return text
