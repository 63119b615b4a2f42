"""DeepSeek V4 chat dialect: the exact prompt text the model was trained on, and DSML tool calls.

Why this module is shaped the way it is:

* DeepSeek V4 ships no Jinja template. The model was trained on the text produced by DeepSeek's own
  Python encoder (`encoding/encoding_dsv4.py` beside the weights), and every byte matters twice:
  for the model's behaviour and for prefix-cache keys. `encode_messages` therefore reproduces that
  encoder byte for byte, quirks included (each quirk is marked "official:" where it happens), and
  `parse_message_from_completion_text` reproduces its strict parser, so code written against the
  official module runs unchanged. (During development both were fuzzed against a transcription
  of the official file; tests/dialects/test_deepseek_v4.py pins the expected strings.)
* The renderer builds `Segment`s, not a bare string: the template's own markers (BOS, EOS,
  `<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`, `｜DSML｜`, `<｜latest_reminder｜>`, task
  tokens) are control pieces, every piece of message text is plain text. The session layer
  tokenizes control pieces with special tokens recognised and the rest without, so text typed by a
  user or returned by a tool can never forge a turn boundary or a tool call.
  `encode_messages(...) == "".join(s.text for s in segments)` always.
* The special strings, the DSML framing and the official strict parser are the dialect's syntax
  (`deepseek_v4_syntax.py`), re-exported here so code written against the official module finds
  them where it expects.
* Serving needs more than the official strict parser: streaming, explicit leniency, a syntax
  tracker for greedy DSML decoding. Those live in `deepseek_v4_stream.py`; the lenient one-shot
  parse *is* the stream parser fed the whole text, so streamed and one-shot results agree by
  construction. Constrained decoding writes the same syntax as a grammar
  (`deepseek_v4_grammar.py`).
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any, Iterable, Optional

from . import deepseek_v4_grammar
from .base import RAW_TOOL_BLOCK, ParsedMessage, Segment
from .deepseek_v4_stream import DeepSeekV4StreamParser, DeepSeekV4SyntaxTracker, parse_lenient
from .deepseek_v4_syntax import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    TASK_TOKENS,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_TAG,
    USER,
    check_options,
    parse_message_from_completion_text,
    parse_strict,
    to_json,
)

__all__ = [
    "encode_messages", "parse_message_from_completion_text", "render_segments",
    "render_tool_calls", "DeepSeekV4Dialect", "BOS", "EOS",
]

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
RESPONSE_FORMAT_PREFIX = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n")

_TOOLS_HEAD = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_TAIL = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas "
               "to invoke tool calls.\n")

_CONTROL_STRINGS = (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML, LATEST_REMINDER,
                    *TASK_TOKENS.values())
_CONTROL_RE = re.compile("|".join(re.escape(s) for s in _CONTROL_STRINGS))


# ---- prompt builder ------------------------------------------------------------------------
class _Prompt:
    """Rendered prompt as (text, control) pieces. On output each control piece is one special
    token and adjacent plain pieces merge, so each plain run is exactly the text between two
    specials (tokenizing runs one by one equals tokenizing the whole string when no plain run
    contains a look-alike)."""

    def __init__(self) -> None:
        self._pieces: list[tuple[str, bool]] = []

    def control(self, marker: str) -> None:
        self._pieces.append((marker, True))

    def text(self, s: str) -> None:
        if s:
            self._pieces.append((s, False))

    def dsml(self, before: str, after: str) -> None:
        """A DSML tag: `before` (ending in "<" or "</"), the DSML marker as one special token,
        then `after` (the tag's name and attributes)."""
        self.text(before)
        self.control(DSML)
        self.text(after)

    def template(self, s: str) -> None:
        """Template-authored text: its special strings are control, the rest plain."""
        pos = 0
        for m in _CONTROL_RE.finditer(s):
            self.text(s[pos:m.start()])
            self.control(m.group())
            pos = m.end()
        self.text(s[pos:])

    def segments(self) -> list[Segment]:
        out: list[Segment] = []
        for text, control in self._pieces:
            if out and not control and not out[-1].control:
                out[-1] = Segment(out[-1].text + text)
            else:
                out.append(Segment(text, control))
        return out

    def __str__(self) -> str:
        return "".join(text for text, _ in self._pieces)


# ---- DSML tool-call blocks -----------------------------------------------------------------
def _dsml_parameters(arguments: Any) -> list[tuple[str, bool, str]]:
    """(key, is_string, value text) in the key order of the arguments JSON."""
    try:
        parsed = json.loads(arguments)
    except Exception:  # official: not JSON (or not a string at all) -> one `arguments` parameter
        parsed = {"arguments": arguments}
    if not isinstance(parsed, dict):
        # The official encoder crashes here (`.items()` on a list/number); we treat valid
        # non-object JSON like non-JSON: one string parameter carrying the raw text.
        parsed = {"arguments": arguments}
    return [(f"{k}", isinstance(v, str), v if isinstance(v, str) else to_json(v))
            for k, v in parsed.items()]


def _render_invoke(out: _Prompt, name: Any, arguments: Any) -> None:
    out.dsml("<", f'invoke name="{name}">\n')
    for i, (key, is_str, value) in enumerate(_dsml_parameters(arguments)):
        out.dsml("\n<" if i else "<", f'parameter name="{key}" string="{"true" if is_str else "false"}">')
        out.text(value)
        out.dsml("</", "parameter>")
    out.dsml("\n</", "invoke>")


def _render_tool_block(out: _Prompt, calls: Iterable[tuple[Any, Any]]) -> None:
    """`"\\n\\n" <｜DSML｜tool_calls> "\\n" invoke ("\\n" invoke)* "\\n" </｜DSML｜tool_calls>`."""
    out.dsml("\n\n<", "tool_calls>\n")
    for i, (name, arguments) in enumerate(calls):
        if i:
            out.text("\n")
        _render_invoke(out, name, arguments)
    out.dsml("\n</", "tool_calls>")


def render_tool_calls(calls: Iterable[tuple[str, str]]) -> str:
    """Canonical DSML block (leading blank line included) for (name, arguments JSON) pairs."""
    out = _Prompt()
    _render_tool_block(out, calls)
    return str(out)


def _render_tools(out: _Prompt, tools: list[dict]) -> None:
    out.template(_TOOLS_HEAD)
    out.text("\n".join(to_json(t["function"]) for t in tools))
    out.template(_TOOLS_TAIL)


# ---- preprocessing (official order: merge, sort, drop) -------------------------------------
def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool messages become tool_result blocks; consecutive user/tool messages share one turn."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        last = merged[-1] if merged else {}
        last_is_turn = last.get("role") == "user" and "content_blocks" in last
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}
            if last_is_turn:
                last["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if last_is_turn and last.get("task") is None:
                last["content_blocks"].append(block)
            else:
                turn = {"role": "user", "content": msg.get("content", ""),
                        "content_blocks": [block]}
                turn.update({k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg})
                merged.append(turn)
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """Stable re-sort of each turn's tool results into the call order of the latest assistant
    message with calls (official: an unknown id gets position 0, so it sorts first)."""
    order: dict[str, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            order = {}
            for i, tc in enumerate(msg["tool_calls"]):
                tc_id = tc.get("id") or tc.get("function", {}).get("id", "")
                if tc_id:
                    order[tc_id] = i
        elif role == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b
                                         for b in msg["content_blocks"]]
    return messages


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _drop_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user/developer turn: assistants lose reasoning, developers disappear."""
    last_user = _last_user_index(messages)
    keep = {"user", "system", "tool", "latest_reminder", "direct_search_results"}
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in keep or i >= last_user:
            out.append(msg)
        elif role == "assistant":
            msg = copy.copy(msg)
            msg.pop("reasoning_content", None)
            out.append(msg)
    return out


# ---- rendering one message -----------------------------------------------------------------
def _render_extras(out: _Prompt, msg: dict) -> None:
    """tools / response_format blocks of a system or developer message."""
    if msg.get("tools"):
        out.text("\n\n")
        _render_tools(out, msg["tools"])
    if msg.get("response_format"):
        out.text("\n\n" + RESPONSE_FORMAT_PREFIX + to_json(msg["response_format"]))


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: text kept, anything else named
        content = "\n\n".join(b.get("text", "") if b.get("type") == "text"
                              else f"[Unsupported {b.get('type')}]" for b in content)
    return f"<tool_result>{content}</tool_result>"


def _render_user(out: _Prompt, msg: dict) -> None:
    out.control(USER)
    blocks = msg.get("content_blocks")
    if not blocks:
        out.text(msg.get("content") or "")
        return
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text") or "")  # official crashes on None; we render ""
        elif kind == "tool_result":
            parts.append(_tool_result_text(block.get("content", "")))
        else:
            parts.append(f"[Unsupported {kind}]")
    out.text("\n\n".join(parts))  # tool output is inserted raw: no escaping at all


def _render_assistant(out: _Prompt, index: int, messages: list[dict], thinking: bool,
                      drop: bool, last_user: int) -> None:
    msg = messages[index]
    prev_has_task = index > 0 and messages[index - 1].get("task") is not None
    if thinking and not prev_has_task and (not drop or index > last_user):
        out.text(msg.get("reasoning_content") or "")
        out.control(THINK_CLOSE)  # the opening <think> was written by the turn transition
    out.text(msg.get("content") or "")
    if msg.get("tool_calls"):
        raw = msg.get(RAW_TOOL_BLOCK)
        if isinstance(raw, str):  # exact replay: the block as the model sampled it
            out.template(raw)
        else:
            _render_tool_block(out, [(tc["function"]["name"], tc["function"]["arguments"])
                                     for tc in msg["tool_calls"]])
    if not msg.get("wo_eos", False):
        out.control(EOS)


def _render_transition(out: _Prompt, index: int, messages: list[dict], thinking: bool,
                       drop: bool, last_user: int) -> None:
    """After a user/developer turn that is last or followed by an assistant/latest_reminder."""
    if index + 1 < len(messages) and \
            messages[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return
    msg = messages[index]
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"invalid task {task!r}; valid tasks: {sorted(TASK_TOKENS)}")
        if task == "action":
            out.control(ASSISTANT)
            out.control(THINK_OPEN if thinking else THINK_CLOSE)
        out.control(TASK_TOKENS[task])
    elif msg.get("role") in ("user", "developer"):
        out.control(ASSISTANT)
        out.control(THINK_OPEN if thinking and (not drop or index >= last_user) else THINK_CLOSE)


def _render_message(out: _Prompt, index: int, messages: list[dict], thinking: bool, drop: bool,
                    reasoning_effort: Optional[str], last_user: int) -> None:
    msg = messages[index]
    role = msg.get("role")
    if index == 0 and thinking and reasoning_effort == "max":
        out.text(REASONING_EFFORT_MAX)
    if role == "system":
        out.text(msg.get("content") or "")
        _render_extras(out, msg)
    elif role == "developer":
        if not msg.get("content"):
            raise ValueError(f"developer message needs content: {msg}")
        out.control(USER)
        out.text(msg["content"])
        _render_extras(out, msg)
    elif role == "user":
        _render_user(out, msg)
    elif role == "latest_reminder":
        out.control(LATEST_REMINDER)
        out.text(f"{msg.get('content')}")  # official: str.format, so None renders as "None"
    elif role == "assistant":
        _render_assistant(out, index, messages, thinking, drop, last_user)
    elif role == "tool":
        raise ValueError("tool messages must be merged into a user turn first")
    else:
        raise ValueError(f"unknown role {role!r}")
    _render_transition(out, index, messages, thinking, drop, last_user)


def _build_prompt(messages: list[dict], thinking_mode: str, drop_thinking: bool,
                  add_default_bos_token: bool, reasoning_effort: Optional[str],
                  context: Optional[list[dict]]) -> _Prompt:
    check_options(thinking_mode, reasoning_effort)
    context = copy.deepcopy(context) if context else []
    messages = _merge_tool_messages(messages)
    messages = _sort_tool_results(context + messages)[len(context):]
    if context:
        context = _sort_tool_results(_merge_tool_messages(context))
    full = context + messages
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in full)  # tools keep all reasoning
    if thinking and drop:
        full = _drop_thinking(full)
        first = len(_drop_thinking(context))
    else:
        first = len(context)
    out = _Prompt()
    if add_default_bos_token and not context:
        out.control(BOS)
    last_user = _last_user_index(full)
    for index in range(first, len(full)):
        _render_message(out, index, full, thinking, drop, reasoning_effort, last_user)
    return out


def encode_messages(messages: list[dict], thinking_mode: str, drop_thinking: bool = True,
                    add_default_bos_token: bool = True, reasoning_effort: Optional[str] = None,
                    *, context: Optional[list[dict]] = None) -> str:
    """The official DeepSeek V4 prompt for OpenAI-style messages, byte for byte.

    `context` (keyword only here; third positional in the official module) is an already-sent
    prefix of the conversation: it shapes the rendering but is not itself rendered.
    """
    return str(_build_prompt(messages, thinking_mode, drop_thinking, add_default_bos_token,
                             reasoning_effort, context))


def render_segments(messages: list[dict], thinking_mode: str, drop_thinking: bool = True,
                    add_default_bos_token: bool = True, reasoning_effort: Optional[str] = None,
                    *, context: Optional[list[dict]] = None) -> list[Segment]:
    """`encode_messages` split into control markers and plain text (see module docstring)."""
    return _build_prompt(messages, thinking_mode, drop_thinking, add_default_bos_token,
                         reasoning_effort, context).segments()


# ---- the Dialect ---------------------------------------------------------------------------
def _attach_tools(messages: list[dict], tools: Optional[list[dict]],
                  response_format: Optional[dict] = None) -> list[dict]:
    """Tools and a response format given beside the messages go on the first system message
    (created empty if none), where the official encoder renders them."""
    for key, value in (("tools", tools), ("response_format", response_format)):
        if value:
            messages = _attach(messages, key, value)
    return messages


def _attach(messages: list[dict], key: str, value) -> list[dict]:
    messages = list(messages)
    for i, msg in enumerate(messages):
        if msg.get("role") == "system":
            if msg.get(key):
                raise ValueError(f"{key} given twice: beside the messages and on the system message")
            messages[i] = {**msg, key: value}
            return messages
    return [{"role": "system", "content": "", key: value}] + messages


class DeepSeekV4Dialect:
    """The `Dialect` of DeepSeek V4 (Flash and Pro). Rendering options are those of
    `encode_messages` (thinking_mode defaults to "thinking"), plus `response_format` (the
    request's, in OpenAI Chat form) rendered on the system message like `tools`; options meant for other dialects
    (e.g. ChatML's add_generation_prompt) are accepted and ignored, so the session layer can
    pass one option set to any dialect."""

    name = "deepseek_v4"
    tool_openers = (TOOL_TAG,)

    def thinking_mode(self, thinking: bool | None) -> str:
        """"thinking" unless the client turned thinking off: V4 reasons by default."""
        return "chat" if thinking is False else "thinking"

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None,
               thinking_mode: str = "thinking", drop_thinking: bool = True,
               reasoning_effort: Optional[str] = None, add_default_bos_token: bool = True,
               context: Optional[list[dict]] = None, response_format: Optional[dict] = None,
               **_other_dialects_options) -> str:
        return encode_messages(_attach_tools(messages, tools, response_format), thinking_mode, drop_thinking,
                               add_default_bos_token, reasoning_effort, context=context)

    def render_segments(self, messages: list[dict], tools: Optional[list[dict]] = None,
                        thinking_mode: str = "thinking", drop_thinking: bool = True,
                        reasoning_effort: Optional[str] = None,
                        add_default_bos_token: bool = True, context: Optional[list[dict]] = None,
                        response_format: Optional[dict] = None,
                        **_other_dialects_options) -> list[Segment]:
        return render_segments(_attach_tools(messages, tools, response_format), thinking_mode, drop_thinking,
                               add_default_bos_token, reasoning_effort, context=context)

    def parse(self, text: str, lenient: bool = False, thinking_mode: str = "thinking",
              **_other_dialects_options) -> ParsedMessage:
        """Strict: the official parser, except that a tool block must be closed (the official
        one accepts some truncated blocks as finished calls). Lenient: see deepseek_v4_stream."""
        if lenient:
            return parse_lenient(text, thinking_mode)
        reasoning, content, calls, block_raw = parse_strict(text, thinking_mode, True)
        return ParsedMessage(reasoning=reasoning, content=content, tool_calls=tuple(calls),
                             tool_block_raw=block_raw)

    def stream_parser(self, lenient: bool = True, thinking_mode: str = "thinking",
                      **_other_dialects_options) -> DeepSeekV4StreamParser:
        return DeepSeekV4StreamParser(thinking_mode=thinking_mode, lenient=lenient)

    def syntax_tracker(self, thinking_mode: str = "thinking",
                       **_other_dialects_options) -> DeepSeekV4SyntaxTracker:
        return DeepSeekV4SyntaxTracker(thinking_mode=thinking_mode)

    def grammar(self, demand, token_id=None, thinking_mode: str = "thinking",
                **_other_dialects_options) -> str:
        """Reasoning (in thinking mode), then an answer or a DSML block
        (deepseek_v4_grammar.py); `token_id` is required: `</think>` and `｜DSML｜` are
        referenced as the single tokens the model was trained on."""
        return deepseek_v4_grammar.grammar(demand, thinking_mode, token_id)

    def render_tool_calls(self, calls: Iterable[tuple[str, str]]) -> str:
        return render_tool_calls(calls)

    @staticmethod
    def to_message(parsed: ParsedMessage) -> dict:
        """An official assistant message dict (no call ids) for a parsed completion."""
        return {"role": "assistant", "content": parsed.content,
                "reasoning_content": parsed.reasoning,
                "tool_calls": [{"type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
                               for c in parsed.tool_calls]}

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (EOS,)
