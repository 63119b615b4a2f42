"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) <-> neutral types.

Shaped by what real clients send (the spec's section 0): `system` as a string or text blocks
(Claude Code's per-request billing-header block is dropped so the prompt, and so the cache
prefix, stays stable), `role: "system"` inside `messages`, `cache_control` and unknown fields
anywhere (ignored), thinking blocks replayed with our signatures (verified by the session; a bad
one degrades that message, never the request), `redacted_thinking` for our encrypted blobs
(`thinking.display: "omitted"` asks for them), and the SDK tool runner's server-side `thread`.
Streams follow the documented event order: message_start, per block content_block_start /
deltas / content_block_stop, message_delta (cumulative usage), message_stop; `ping` keeps a long
prefill alive. Usage reports reused prompt tokens as `cache_read_input_tokens`.
Constraints: `tool_choice` (`auto` / `any` / `tool` / `none`, `disable_parallel_tool_use`),
tool `strict`, `output_config.format` ({"type": "json_schema", "schema"}: the answer is JSON that
validates) and `thinking.budget_tokens` (a cap on open reasoning) map to the neutral fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from zen5.api import ApiContext, new_id, sampling, sse
from zen5.api.conversations import Conversation, Reply
from zen5.api.errors import ApiError, anthropic_body, bad_request
from zen5.api.fields import (
    at,
    get_bool,
    get_int,
    get_list,
    get_num,
    get_obj,
    get_stop,
    get_str,
    obj,
    one_of,
    output_format,
    text_parts,
)
from zen5.chat_types import (
    ChatRequest,
    Finish,
    Message,
    RedactedThinkingBlock,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDone,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
)
from zen5.signatures import drop_unproven_thinking

STYLE = "anthropic"
_BILLING_HEADER = "x-anthropic-billing-header:"
_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_fields(finish: Finish | None) -> dict:
    """stop_reason and stop_sequence: "stop_sequence" and the string when one of the request's
    stop_sequences ended the reply."""
    if finish is not None and finish.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": finish.stop_sequence}
    return {"stop_reason": _STOP_REASON[finish.reason if finish else "stop"], "stop_sequence": None}


@dataclass
class Turn:
    id: str                               # msg_…: the reply's id (and a thread's key)
    model: str
    stream: bool
    request: ChatRequest
    history: tuple[Message, ...]          # the conversation without the system prompt
    system: tuple[Message, ...]
    threaded: bool                        # keep this conversation for `thread: continue`

    def start(self, session):
        # the stored history keeps only what the prompt renders (decided by the session's
        # signer, on the worker that owns it; `remember` runs after the reply has finished)
        self.history = drop_unproven_thinking(self.history, session.signer)
        return session.chat(self.request)


# ---- request ---------------------------------------------------------------------------------
def parse(body: dict, api_ctx: ApiContext, *, count_only: bool = False) -> Turn:
    model = get_str(body, "model", required=True)
    max_tokens = None if count_only else get_int(body, "max_tokens", required=True, minimum=1)
    prior, threaded = _thread(body, api_ctx)
    system = _system(body.get("system"), "system") if "system" in body or prior is None else prior.system
    tools = _tools(get_list(body, "tools")) if "tools" in body or prior is None else prior.tools
    history = (prior.messages if prior else ()) + _messages(get_list(body, "messages", required=prior is None))
    if not history:
        raise bad_request("messages: at least one message is required", param="messages")
    if history[-1].role == "assistant":
        raise bad_request("messages: the last message is from the assistant (a prefill); this server "
                          "always starts a new assistant turn, so end with a user message", param="messages")
    thinking, redact, budget = _thinking(get_obj(body, "thinking"))
    choice, parallel = _tool_choice(get_obj(body, "tool_choice"))
    try:
        request = ChatRequest(
            system + history, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
            response_format=_output_format(get_obj(body, "output_config")), thinking_budget=budget,
            sampling=sampling(get_num(body, "temperature", low=0, high=2), get_num(body, "top_p", low=0, high=1),
                              get_int(body, "top_k", minimum=0)),
            max_tokens=api_ctx.max_tokens(max_tokens), stop=get_stop(body, "stop_sequences"),
            thinking=thinking, redact_thinking=redact, id_prefix="toolu_")
    except ValueError as e:
        raise bad_request(str(e)) from None
    api_ctx.check_prompt_bytes(request.text_bytes(), "messages")
    return Turn(new_id("msg_"), model, get_bool(body, "stream"), request, history, system, threaded)


def _thread(body: dict, api_ctx: ApiContext) -> tuple[Conversation | None, bool]:
    """`thread: {"type": "create"}` or `{"type": "continue", "previous_message_id": …}` (the SDK
    tool runner's default). An unknown id answers `error.details.error_code: thread_not_found`,
    on which the SDK replays the whole history under a new thread."""
    if body.get("thread") is None:
        return None, False
    t = get_obj(body, "thread")
    kind = get_str(t, "type", "thread", required=True)
    if kind == "create":
        return None, True
    if kind != "continue":
        raise bad_request(f"thread.type: expected 'create' or 'continue', got {kind!r}", param="thread.type")
    prev = get_str(t, "previous_message_id", "thread", required=True)
    conv = api_ctx.conversations.get(prev)
    if conv is None:
        raise ApiError(400, f"thread.previous_message_id {prev} is not held by this server (evicted or "
                            "from before a restart); send the full history with thread type 'create'",
                       param="thread.previous_message_id", details={"error_code": "thread_not_found"})
    return conv, True


def _system(value, path: str) -> tuple[Message, ...]:
    if value is None:
        return ()
    if isinstance(value, list):  # drop Claude Code's per-request billing header block
        value = [b for b in value if not (isinstance(b, dict) and
                                          str(b.get("text", "")).startswith(_BILLING_HEADER))]
        texts = [text_parts([b], at(path, i), ("text",)) for i, b in enumerate(value)]
        text = "\n".join(t for t in texts if t)
    else:
        text = text_parts(value, path, ("text",))
    return (Message.text("system", text),) if text else ()


def _messages(items: list) -> tuple[Message, ...]:
    """Wire messages -> neutral ones; consecutive user turns merge, as the API merges them."""
    out: list[Message] = []
    for i, item in enumerate(items):
        m, path = obj(item, at("messages", i)), at("messages", i)
        role = get_str(m, "role", path, required=True)
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{path}.role: expected 'user', 'assistant' or 'system', got {role!r}",
                              param=f"{path}.role")
        content = m.get("content")
        if role == "system":
            msg = Message.text("system", text_parts(content, f"{path}.content", ("text",)))
        elif isinstance(content, str):
            msg = Message.text(role, content)
        elif isinstance(content, list):
            msg = Message(role, tuple(_block(obj(b, at(f"{path}.content", j)), at(f"{path}.content", j), role)
                                      for j, b in enumerate(content)))
        else:
            raise bad_request(f"{path}.content: expected a string or an array of content blocks",
                              param=f"{path}.content")
        if out and role == "user" and out[-1].role == "user":
            out[-1] = Message("user", out[-1].blocks + msg.blocks)
        else:
            out.append(msg)
    return tuple(out)


def _block(b: dict, path: str, role: str):
    kind = get_str(b, "type", path, required=True)
    if kind == "text":
        return TextBlock(get_str(b, "text", path, required=True))
    if kind == "tool_result" and role == "user":
        return ToolResultBlock(get_str(b, "tool_use_id", path, required=True),
                               text_parts(b.get("content", ""), f"{path}.content", ("text",)),
                               get_bool(b, "is_error", path))
    if kind == "tool_use" and role == "assistant":
        value = b.get("input", {})
        if not isinstance(value, dict):
            raise bad_request(f"{path}.input: expected an object", param=f"{path}.input")
        return ToolUseBlock.from_input(get_str(b, "id", path, required=True),
                                       get_str(b, "name", path, required=True), value)
    if kind == "thinking" and role == "assistant":
        return ThinkingBlock(get_str(b, "thinking", path, default=""), get_str(b, "signature", path))
    if kind == "redacted_thinking" and role == "assistant":
        return RedactedThinkingBlock(get_str(b, "data", path, required=True))
    if kind in ("image", "document"):
        raise bad_request(f"{path}: {kind} blocks are not supported; this server's models read text only",
                          param=path)
    raise bad_request(f"{path}: content block type {kind!r} is not supported in a {role} message",
                      param=path)


def _tools(items: list) -> tuple[ToolSpec, ...]:
    """Client tools. Deferred tools (`defer_loading: true`) stay out of the prompt, as the API keeps
    them out of the context until searched; Anthropic-run server tools are not ours to run."""
    out = []
    for i, item in enumerate(items):
        t, path = obj(item, at("tools", i)), at("tools", i)
        if t.get("defer_loading") is True:
            continue
        if t.get("type") not in (None, "custom") and "input_schema" not in t:
            continue
        schema = get_obj(t, "input_schema", path, required=True)
        out.append(ToolSpec(get_str(t, "name", path, required=True),
                            get_str(t, "description", path, default=""), schema,
                            strict=get_bool(t, "strict", path)))
    return tuple(out)


def _tool_choice(tc: dict) -> tuple[str | dict, bool]:
    """(neutral tool_choice, parallel calls allowed) from {"type": "auto" | "any" | "tool" |
    "none", "name", "disable_parallel_tool_use"}."""
    kind = one_of(get_str(tc, "type", "tool_choice", default="auto"), ("auto", "any", "tool", "none"),
                  "tool_choice.type")
    parallel = not get_bool(tc, "disable_parallel_tool_use", "tool_choice")
    if kind == "tool":
        return {"name": get_str(tc, "name", "tool_choice", required=True)}, parallel
    return {"any": "required", "none": "none", "auto": "auto"}[kind], parallel


def _output_format(config: dict) -> dict | None:
    """`output_config.format`: {"type": "json_schema", "schema"}; the answer always follows the
    schema (structured outputs are strict in this API). `output_config.effort` is ignored."""
    if config.get("format") is None:
        return None
    fmt = get_obj(config, "format", "output_config")
    return output_format(fmt, "output_config.format", strict_default=True, types=("json_schema",))


def _thinking(t: dict) -> tuple[bool | None, bool, int | None]:
    """(thinking on/off/model default, return it redacted, the reasoning token budget): the
    budget is `budget_tokens` of {"type": "enabled"} (a cap the dialect enforces when it reasons
    in the open, as DeepSeek V4 does)."""
    kind = t.get("type")
    on = {"enabled": True, "adaptive": True, "disabled": False}.get(kind)
    budget = get_int(t, "budget_tokens", "thinking", minimum=0) if kind == "enabled" else None
    return on, on is not False and t.get("display") == "omitted", budget


# ---- response --------------------------------------------------------------------------------
def usage(source: Finish | Usage | None) -> dict:
    u = source.usage if isinstance(source, Finish) else source
    return {"input_tokens": u.prefilled_tokens if u else 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.reused_tokens if u else 0,
            "output_tokens": u.completion_tokens if u else 0}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _content(part) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if isinstance(part, ThinkingDone):
        if part.encrypted:
            return {"type": "redacted_thinking", "data": part.encrypted}
        return {"type": "thinking", "thinking": part.text, "signature": part.signature}
    return {"type": "tool_use", "id": part.id, "name": part.name, "input": _tool_input(part.arguments)}


def body(turn: Turn, reply: Reply, api_ctx: ApiContext) -> dict:
    return {"id": turn.id, "type": "message", "role": "assistant", "model": turn.model,
            "content": [_content(p) for p in reply.parts], **_stop_fields(reply.finish),
            "usage": usage(reply.finish)}


def count_body(n_tokens: int) -> dict:
    return {"input_tokens": n_tokens}


def remember(turn: Turn, reply: Reply, api_ctx: ApiContext) -> None:
    if turn.threaded:
        api_ctx.conversations.put(turn.id, Conversation(turn.history + (reply.message(),),
                                                    turn.request.tools, turn.system))


class Stream:
    """Neutral events -> Anthropic SSE. `index` is the position of the open block in `content`."""

    def __init__(self, turn: Turn, api_ctx: ApiContext):
        self.turn = turn
        self.index = -1
        self.open: str | None = None          # "text" | "thinking" | "tool_use"

    def start(self, planned: Usage | None = None) -> str:
        """message_start, sent before the prefill: its input counts are the plan's (the API
        sends them here; message_delta repeats the measured ones, cumulative)."""
        msg = {"id": self.turn.id, "type": "message", "role": "assistant", "model": self.turn.model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(planned)}
        return sse({"type": "message_start", "message": msg}, "message_start")

    def keepalive(self) -> str:
        return sse({"type": "ping"}, "ping")

    def error(self, err: ApiError) -> str:
        return sse(anthropic_body(err, ""), "error")

    def _begin(self, kind: str, block: dict) -> str:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + sse({"type": "content_block_start", "index": self.index, "content_block": block},
                         "content_block_start")

    def _close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _delta(self, delta: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def event(self, ev) -> str:
        if isinstance(ev, ThinkingDelta):
            out = "" if self.open == "thinking" else self._begin(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return out + self._delta({"type": "thinking_delta", "thinking": ev.text})
        if isinstance(ev, ThinkingDone):
            if ev.encrypted:
                out = self._begin("redacted", {"type": "redacted_thinking", "data": ev.encrypted})
                return out + self._close()
            out = "" if self.open == "thinking" else self._begin(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return out + self._delta({"type": "signature_delta", "signature": ev.signature}) + self._close()
        if isinstance(ev, TextDelta):
            out = "" if self.open == "text" else self._begin("text", {"type": "text", "text": ""})
            return out + self._delta({"type": "text_delta", "text": ev.text})
        if isinstance(ev, ToolCallStart):
            return self._begin("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        if isinstance(ev, ToolCallDelta):
            return self._delta({"type": "input_json_delta", "partial_json": ev.fragment})
        if isinstance(ev, ToolCallDone):
            return self._close()
        if isinstance(ev, Finish):
            delta = _stop_fields(ev)
            return (self._close() + sse({"type": "message_delta", "delta": delta, "usage": usage(ev)},
                                        "message_delta")
                    + sse({"type": "message_stop"}, "message_stop"))
        return ""
