"""Streaming (and lenient one-shot) parsing of DeepSeek V4 completions, and the syntax tracker.

Why a state machine over a text buffer: a DSML marker is several tokens (`<｜DSML｜invoke` is
`<`, `｜DSML｜`, `inv`, `oke`) and a decoded delta may end anywhere, so the parser matches text,
not token ids. Each state mirrors one "read until one of these markers" step of the official
parser (deepseek_v4_syntax.parse_strict); a state either consumes a prefix of the buffer or waits.
Text that could still become a marker is held back, so nothing half-formed ever leaks, and every
decision is a function of the text alone: for any split into deltas the concatenated events are
identical. `parse_lenient` is this parser fed the whole text at once.

Lenient behaviour, each case reported in `notes` (never silent):
  missing_blank_line_before_tool_block  `<｜DSML｜tool_calls>` after zero or one newline
  truncated_tool_block_close            generation ended inside the final `</｜DSML｜tool_calls>`
                                        (after at least its `\\n</`): the calls are kept
  unclosed_thinking                     no `</think>`: everything is reasoning
  tool_block_in_unclosed_thinking_not_executed / tool_block_in_reasoning_not_executed
                                        a block inside reasoning stays reasoning text
  control_string_in_reasoning / control_string_in_content   kept as text
Errors (an ErrorEvent whose `raw` is text emitted as nothing else, plus a note):
  malformed tool block (any framing the official parser rejects, duplicate parameters),
  truncated tool block (generation ended inside a call), text after the block or after EOS.
A block's calls are executable only once the block is closed: ParsedCallStart (as soon as the tag
after the invoke header arrives: the official header rule needs it to fix the name) and
ParsedCallArgs stream live; ParsedCallEnd comes for every call when `</｜DSML｜tool_calls>`
arrives; a block that fails instead gets an ErrorEvent and no ParsedCallEnd at all, so a consumer
must drop the calls it previewed. EOS is optional: finish() ends the text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from zen5.stop_strings import partial_stop_len

from .base import (
    PAYLOAD,
    STRUCTURE,
    ErrorEvent,
    Event,
    ParsedCallArgs,
    ParsedCallEnd,
    ParsedCallStart,
    ParsedMessage,
    ParsedReasoning,
    ParsedText,
    ParseError,
    ToolCall,
)
from .deepseek_v4_syntax import (
    BLOCK_CLOSE,
    DSML,
    EOS,
    FORBIDDEN_IN_TEXT,
    INVOKE_CLOSE,
    INVOKE_NAME_RE,
    INVOKE_OPEN,
    PARAM_OPEN,
    PARAM_STOP,
    THINK_CLOSE,
    TOOL_TAG,
    parse_strict,
    to_json,
)

__all__ = ["DeepSeekV4StreamParser", "DeepSeekV4SyntaxTracker", "parse_lenient", "message_from_events"]

_AFTER_INVOKE = ((">\n" + INVOKE_OPEN, "invoke_header"), (">\n" + BLOCK_CLOSE, "block_closed"))
_AFTER_PARAM = ((">\n" + PARAM_OPEN, "param_header"), (">\n" + INVOKE_CLOSE, "after_invoke"))
_CLOSE_DECISIVE = len(">\n</")   # from here on the tail can only be the block's closing tag
_PARAM_HEAD_RE = re.compile(r' name="(.*?)" string="(true|false)">', re.DOTALL)
_VALUE_STOPS = ("<" + PARAM_STOP, "<\n" + PARAM_STOP, PARAM_STOP)
_BLOCK_STATES = ("block_open", "invoke_header", "param_header", "param_value", "after_param",
                 "after_invoke")

# error messages: one per check site, so the message never depends on how the text was split
MALFORMED = "malformed tool block: "
TRUNCATED = "truncated tool block"
AFTER_BLOCK = "text after the tool block"
AFTER_EOS = "text after end of sentence"


def _earliest(buf: str, markers: tuple[str, ...]) -> Optional[tuple[int, str]]:
    hits = [(p, m) for m in markers if (p := buf.find(m)) != -1]
    return min(hits) if hits else None


def _compatible(buf: str, literal: str) -> bool:
    return buf.startswith(literal) or literal.startswith(buf)


def _json_scan(state: tuple[bool, bool], text: str) -> tuple[bool, bool]:
    """(inside a JSON string literal, after a backslash) after reading `text`."""
    in_str, esc = state
    for ch in text:
        if esc:
            esc = False
        elif in_str and ch == "\\":
            esc = True
        elif ch == '"':
            in_str = not in_str
    return in_str, esc


@dataclass
class _Call:
    index: int
    name: str
    start: int                       # offset of `<｜DSML｜invoke` in the block text
    keys: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    is_string: bool = True           # kind of the parameter being read
    json_state: tuple[bool, bool] = (False, False)


class DeepSeekV4StreamParser:
    """One per request: `feed(delta)` -> events, `finish()` at EOS or limit -> the last events.
    After finish(): `notes` (leniencies and errors, in text order) and `tool_block_raw`.
    lenient=False streams the same events and adds an ErrorEvent at finish() when the whole text
    fails the strict parse."""

    def __init__(self, thinking_mode: str = "thinking", lenient: bool = True):
        if thinking_mode not in ("thinking", "chat"):
            raise ValueError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")
        self._thinking_mode = thinking_mode
        self._state = "reasoning" if thinking_mode == "thinking" else "content"
        self._buf = ""                     # unconsumed text
        self._events: list[Event] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._block = ""                   # consumed text of the open tool block
        self._calls: list[ToolCall] = []   # finished invokes of the open block
        self._call: Optional[_Call] = None
        self._call_start = 0                # offset of the current invoke in self._block
        self._error = ""                    # message of the terminal error state
        self._all: Optional[list[str]] = None if lenient else []
        self._finished = False
        self._handlers = {
            "reasoning": self._in_reasoning, "content": self._in_content,
            "block_open": lambda: self._expect(_AFTER_INVOKE, "expected '>\\n' and an invoke"),
            "invoke_header": self._in_invoke_header, "param_header": self._in_param_header,
            "param_value": self._in_param_value,
            "after_param": lambda: self._expect(_AFTER_PARAM, "expected '>\\n' after a parameter"),
            "after_invoke": lambda: self._expect(_AFTER_INVOKE, "expected '>\\n' after an invoke"),
            "block_closed": self._in_block_closed, "done": self._in_done, "error": self._in_error,
        }
        self.notes: list[str] = []
        self.tool_block_raw = ""

    # ---- public API ------------------------------------------------------------------------
    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._all is not None:
            self._all.append(delta)
        self._buf += delta
        while self._step():
            pass
        return self._drain()

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        self._finished = True
        self._end_of_text()
        self._final_notes()
        if self._all is not None:
            try:
                parse_strict("".join(self._all), self._thinking_mode, require_closed_block=True)
            except ParseError as e:
                self._events.append(ErrorEvent(f"strict: {e}"))
        return self._drain()

    def position_kind(self) -> str:
        """What the next token is: see DeepSeekV4SyntaxTracker."""
        state, buf = self._state, self._buf
        if state == "content" and ("<" + DSML) in buf:
            return "structure"        # a tool tag is being written
        if state in ("reasoning", "content"):
            return state
        if state == "param_value":
            if buf.startswith("</"):
                return "structure"    # the closing tag has begun: decode it greedily
            if self._call.is_string:
                return "string_body"
            in_str, _ = _json_scan(self._call.json_state, buf)
            return "json_string" if in_str else "json_structure"
        return "done" if state in ("done", "error") else "structure"

    # ---- helpers ---------------------------------------------------------------------------
    def _drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def _take(self, n: int) -> str:
        """Consume n buffered characters into the open block's text."""
        s, self._buf = self._buf[:n], self._buf[n:]
        self._block += s
        return s

    def _emit_text(self, s: str, reasoning: bool) -> None:
        if s:
            (self._reasoning if reasoning else self._content).append(s)
            self._events.append(ParsedReasoning(s) if reasoning else ParsedText(s))

    def _emit_args(self, fragment: str) -> None:
        if fragment:
            self._call.args.append(fragment)
            self._events.append(ParsedCallArgs(self._call.index, fragment))

    def _fail(self, message: str) -> None:
        """Terminal error: everything unconsumed (and later) is reported as raw error text."""
        raw = self._block + self._buf if self._state in _BLOCK_STATES else self._buf
        self._block, self._buf, self._calls, self._call = "", "", [], None
        self._error, self._state = message, "error"
        self._note(message)
        self._events.append(ErrorEvent(message, raw))

    # ---- the state machine -----------------------------------------------------------------
    def _step(self) -> bool:
        """Advance one state; False when more text is needed."""
        return self._handlers[self._state]()

    def _in_reasoning(self) -> bool:
        buf = self._buf
        hit = _earliest(buf, (THINK_CLOSE, EOS))
        if hit is None:
            keep = partial_stop_len(buf, (THINK_CLOSE, EOS))
            self._emit_text(buf[:len(buf) - keep], reasoning=True)
            self._buf = buf[len(buf) - keep:]
            return False
        pos, marker = hit
        self._emit_text(buf[:pos], reasoning=True)
        self._buf = buf[pos + len(marker):]
        self._close_reasoning(closed=marker == THINK_CLOSE)
        self._state = "content" if marker == THINK_CLOSE else "done"
        return True

    def _close_reasoning(self, closed: bool) -> None:
        if TOOL_TAG in "".join(self._reasoning):
            self._note("tool_block_in_reasoning_not_executed" if closed
                       else "tool_block_in_unclosed_thinking_not_executed")
        if not closed:
            self._note("unclosed_thinking")

    def _in_content(self) -> bool:
        buf = self._buf
        hit = _earliest(buf, (EOS, TOOL_TAG))
        if hit is None:
            cut = len(buf) - partial_stop_len(buf, (EOS, TOOL_TAG))
            floor = max(0, cut - 2)   # up to two newlines may be the block's blank line
            while cut > floor and buf[cut - 1] == "\n":
                cut -= 1
            self._emit_text(buf[:cut], reasoning=False)
            self._buf = buf[cut:]
            return False
        pos, marker = hit
        if marker == EOS:
            self._emit_text(buf[:pos], reasoning=False)
            self._buf = buf[pos + len(EOS):]
            self._state = "done"
            return True
        start = pos
        while start > max(0, pos - 2) and buf[start - 1] == "\n":
            start -= 1
        self._emit_text(buf[:start], reasoning=False)
        if pos - start < 2:
            self._note("missing_blank_line_before_tool_block")
        self._buf, self._block, self._state = buf[start:], "", "block_open"
        self._take(pos - start + len(TOOL_TAG))
        return True

    def _expect(self, options: tuple[tuple[str, str], ...], what: str) -> bool:
        """Fixed framing between tags: one of `options` (literal, next state) must follow."""
        buf = self._buf
        for literal, state in options:
            if buf.startswith(literal):
                self._take(len(literal))
                self._enter(state)
                return True
        k = max(len(_common_prefix(buf, literal)) for literal, _ in options)
        rest = buf[k:]
        if rest.startswith(EOS):
            self._end_in_block(k)         # generation ended here
        elif not rest or EOS.startswith(rest):
            return False                  # need more text (the rest may become an EOS)
        else:
            self._fail(MALFORMED + what)
        return True

    def _enter(self, state: str) -> None:
        if state == "invoke_header":
            self._call_start = len(self._block) - len(INVOKE_OPEN)
        elif state == "after_invoke":
            self._close_invoke()
        elif state == "block_closed":
            self._close_block()
            return
        self._state = state

    def _in_invoke_header(self) -> bool:
        buf = self._buf
        hit = _earliest(buf, (PARAM_OPEN, INVOKE_CLOSE))
        if hit is None:
            if not _compatible(buf[re.match(r"\s*", buf).end():], 'name="'):
                self._fail(MALFORMED + "bad invoke header")
                return True
            return False
        pos, marker = hit
        names = INVOKE_NAME_RE.findall(buf[:pos])
        if len(names) != 1:
            self._fail(MALFORMED + "bad invoke header")
            return True
        self._take(pos + len(marker))
        self._call = _Call(index=len(self._calls), name=names[0], start=self._call_start)
        self._events.append(ParsedCallStart(self._call.index, self._call.name))
        self._emit_args("{")
        if marker == PARAM_OPEN:
            self._state = "param_header"
        else:
            self._close_invoke()
        return True

    def _in_param_header(self) -> bool:
        buf = self._buf
        stop = buf.find(PARAM_STOP)
        m = _PARAM_HEAD_RE.match(buf if stop == -1 else buf[:stop])
        if m is None:
            if stop != -1 or not _compatible(buf, ' name="'):
                self._fail(MALFORMED + "bad parameter header")
                return True
            return False
        key, flag = m.group(1), m.group(2)
        call = self._call
        if key in call.keys:
            self._fail(MALFORMED + "duplicate parameter")
            return True
        self._take(m.end())
        self._emit_args((", " if call.keys else "") + to_json(key) + ": "
                        + ('"' if flag == "true" else ""))
        call.keys.append(key)
        call.is_string, call.json_state = flag == "true", (False, False)
        self._state = "param_value"
        return True

    def _in_param_value(self) -> bool:
        buf = self._buf
        stop = buf.find(PARAM_STOP)
        if stop == -1:
            cut = len(buf) - partial_stop_len(buf, _VALUE_STOPS)
            self._emit_value(self._take(cut))
            return False
        before = buf[:stop]
        end = 2 if before.endswith("<\n") else 1 if before.endswith("<") else 0
        if not end:   # official: the value must be followed by "<" (or "<\n") + the stop
            self._fail(MALFORMED + "parameter value not closed by </｜DSML｜parameter>")
            return True
        self._emit_value(self._take(stop - end))
        self._take(end + len(PARAM_STOP))
        self._emit_args('"' if self._call.is_string else "")
        self._state = "after_param"
        return True

    def _emit_value(self, s: str) -> None:
        call = self._call
        if call.is_string:
            self._emit_args(to_json(s)[1:-1])   # JSON escaping is per character
        else:
            call.json_state = _json_scan(call.json_state, s)
            self._emit_args(s)

    def _close_invoke(self) -> None:
        """`</｜DSML｜invoke` consumed; every continuation the parser accepts starts with '>'."""
        call = self._call
        self._emit_args("}")
        self._calls.append(ToolCall(call.name, "".join(call.args),
                                    self._block[call.start:] + ">"))
        self._state = "after_invoke"

    def _close_block(self) -> None:
        for i, call in enumerate(self._calls):
            self._events.append(ParsedCallEnd(i, call.name, call.arguments, call.raw))
        self.tool_block_raw, self._block, self._calls, self._call = self._block, "", [], None
        self._state = "block_closed"

    def _end_in_block(self, k: int) -> None:
        """Generation ended after buf[:k] inside a block: keep the calls only when the tail is a
        decisive start of the closing tag (`>\\n</`...), otherwise it is a truncated block."""
        tail = self._buf[:k]
        closing = ">\n" + BLOCK_CLOSE
        if self._state in ("block_open", "after_invoke") and k >= _CLOSE_DECISIVE \
                and closing.startswith(tail):
            self._take(k)
            self._note("truncated_tool_block_close")
            self._close_block()
        else:
            self._fail(TRUNCATED)

    def _in_block_closed(self) -> bool:
        if self._buf.startswith(EOS):
            self._buf = self._buf[len(EOS):]
            self._state = "done"
            return True
        if not self._buf or EOS.startswith(self._buf):
            return False
        self._fail(AFTER_BLOCK)   # the block's calls stand: they ended before this text
        return True

    def _in_done(self) -> bool:
        if self._buf:
            self._fail(AFTER_EOS)
        return False

    def _in_error(self) -> bool:
        if self._buf:
            self._events.append(ErrorEvent(self._error, self._buf))
            self._buf = ""
        return False

    def _end_of_text(self) -> None:
        """finish(): flush held-back text or report what was cut off."""
        state, buf = self._state, self._buf
        if state == "reasoning":
            self._emit_text(buf, reasoning=True)
            self._buf = ""
            self._close_reasoning(closed=False)
        elif state == "content":
            if buf.lstrip("\n").startswith("<" + DSML):   # a tool tag cut off mid-way
                self._fail(TRUNCATED)
            else:
                self._emit_text(buf, reasoning=False)
                self._buf = ""
        elif state in ("block_open", "after_invoke"):
            self._end_in_block(len(buf))
        elif state in _BLOCK_STATES:
            self._fail(TRUNCATED)
        elif buf:   # a partial EOS after the block
            self._fail(AFTER_BLOCK)

    def _final_notes(self) -> None:
        for name, parts in (("reasoning", self._reasoning), ("content", self._content)):
            text = "".join(parts)
            if any(marker in text for marker in FORBIDDEN_IN_TEXT):
                self._note(f"control_string_in_{name}")


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def message_from_events(events: list[Event], notes: tuple[str, ...] = (),
                        tool_block_raw: str = "") -> ParsedMessage:
    """Fold streamed events into the one-shot result."""
    reasoning = "".join(e.text for e in events if isinstance(e, ParsedReasoning))
    content = "".join(e.text for e in events if isinstance(e, ParsedText))
    calls = tuple(ToolCall(e.name, e.arguments, e.raw)
                  for e in events if isinstance(e, ParsedCallEnd))
    return ParsedMessage(reasoning=reasoning, content=content, tool_calls=calls,
                         tool_block_raw=tool_block_raw, notes=tuple(notes))


def parse_lenient(text: str, thinking_mode: str = "thinking") -> ParsedMessage:
    """The lenient one-shot parse: the stream parser fed the whole text (never raises)."""
    parser = DeepSeekV4StreamParser(thinking_mode=thinking_mode, lenient=True)
    events = parser.feed(text) + parser.finish()
    return message_from_events(events, tuple(parser.notes), parser.tool_block_raw)


class DeepSeekV4SyntaxTracker:
    """Issue 3 item 5: is the next token protocol structure (decode greedily) or payload (decode
    with the request's sampling settings)? Feed it the same text as the stream parser.
    `next_kind()` (also returned by `feed`) is "structure" or "payload", as in ChatML's tracker;
    `kind()` is the finer classification behind it:
      "reasoning", "content"   payload: free text (DSML typed inside reasoning is payload too)
      "string_body"            payload: body of a string="true" parameter
      "json_string"            payload: inside a JSON string literal of a string="false" value
      "json_structure"         structure: JSON punctuation, numbers and literals of a
                               string="false" value
      "structure"              structure: tags, invoke/parameter headers, the newlines between
                               them; also content once `<｜DSML｜` appeared, and a value once its
                               closing tag began (tail starts with `</`)
      "done"                   structure: after EOS or an error nothing more should be generated
    """

    STRUCTURE_KINDS = frozenset({"structure", "json_structure", "done"})

    def __init__(self, thinking_mode: str = "thinking"):
        self._parser = DeepSeekV4StreamParser(thinking_mode=thinking_mode, lenient=True)

    def feed(self, delta: str) -> str:
        """Advance by the sampled text; returns the kind of the next position."""
        self._parser.feed(delta)
        return self.next_kind()

    def kind(self) -> str:
        return self._parser.position_kind()

    def next_kind(self) -> str:
        return STRUCTURE if self.is_structure() else PAYLOAD

    def is_structure(self) -> bool:
        return self.kind() in self.STRUCTURE_KINDS
