"""ChatML with Hermes/Qwen-style tool calls (SmolLM2, Qwen): render, parse, stream, track.

Why this module exists: the tool-tuned default model was trained on exactly the text in
`shared/specs/chatml-tools.md`, so rendering must be byte-exact or it stops calling tools; the
model's output must become content + tool calls with a defined result for every malformed shape
(never an exception escaping a serving path); streaming must agree with the one-shot parse for
any split of the text into deltas; and the syntax tracker tells the sampler which positions are
protocol structure (decode greedily) and which are payload (decode with the request's settings).
The markers live in `chatml_syntax.py`, the constrained-decoding grammar that writes this same
syntax in `chatml_grammar.py`.

The grammar of one sampled assistant message, as both parsers read it:

    message  := content? ("\n"? block (gap block)* gap?)? ("<|im_end|>" anything)?
    block    := "<tool_call>" JSON "</tool_call>"   (closed by the first "</tool_call>" outside
                a JSON string; strings are tracked lexically: '"' opens and closes one, '\\'
                escapes the next character inside one, so arguments may contain the tag)
    gap      := blank text (" \t\r\n") between/after blocks, dropped; any other gap text is
                content in lenient mode (noted) and an error in strict mode

The one "\n" separating content from the first block belongs to neither. JSON is Python's
`json.loads` minus NaN/Infinity, non-finite floats and duplicate keys (they would not
re-serialize to what was sampled); arguments are re-serialized with
`json.dumps(obj, ensure_ascii=False)`.
"""
from __future__ import annotations

import json
import math
import re
from typing import Iterable

from zen5.dialects import chatml_grammar
from zen5.dialects.base import (
    PAYLOAD,
    RAW_TOOL_BLOCK,
    STRUCTURE,
    ErrorEvent,
    Event,
    ParsedCallArgs,
    ParsedCallEnd,
    ParsedCallStart,
    ParsedMessage,
    ParsedText,
    ParseError,
    Segment,
    ToolCall,
)
from zen5.dialects.chatml_syntax import CALL_CLOSE, CALL_OPEN, IM_END, IM_START
from zen5.stop_strings import partial_stop_len

__all__ = ["ChatMLDialect", "ChatMLStreamParser", "ChatMLSyntaxTracker", "DEFAULT_SYSTEM",
           "STRUCTURE", "PAYLOAD", "assistant_text", "parse_call_json"]

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_BLANK = " \t\r\n"
_UNCLOSED = "unclosed <tool_call> block"


# ---- rendering ----------------------------------------------------------------------------
class _Segments:
    """Builds the segment list, merging adjacent plain text."""

    def __init__(self):
        self.segments: list[Segment] = []

    def control(self, text: str) -> None:
        self.segments.append(Segment(text, control=True))

    def text(self, text: str) -> None:
        if not text:
            return
        if self.segments and not self.segments[-1].control:
            text = self.segments.pop().text + text
        self.segments.append(Segment(text))

    def turn(self, role: str, text: str) -> None:
        self.control(IM_START)
        self.text(f"{role}\n{text}")
        self.control(IM_END)
        self.text("\n")


def _text_of(content) -> str:
    """Message content as text: a string, None, or a list of text parts (joined by "\\n")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"):
                parts.append(p.get("text") or "")
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise ValueError(f"content part of type {kind!r} is not supported by the "
                                 "ChatML dialect (text only)")
        return "\n".join(parts)
    raise ValueError(f"message content must be a string or a list of parts, got "
                     f"{type(content).__name__}")


def _tool_json(tool: dict) -> str:
    """One tool line: OpenAI's {"type": "function", "function": {...}}, keys in given order.
    Anthropic tools ({name, description, input_schema}) and Responses-API flat function tools
    ({type, name, description, parameters}) are mapped into that shape."""
    if not isinstance(tool, dict):
        raise ValueError(f"a tool must be an object, got {type(tool).__name__}")
    if isinstance(tool.get("function"), dict):
        obj = tool if tool.get("type") == "function" else {"type": "function",
                                                            "function": tool["function"]}
    elif "input_schema" in tool or "parameters" in tool:
        fn = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema", tool.get("parameters"))
        obj = {"type": "function", "function": fn}
    else:
        raise ValueError(f"unsupported tool (no function, parameters or input_schema): "
                         f"{sorted(tool)}")
    return json.dumps(obj, ensure_ascii=False)


def _system_text(system_parts: list[str] | None, default_system: str, tools) -> str:
    text = "\n".join(system_parts) if system_parts is not None else default_system
    if tools:
        text += TOOLS_HEADER + "\n".join(_tool_json(t) for t in tools) + TOOLS_FOOTER
    return text


def _call_pair(call: dict) -> tuple[str, object]:
    """(name, arguments) of an OpenAI tool_calls item (or a bare {"name", "arguments"})."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    return fn.get("name"), fn.get("arguments")


def _canonical_call(name, arguments) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call without a name: {name!r}")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"arguments of tool call {name!r} are not JSON: {e}") from None
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def assistant_text(content: str, calls: Iterable[tuple[str, object]]) -> str:
    """The assistant turn's text as the model samples it: content, "\\n", blocks by "\\n"."""
    blocks = "\n".join(_canonical_call(n, a) for n, a in calls)
    if not blocks:
        return content
    return f"{content}\n{blocks}" if content else blocks


def _tool_results(messages: list[dict], call_order: dict) -> str:
    """One user turn's text for consecutive tool messages, stably sorted into call order
    (unknown ids first, as the DeepSeek V4 rules do)."""
    ordered = sorted(messages, key=lambda m: call_order.get(m.get("tool_call_id"), -1))
    return "\n".join(f"{RESPONSE_OPEN}\n{_text_of(m.get('content'))}\n{RESPONSE_CLOSE}"
                     for m in ordered)


def _turns(messages: list[dict]):
    """(role, text) for every non-system turn; consecutive tool messages become one user turn."""
    call_order: dict = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        role = m.get("role")
        if role == "tool":
            j = i
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            yield "user", _tool_results(messages[i:j], call_order)
            i = j
            continue
        if role == "user":
            yield "user", _text_of(m.get("content"))
        elif role == "assistant":
            calls = [_call_pair(c) for c in m.get("tool_calls") or []]
            if calls:
                call_order = {c.get("id"): k for k, c in enumerate(m["tool_calls"])}
            raw = m.get(RAW_TOOL_BLOCK)
            if calls and isinstance(raw, str):  # exact replay: the blocks as sampled
                content = _text_of(m.get("content"))
                yield "assistant", f"{content}\n{raw}" if content else raw
            else:
                yield "assistant", assistant_text(_text_of(m.get("content")), calls)
        elif role not in ("system", "developer"):
            raise ValueError(f"unsupported message role {role!r} for the ChatML dialect")
        i += 1


# ---- one-shot parsing ---------------------------------------------------------------------
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return obj


def _load_json(text: str):
    return json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant,
                      object_pairs_hook=_unique_keys)


def parse_call_json(inner: str, lenient: bool = False) -> tuple[str, str, tuple[str, ...]]:
    """(name, canonical arguments, notes) of one block's JSON; ParseError when malformed.
    Lenient only: a missing "arguments" means {} and keys other than name/arguments are
    ignored, each noted."""
    try:
        obj = _load_json(inner)
    except RecursionError:
        raise ParseError("tool call JSON nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, our hooks, int() digit limit
        raise ParseError(f"tool call is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ParseError("tool call JSON is not an object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ParseError("tool call has no name")
    notes = []
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        if not lenient:
            raise ParseError(f"tool call has unexpected keys {extra}")
        notes.append("ignored_tool_call_keys")
    if "arguments" not in obj:
        if not lenient:
            raise ParseError("tool call has no arguments")
        notes.append("missing_arguments")
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        raise ParseError("tool call arguments are not a JSON object")
    return name, json.dumps(args, ensure_ascii=False), tuple(notes)


def _is_blank(text: str) -> bool:
    return not text.strip(_BLANK)


def _scan_to_close(text: str, state: list[bool]) -> tuple[int, bool]:
    """Walk `text` (inside a block) to the first "</tool_call>" outside a JSON string.
    Returns (index, True) there, or (index, False) where the walk stopped: the end, or a
    possible partial close tag at the end. `state` = [in_string, after_backslash] is updated
    for exactly text[:index]."""
    in_str, esc = state
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "<" and CALL_CLOSE.startswith(text[i:i + len(CALL_CLOSE)]):
            state[:] = [in_str, esc]
            return i, len(text) - i >= len(CALL_CLOSE)
        i += 1
    state[:] = [in_str, esc]
    return n, False


class _Scan:
    """The one-shot parse as the event sequence a stream would produce."""

    def __init__(self, lenient: bool):
        self.lenient = lenient
        self.events: list[Event] = []
        self.notes: list[str] = []
        self.n_calls = 0

    def fail(self, note: str, message: str) -> None:
        if not self.lenient:
            raise ParseError(message)
        self.notes.append(note)

    def text(self, text: str) -> None:
        if text:
            self.events.append(ParsedText(text))

    def block(self, raw: str) -> None:
        try:
            name, args, notes = parse_call_json(raw[len(CALL_OPEN):-len(CALL_CLOSE)],
                                                self.lenient)
        except ParseError as e:
            self.fail(f"malformed_tool_call: {e}", str(e))
            self.events.append(ErrorEvent(str(e), raw))
            return
        self.notes.extend(notes)
        i = self.n_calls
        self.n_calls += 1
        self.events += [ParsedCallStart(i, name), ParsedCallArgs(i, args),
                        ParsedCallEnd(i, name, args, raw)]


def _scan(text: str, lenient: bool) -> tuple[_Scan, str]:
    """Parse `text` (see the module grammar); returns the scan and tool_block_raw."""
    s = _Scan(lenient)
    end = text.find(IM_END)
    if end >= 0:
        if text[end + len(IM_END):]:
            s.fail("text_after_end_marker", f"text after {IM_END}")
        text = text[:end]
    pos = text.find(CALL_OPEN)
    if pos < 0:
        s.text(text)
        return s, ""
    first, last_end = pos, pos
    s.text(text[:pos - 1] if text[:pos].endswith("\n") else text[:pos])
    while pos >= 0:
        start = pos + len(CALL_OPEN)
        offset, closed = _scan_to_close(text[start:], [False, False])
        close = start + offset if closed else -1
        if close < 0:
            s.fail("unclosed_tool_call", _UNCLOSED)
            s.events.append(ErrorEvent(_UNCLOSED, text[pos:]))
            break
        last_end = close + len(CALL_CLOSE)
        s.block(text[pos:last_end])
        pos = text.find(CALL_OPEN, last_end)
        gap = text[last_end:] if pos < 0 else text[last_end:pos]
        if not _is_blank(gap):
            where = "after" if pos < 0 else "between"
            s.fail(f"text_{where}_tool_calls", f"text {where} tool calls: {gap[:40]!r}")
            s.text(gap)
    return s, text[first:last_end]


# ---- incremental JSON (stream) ------------------------------------------------------------
def _escape(ch: str) -> str:
    if ch >= " " and ch not in '"\\':
        return ch
    return json.dumps(ch, ensure_ascii=False)[1:-1]


_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}
_HEX = set("0123456789abcdefABCDEF")
_NUMBER_CHARS = set("0123456789+-.eE")
_LITERALS = ("true", "false", "null")


class _JsonScanner:
    """Reads one block's JSON a character at a time, for early emission only.

    It learns the call's name (a non-empty string value of the top-level key "name") and the
    canonical text (`json.dumps(..., ensure_ascii=False)`) of the top-level "arguments" object
    as it is sampled, when that object starts after the name is known. The block's final
    verdict always comes from `parse_call_json`; this only has to be right when it is valid.
    """

    def __init__(self):
        self.stack: list[dict] = []   # open containers: {"kind": "o"|"a", "keys", "key"}
        self.expect = "value"         # value | first_key | key | colon | after | first_item | end
        self.tok = None               # None | "str" | "num" | "lit"
        self.chars: list[str] = []    # the current token (decoded chars for strings)
        self.is_key = False
        self.esc = None               # None | "\\" | "\\u..." (partial escape)
        self.high = None              # a pending high surrogate from a \\u escape
        self.failed = False
        self.name: str | None = None
        self.args_parts: list[str] = []
        self.capture_depth = 0        # >0 while inside the arguments object

    def feed(self, text: str) -> None:
        for ch in text:
            if self.failed:
                return
            self._char(ch)

    def kind(self) -> str:
        """What the next character is: a string/number/literal value is payload; so is the start
        of a value, except the block's own object and the arguments object; the rest (keys,
        punctuation, whitespace) is structure."""
        if self.failed:
            return STRUCTURE
        if self.tok is not None:
            return STRUCTURE if self.tok == "str" and self.is_key else PAYLOAD
        if self.expect in ("value", "first_item"):
            depth = len(self.stack)
            if depth == 0 or (depth == 1 and self.stack[0]["key"] == "arguments"):
                return STRUCTURE
            return PAYLOAD
        return STRUCTURE

    def _out(self, text: str) -> None:
        if self.capture_depth:
            self.args_parts.append(text)

    def _char(self, ch: str) -> None:
        if self.tok == "str":
            self._string_char(ch)
        elif self.tok == "num":
            if ch in _NUMBER_CHARS:
                self.chars.append(ch)
                return
            self._end_number()
            if not self.failed:
                self._char(ch)
        elif self.tok == "lit":
            self._literal_char(ch)
        elif ch in _BLANK:
            return
        else:
            self._structural(ch)

    def _structural(self, ch: str) -> None:
        e = self.expect
        if e in ("value", "first_item") and not (e == "first_item" and ch == "]"):
            self._start_value(ch)
        elif ch == '"' and e in ("first_key", "key"):
            self.tok, self.is_key, self.chars = "str", True, []
            self._out('"')
        elif ch == ":" and e == "colon":
            self._out(": ")
            self.expect = "value"
        elif ch == "," and e == "after":
            self._out(", ")
            self.expect = "key" if self.stack[-1]["kind"] == "o" else "value"
        elif ch in "}]" and self._may_close(ch, e):
            self._out(ch)
            self.stack.pop()
            if self.capture_depth > len(self.stack):
                self.capture_depth = 0
            self._end_value()
        else:
            self.failed = True

    def _may_close(self, ch: str, expect: str) -> bool:
        if not self.stack:
            return False
        kind = self.stack[-1]["kind"]
        if ch == "}":
            return kind == "o" and expect in ("first_key", "after")
        return kind == "a" and expect in ("first_item", "after")

    def _start_value(self, ch: str) -> None:
        if ch in "{[":
            top = self.stack[0] if len(self.stack) == 1 else None
            if (ch == "{" and top is not None and top["key"] == "arguments"
                    and self.name is not None and not self.args_parts):
                self.capture_depth = 2
            self._out(ch)
            self.stack.append({"kind": "o" if ch == "{" else "a", "keys": set(), "key": None})
            self.expect = "first_key" if ch == "{" else "first_item"
        elif ch == '"':
            self.tok, self.is_key, self.chars = "str", False, []
            self._out('"')
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self.tok, self.chars = "num", [ch]
        elif ch in "tfn":
            self.tok, self.chars = "lit", [ch]
        else:
            self.failed = True

    def _end_value(self) -> None:
        self.tok = None
        self.expect = "after" if self.stack else "end"

    def _string_char(self, ch: str) -> None:
        if self.esc is not None:
            self._escape_char(ch)
        elif ch == "\\":
            self.esc = "\\"
        elif ch == '"':
            self._flush_high()
            self._out('"')
            self._end_string("".join(self.chars))
        elif ch < " ":
            self.failed = True
        else:
            self._decoded(ch)

    def _escape_char(self, ch: str) -> None:
        if self.esc == "\\":
            if ch == "u":
                self.esc = "\\u"
            elif ch in _SIMPLE_ESCAPES:
                self.esc = None
                self._decoded(_SIMPLE_ESCAPES[ch])
            else:
                self.failed = True
            return
        if ch not in _HEX:
            self.failed = True
            return
        self.esc += ch
        if len(self.esc) == 6:
            code, self.esc = int(self.esc[2:], 16), None
            self._code_point(code)

    def _code_point(self, code: int) -> None:
        """A \\uXXXX escape; a high surrogate followed directly by a low one makes one
        character, as Python's json does; unpaired surrogates stay lone."""
        if self.high is not None and 0xDC00 <= code <= 0xDFFF:
            high, self.high = self.high, None
            self._decoded(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
        elif 0xD800 <= code <= 0xDBFF:
            self._flush_high()
            self.high = code
        else:
            self._decoded(chr(code))

    def _flush_high(self) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            self._emit_char(chr(high))

    def _decoded(self, ch: str) -> None:
        self._flush_high()
        self._emit_char(ch)

    def _emit_char(self, ch: str) -> None:
        self.chars.append(ch)
        self._out(_escape(ch))

    def _end_string(self, value: str) -> None:
        frame = self.stack[-1] if self.stack else None
        if self.is_key:
            if value in frame["keys"]:
                self.failed = True  # duplicate key: the call is rejected at its close
                return
            frame["keys"].add(value)
            frame["key"] = value
            self.tok, self.expect = None, "colon"
            return
        if (len(self.stack) == 1 and frame["kind"] == "o" and frame["key"] == "name"
                and value and self.name is None):
            self.name = value
        self._end_value()

    def _end_number(self) -> None:
        text = "".join(self.chars)
        try:
            if not _NUMBER.fullmatch(text):
                raise ValueError(text)
            is_float = any(c in text for c in ".eE")
            value = _finite_float(text) if is_float else int(text)
        except ValueError:
            self.failed = True
            return
        self._out(json.dumps(value))
        self._end_value()

    def _literal_char(self, ch: str) -> None:
        word = "".join(self.chars) + ch
        matches = [w for w in _LITERALS if w.startswith(word)]
        if not matches:
            self.failed = True
            return
        self.chars.append(ch)
        if word in _LITERALS:
            self._out(word)
            self._end_value()


# ---- streaming ----------------------------------------------------------------------------
class _BlockStream:
    """One <tool_call> block being sampled: emits ParsedCallStart once the name is known and the
    arguments' canonical JSON as it arrives; the verdict comes at the close tag."""

    def __init__(self, index: int, lenient: bool):
        self.index, self.lenient = index, lenient
        self.raw = CALL_OPEN
        self.scanner = _JsonScanner()
        self.lexical = [False, False]  # _scan_to_close state: in a JSON string, after "\\"
        self.started = False
        self.sent = 0  # how many scanner.args_parts were sent

    def feed(self, text: str, out: list[Event]) -> None:
        self.raw += text
        self.scanner.feed(text)
        if not self.started and self.scanner.name is not None:
            self.started = True
            out.append(ParsedCallStart(self.index, self.scanner.name))
        parts = self.scanner.args_parts
        if self.started and len(parts) > self.sent:
            out.append(ParsedCallArgs(self.index, "".join(parts[self.sent:])))
            self.sent = len(parts)

    def close(self, out: list[Event]) -> None:
        raw = self.raw + CALL_CLOSE
        try:
            name, args, _ = parse_call_json(raw[len(CALL_OPEN):-len(CALL_CLOSE)], self.lenient)
        except ParseError as e:
            out.append(ErrorEvent(str(e), raw))
            return
        sent = "".join(self.scanner.args_parts[:self.sent]) if self.started else ""
        if self.started and (name != self.scanner.name or not args.startswith(sent)):
            out.append(ErrorEvent("streamed tool call diverged from its parse", raw))
            return
        if not self.started:
            self.started = True
            out.append(ParsedCallStart(self.index, name))
        if len(args) > len(sent):
            out.append(ParsedCallArgs(self.index, args[len(sent):]))
        out.append(ParsedCallEnd(self.index, name, args, raw))


_BEFORE, _BLOCK, _GAP, _GAP_TEXT, _DONE = "before", "block", "gap", "gap_text", "done"


class ChatMLStreamParser:
    """One per request: `feed(delta)` -> events, `finish()` at EOS or limit.

    Partial `<tool_call>`, `</tool_call>` and `<|im_end|>` markers are held back, as is the "\\n"
    that may separate content from a first block, so nothing half-formed leaks. For any split
    of a completion, the events equal `ChatMLDialect.parse_events` of the whole text (text in
    the same places, the same calls and errors). `lenient` only selects which blocks are
    accepted (`parse_call_json`); text is streamed as text in both modes.
    """

    def __init__(self, lenient: bool = True):
        self._lenient = lenient
        self._mode = _BEFORE
        self._buf = ""
        self._block: _BlockStream | None = None
        self._n_calls = 0

    def feed(self, delta: str) -> list[Event]:
        out: list[Event] = []
        if not delta or self._mode == _DONE:
            return out
        self._buf += delta
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._mode == _BLOCK:
            out.append(ErrorEvent(_UNCLOSED, self._block.raw + self._buf))
        elif self._mode in (_BEFORE, _GAP_TEXT) or (self._mode == _GAP
                                                     and not _is_blank(self._buf)):
            self._text(out, self._buf)
        self._mode, self._buf = _DONE, ""
        return out

    def next_kind(self) -> str:
        """STRUCTURE or PAYLOAD for the next sampled position (see ChatMLSyntaxTracker)."""
        if self._mode in (_BEFORE, _GAP_TEXT):
            held = partial_stop_len(self._buf, (CALL_OPEN, IM_END))
            return STRUCTURE if held else PAYLOAD
        if self._mode == _BLOCK and not self._buf:
            return self._block.scanner.kind()
        return STRUCTURE

    # --- internals -------------------------------------------------------------------------
    def _text(self, out: list[Event], text: str) -> None:
        if text:
            out.append(ParsedText(text))

    def _step(self, out: list[Event]) -> bool:
        """Consume what can be decided in the buffer; True when the mode changed."""
        if self._mode == _BLOCK:
            return self._step_block(out)
        buf = self._buf
        i_call, i_end = buf.find(CALL_OPEN), buf.find(IM_END)
        if i_end >= 0 and (i_call < 0 or i_end < i_call):
            if self._mode != _GAP or not _is_blank(buf[:i_end]):
                self._text(out, buf[:i_end])
            self._mode, self._buf = _DONE, ""
            return False
        if i_call >= 0:
            text = buf[:i_call]
            if self._mode == _BEFORE and text.endswith("\n"):
                text = text[:-1]
            if self._mode != _GAP or not _is_blank(text):
                self._text(out, text)
            self._buf = buf[i_call + len(CALL_OPEN):]
            self._mode, self._block = _BLOCK, _BlockStream(self._n_calls, self._lenient)
            return True
        return self._step_undecided(out)

    def _step_undecided(self, out: list[Event]) -> bool:
        """No complete marker in the buffer: emit what cannot start one."""
        buf = self._buf
        safe = len(buf) - partial_stop_len(buf, (CALL_OPEN, IM_END))
        if self._mode == _GAP:
            if _is_blank(buf[:safe]):
                return False           # still a separator, or the start of a marker
            self._mode = _GAP_TEXT     # the whole gap is text (lenient: text between calls)
            return True
        if self._mode == _BEFORE and buf[:safe].endswith("\n"):
            safe -= 1                  # may be the separator before a first block
        self._text(out, buf[:safe])
        self._buf = buf[safe:]
        return False

    def _step_block(self, out: list[Event]) -> bool:
        buf, block = self._buf, self._block
        i_end = buf.find(IM_END)
        limit = i_end if i_end >= 0 else len(buf) - partial_stop_len(buf, (IM_END,))
        used, closed = _scan_to_close(buf[:limit], block.lexical)
        block.feed(buf[:used], out)
        if closed:
            block.close(out)
            self._end_block(block)
            self._buf, self._mode = buf[used + len(CALL_CLOSE):], _GAP
            return True
        if i_end >= 0:                 # <|im_end|> before the close: the message ended
            out.append(ErrorEvent(_UNCLOSED, block.raw + buf[used:i_end]))
            self._end_block(block)
            self._mode, self._buf = _DONE, ""
            return False
        self._buf = buf[used:]         # a possible partial "</tool_call>" or "<|im_end|>"
        return False

    def _end_block(self, block: _BlockStream) -> None:
        if block.started:
            self._n_calls += 1
        self._block = None


class ChatMLSyntaxTracker:
    """Classifies the next sampled position of an assistant message as STRUCTURE (the
    `<tool_call>` tags, JSON punctuation, keys, whitespace between them, a partial marker) or
    PAYLOAD (plain content, JSON values: strings, numbers, literals, the tool name), so the
    sampler can decode structure greedily and payload with the request's settings."""

    def __init__(self):
        self._parser = ChatMLStreamParser(lenient=True)

    def feed(self, delta: str) -> str:
        """Advance by the sampled text; returns the kind of the next position."""
        self._parser.feed(delta)
        return self._parser.next_kind()

    def next_kind(self) -> str:
        return self._parser.next_kind()


# ---- the dialect --------------------------------------------------------------------------
class ChatMLDialect:
    """SmolLM2/Qwen ChatML with `<tool_call>` JSON blocks (shared/specs/chatml-tools.md).

    Options of other dialects (thinking_mode, reasoning_effort, ...) are accepted and ignored:
    ChatML has no reasoning channel."""

    name = "chatml"
    stop_strings = (IM_END,)
    tool_openers = (CALL_OPEN,)

    def thinking_mode(self, thinking: bool | None) -> str:
        """Always "chat": ChatML has no reasoning channel."""
        return "chat"

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, default_system: str = DEFAULT_SYSTEM,
               **_other_dialects_options) -> str:
        return "".join(s.text for s in self.render_segments(
            messages, tools, add_generation_prompt=add_generation_prompt,
            default_system=default_system))

    def render_segments(self, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = True,
                        default_system: str = DEFAULT_SYSTEM,
                        **_other_dialects_options) -> list[Segment]:
        """The prompt as segments: only the template's own <|im_start|>/<|im_end|> are control;
        all message text (and role names, tool JSON) is plain."""
        system = [_text_of(m.get("content")) for m in messages
                  if m.get("role") in ("system", "developer")]
        out = _Segments()
        out.turn("system", _system_text(system or None, default_system, tools))
        for role, text in _turns(messages):
            out.turn(role, text)
        if add_generation_prompt:
            out.control(IM_START)
            out.text("assistant\n")
        return out.segments

    def parse(self, text: str, lenient: bool = False, **_other_dialects_options) -> ParsedMessage:
        """Sampled assistant text -> content and tool calls (see the module grammar). Strict
        raises ParseError on the first malformed part; lenient notes each leniency instead."""
        scan, block_raw = _scan(text, lenient)
        content = "".join(e.text for e in scan.events if isinstance(e, ParsedText))
        calls = tuple(ToolCall(e.name, e.arguments, e.raw) for e in scan.events
                      if isinstance(e, ParsedCallEnd))
        return ParsedMessage(content=content, tool_calls=calls, tool_block_raw=block_raw,
                             notes=tuple(scan.notes))

    def parse_events(self, text: str) -> list[Event]:
        """The lenient one-shot parse as events (one ParsedText per text run, one args fragment
        per call, an ErrorEvent with the raw text per malformed or unclosed block)."""
        return _scan(text, lenient=True)[0].events

    def stream_parser(self, lenient: bool = True,
                      **_other_dialects_options) -> ChatMLStreamParser:
        return ChatMLStreamParser(lenient=lenient)

    def syntax_tracker(self, **_other_dialects_options) -> ChatMLSyntaxTracker:
        return ChatMLSyntaxTracker()

    def grammar(self, demand, token_id=None, **_other_dialects_options) -> str:
        """`<tool_call>` JSON blocks or an answer (chatml_grammar.py); no special token ids are
        needed."""
        return chatml_grammar.grammar(demand)

    def render_tool_calls(self, calls: Iterable[tuple[str, object]]) -> str:
        """Canonical blocks joined by "\\n"; arguments as JSON text (or an already parsed
        object)."""
        return "\n".join(_canonical_call(n, a) for n, a in calls)
