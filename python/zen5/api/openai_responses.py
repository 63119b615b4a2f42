"""OpenAI Responses (`POST /v1/responses`) <-> neutral types.

Input is a string or a list of items: messages (a missing `type` means a message, as
openai-agents sends them; Codex sends its system prompt as `developer` messages), `function_call`
/ `function_call_output`, and `reasoning` items replayed by clients. A reasoning item is ours when
its `encrypted_content` decrypts (asked for with `include: ["reasoning.encrypted_content"]`,
Codex's `store: false` mode) or when its text is one we emitted (`ReasoningMemory`); anything
else degrades to canonical rendering. `previous_response_id` continues a stored conversation
(`store` defaults to true); the stored form is neutral, instructions excluded, as the API does
not carry them over. Streams are named events with a `sequence_number`, one output item at a time
(added, deltas, done), ending with `response.completed` (Codex retries a stream without it) or
`response.incomplete` when the token limit cut the reply. `include:
["message.output_text.logprobs"]` (or `top_logprobs` > 0) reports the logprobs of the tokens
that made the message text, on each `output_text` delta and in the done events and items;
tokens that made reasoning or a tool call have no place in the Responses shape and are left out.

Constraints: `tool_choice` ("none" | "auto" | "required" | {"type": "function" | "custom",
"name"}), `parallel_tool_calls`, `text.format` (text | json_object | json_schema with name,
schema, strict) and function `strict` map to the neutral fields; both are echoed as sent.
Freeform `custom` tools (Codex's apply_patch) carry `format` {"type": "grammar", "syntax":
"lark" | "regex", "definition"} or {"type": "text"}; their calls come back as `custom_tool_call`
items (`input`, not `arguments`), streamed as `response.custom_tool_call_input.delta` / `.done`,
and a client replays them with `custom_tool_call_output`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from zen5.api import ApiContext, logprob_entries, new_id, sampling, sse
from zen5.api.conversations import Conversation, Reply
from zen5.api.custom_input import CustomInputStream
from zen5.api.errors import ApiError, bad_request
from zen5.api.fields import (
    arguments_text,
    at,
    get_bool,
    get_int,
    get_list,
    get_num,
    get_obj,
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
    SampledToken,
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
)
from zen5.signatures import drop_unproven_thinking

STYLE = "openai"
_TEXT = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ENCRYPTED = "reasoning.encrypted_content"
_LOGPROBS = "message.output_text.logprobs"
_EFFORT = {"high": "high", "xhigh": "max", "max": "max"}


@dataclass
class Turn:
    id: str                                   # resp_…
    model: str
    stream: bool
    request: ChatRequest
    history: tuple[Message, ...]              # the conversation without the instructions
    store: bool
    echo: dict                                # request settings echoed in the response object
    created_at: int = field(default_factory=lambda: int(time.time()))

    def start(self, session):
        # the stored history keeps only what the prompt renders (decided by the session's
        # signer, on the worker that owns it; `remember` runs after the reply has finished)
        self.history = drop_unproven_thinking(self.history, session.signer)
        return session.chat(self.request)


# ---- request ---------------------------------------------------------------------------------
def parse(body: dict, api_ctx: ApiContext) -> Turn:
    model = get_str(body, "model", required=True)
    prev = get_str(body, "previous_response_id")
    prior = api_ctx.conversations.get(prev) if prev else None
    if prev and prior is None:
        raise ApiError(400, f"previous_response_id {prev} is not stored on this server (it was sent "
                            "with store=false, evicted, or is from before a restart); send the full "
                            "input instead", param="previous_response_id", code="previous_response_not_found")
    raw = body.get("input")
    if raw is None:
        raise bad_request("input: this field is required (a string or an array of items)", param="input")
    history = (prior.messages if prior else ()) + _input(raw, api_ctx)
    instructions = get_str(body, "instructions")
    system = (Message.text("system", instructions),) if instructions else ()
    reasoning = get_obj(body, "reasoning")
    effort = get_str(reasoning, "effort", "reasoning")
    tools_wire = get_list(body, "tools")
    parallel = get_bool(body, "parallel_tool_calls", default=True)
    text = get_obj(body, "text")
    fmt = get_obj(text, "format", "text") if text.get("format") is not None else {"type": "text"}
    include = get_list(body, "include")
    top_logprobs = get_int(body, "top_logprobs", minimum=0)
    if top_logprobs is not None and top_logprobs > 20:
        raise bad_request("top_logprobs: at most 20", param="top_logprobs")
    # logprobs of the message text: asked for by the include entry or by wanting alternatives
    logprobs = (top_logprobs or 0) if _LOGPROBS in include or top_logprobs else None
    try:
        request = ChatRequest(
            system + history, tools=_tools(tools_wire), tool_choice=_tool_choice(body.get("tool_choice")),
            parallel_tool_calls=parallel, response_format=output_format(fmt, "text.format"),
            sampling=sampling(get_num(body, "temperature", low=0, high=2), get_num(body, "top_p", low=0, high=1)),
            max_tokens=api_ctx.max_tokens(get_int(body, "max_output_tokens", minimum=1)),
            thinking=False if effort in ("none", "minimal") else None,
            reasoning_effort=_EFFORT.get(effort or ""),
            redact_thinking=_ENCRYPTED in include, id_prefix="call_", logprobs=logprobs)
    except ValueError as e:
        raise bad_request(str(e)) from None
    api_ctx.check_prompt_bytes(request.text_bytes(), "input")
    echo = {"instructions": instructions, "previous_response_id": prev, "tools": tools_wire,
            "tool_choice": body.get("tool_choice", "auto"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "reasoning": {"effort": effort, "summary": reasoning.get("summary")},
            "parallel_tool_calls": parallel, "text": {**text, "format": fmt},
            "top_logprobs": top_logprobs, "metadata": body.get("metadata") or {}}
    return Turn(new_id("resp_"), model, get_bool(body, "stream"), request, history,
                get_bool(body, "store", default=True), echo)


def _input(raw, api_ctx: ApiContext) -> tuple[Message, ...]:
    if isinstance(raw, str):
        return (Message.text("user", raw),)
    if not isinstance(raw, list):
        raise bad_request("input: expected a string or an array of items", param="input")
    return tuple(_item(obj(it, at("input", i)), at("input", i), api_ctx) for i, it in enumerate(raw))


def _item(it: dict, path: str, api_ctx: ApiContext) -> Message:
    kind = it.get("type") or "message"
    if kind == "message":
        role = get_str(it, "role", path, required=True)
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{path}.role: expected user, assistant, system or developer, got {role!r}",
                              param=f"{path}.role")
        return Message.text(role, _content_text(it.get("content"), f"{path}.content"))
    if kind == "function_call":
        return Message("assistant", (ToolUseBlock(get_str(it, "call_id", path, required=True),
                                                  get_str(it, "name", path, required=True),
                                                  arguments_text(it.get("arguments", "{}"), f"{path}.arguments")),))
    if kind == "custom_tool_call":
        return Message("assistant", (ToolUseBlock.from_custom_input(get_str(it, "call_id", path, required=True),
                                                                    get_str(it, "name", path, required=True),
                                                                    get_str(it, "input", path, default="")),))
    if kind in ("function_call_output", "custom_tool_call_output"):
        return Message("tool", (ToolResultBlock(get_str(it, "call_id", path, required=True),
                                                _content_text(it.get("output", ""), f"{path}.output")),))
    if kind == "reasoning":
        return Message("assistant", (_reasoning(it, path, api_ctx),))
    if kind == "item_reference":
        raise bad_request(f"{path}: item_reference is not supported; send the item itself, or continue "
                          "with previous_response_id", param=path)
    raise bad_request(f"{path}: input item type {kind!r} is not supported", param=path)


def _content_text(content, path: str) -> str:
    if isinstance(content, list):  # a refusal part carries `refusal`, not `text`
        content = [{"type": "text", "text": p.get("refusal", "")} if isinstance(p, dict) and
                   p.get("type") == "refusal" else p for p in content]
    return text_parts(content, path, _TEXT)


def _reasoning(it: dict, path: str, api_ctx: ApiContext):
    encrypted = get_str(it, "encrypted_content", path)
    if encrypted:
        return RedactedThinkingBlock(encrypted)
    parts = it.get("content") or it.get("summary") or []
    text = _content_text(parts, f"{path}.content")
    return ThinkingBlock(text, api_ctx.reasoning.signature_for(text))


def _tools(items: list, path: str = "tools") -> tuple[ToolSpec, ...]:
    """Flat function tools (`strict` honoured) and freeform `custom` tools (Codex's apply_patch:
    `format` {"type": "text"} or {"type": "grammar", "syntax": "lark" | "regex", "definition"});
    a `namespace` contributes its tools; built-in tools are not offered to the model."""
    out = []
    for i, item in enumerate(items):
        t, tpath = obj(item, at(path, i)), at(path, i)
        kind = t.get("type", "function")
        if kind == "namespace":
            out.extend(_tools([x for x in get_list(t, "tools", tpath) if isinstance(x, dict)], f"{tpath}.tools"))
        elif kind == "function":
            params = get_obj(t, "parameters", tpath) or {"type": "object", "properties": {}}
            out.append(ToolSpec(get_str(t, "name", tpath, required=True),
                                get_str(t, "description", tpath, default=""), params,
                                strict=get_bool(t, "strict", tpath)))
        elif kind == "custom":
            out.append(_custom_tool(t, tpath))
    return tuple(out)


def _custom_tool(t: dict, path: str) -> ToolSpec:
    name, about = get_str(t, "name", path, required=True), get_str(t, "description", path, default="")
    fmt = get_obj(t, "format", path)
    kind = one_of(get_str(fmt, "type", f"{path}.format", default="text"), ("text", "grammar"), f"{path}.format.type")
    if kind == "text":
        return ToolSpec(name, about, kind="custom")
    syntax = one_of(get_str(fmt, "syntax", f"{path}.format", required=True), ("lark", "regex"),
                    f"{path}.format.syntax")
    return ToolSpec(name, about, kind="custom", grammar=get_str(fmt, "definition", f"{path}.format", required=True),
                    grammar_syntax=syntax)


def _tool_choice(tc):
    """tool_choice: "none" | "auto" | "required" | {"type": "function" | "custom", "name": ...}."""
    if tc is None:
        return "auto"
    if isinstance(tc, str):
        return one_of(tc, ("none", "auto", "required"), "tool_choice")
    tc = obj(tc, "tool_choice")
    kind = get_str(tc, "type", "tool_choice", required=True)
    if kind not in ("function", "custom"):
        raise bad_request(f"tool_choice.type: {kind!r} is not supported; use \"none\", \"auto\", \"required\" "
                          "or {\"type\": \"function\" | \"custom\", \"name\": ...}", param="tool_choice.type")
    return {"name": get_str(tc, "name", "tool_choice", required=True)}


# ---- response --------------------------------------------------------------------------------
def usage(finish: Finish | None) -> dict | None:
    if finish is None:
        return None
    u = finish.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.reused_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _response(turn: Turn, output: list, finish: Finish | None, status: str) -> dict:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": turn.id, "object": "response", "created_at": turn.created_at, "status": status,
            "model": turn.model, "output": output, "usage": usage(finish), "error": None,
            "incomplete_details": incomplete, "store": turn.store, "truncation": "disabled", **turn.echo}


def _status(finish: Finish | None) -> str:
    return "incomplete" if finish is not None and finish.reason == "length" else "completed"


def _reasoning_item(item_id: str, done: ThinkingDone) -> dict:
    item = {"type": "reasoning", "id": item_id,
            "summary": [{"type": "summary_text", "text": done.text}] if done.text else []}
    if done.encrypted:
        item["encrypted_content"] = done.encrypted
    return item


def _message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _custom_item(item_id: str, call_id: str, name: str, input: str, status: str = "completed") -> dict:
    return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name, "input": input,
            "status": status}


def _done_item(done: ToolCallDone) -> dict:
    if done.kind == "custom":
        return _custom_item(new_id("ctc_"), done.id, done.name, done.input or "")
    return _call_item(new_id("fc_"), done.id, done.name, done.arguments)


def body(turn: Turn, reply: Reply, api_ctx: ApiContext) -> dict:
    output, texts = [], iter(reply.text_tokens)
    for p in reply.parts:
        if isinstance(p, str):
            output.append(_message_item(new_id("msg_"), p, logprobs=logprob_entries(next(texts, []))))
        elif isinstance(p, ThinkingDone):
            output.append(_reasoning_item(new_id("rs_"), p))
        else:
            output.append(_done_item(p))
    return _response(turn, output, reply.finish, _status(reply.finish))


def remember(turn: Turn, reply: Reply, api_ctx: ApiContext) -> None:
    for t in reply.thinking:
        api_ctx.reasoning.remember(t.text, t.signature)
    if turn.store:
        api_ctx.conversations.put(turn.id, Conversation(turn.history + (reply.message(),)))


class Stream:
    """Neutral events -> Responses SSE. One output item is open at a time; `output` collects the
    finished items for the terminal event (the SDK checks they match what was streamed)."""

    def __init__(self, turn: Turn, api_ctx: ApiContext):
        self.turn = turn
        self.seq = 0
        self.output: list[dict] = []
        self.item: dict | None = None          # the open item (its final form so far)
        self.text = ""                         # text of the open message / reasoning summary
        self.custom: CustomInputStream | None = None  # the open custom tool call's input decoder
        self.sampled: list = []                # tokens sampled since the last event (logprobs)
        self.logprobs: list[dict] = []         # the open message's logprob entries

    def _ev(self, kind: str, **data) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **data}, kind)

    def start(self, planned=None) -> str:
        snap = _response(self.turn, [], None, "in_progress")
        return self._ev("response.created", response=snap) + self._ev("response.in_progress", response=snap)

    def keepalive(self) -> str:
        return ": keep-alive\n\n"

    def error(self, err: ApiError) -> str:
        snap = {**_response(self.turn, self.output, None, "failed"),
                "error": {"code": err.code or "server_error", "message": err.message}}
        return self._ev("response.failed", response=snap)

    def _open(self, item: dict) -> str:
        out = self._close()
        self.item, self.text, self.logprobs = item, "", []
        return out + self._ev("response.output_item.added", output_index=len(self.output), item=item)

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _close(self, status: str = "completed") -> str:
        item = self.item
        if item is None:
            return ""
        out = ""
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            out += self._ev("response.output_text.done", **self._where(), content_index=0, text=self.text,
                            logprobs=self.logprobs)
            out += self._ev("response.content_part.done", **self._where(), content_index=0, part=part)
            item = _message_item(item["id"], self.text, logprobs=self.logprobs)
        elif item["type"] in ("function_call", "custom_tool_call"):
            item = {**item, "status": status}
        out += self._ev("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.item = None
        return out

    def _input_delta(self, text: str) -> str:
        if not text:
            return ""
        self.item["input"] += text
        return self._ev("response.custom_tool_call_input.delta", **self._where(), delta=text)

    def _thinking(self, ev) -> str:
        out = "" if self.item is not None and self.item["type"] == "reasoning" else self._open(
            {"type": "reasoning", "id": new_id("rs_"), "summary": []})
        if isinstance(ev, ThinkingDelta) or (ev.encrypted and ev.text):
            if not self.text:
                out += self._ev("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                part={"type": "summary_text", "text": ""})
            self.text += ev.text
            out += self._ev("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                            delta=ev.text)
        if isinstance(ev, ThinkingDone):
            if self.text:
                part = {"type": "summary_text", "text": self.text}
                out += self._ev("response.reasoning_summary_text.done", **self._where(), summary_index=0,
                                text=self.text)
                out += self._ev("response.reasoning_summary_part.done", **self._where(), summary_index=0,
                                part=part)
            self.item = _reasoning_item(self.item["id"], ev)
            out += self._close()
        return out

    def event(self, ev) -> str:
        if isinstance(ev, SampledToken):   # credited to the event that follows (Reply.text_tokens)
            self.sampled.append(ev)
            return ""
        tokens, self.sampled = self.sampled, []
        if isinstance(ev, (ThinkingDelta, ThinkingDone)):
            return self._thinking(ev)
        if isinstance(ev, TextDelta):
            out = ""
            if self.item is None or self.item["type"] != "message":
                out = self._open(_message_item(new_id("msg_"), "", "in_progress") | {"content": []})
                out += self._ev("response.content_part.added", **self._where(), content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
            self.text += ev.text
            entries = logprob_entries(tokens)
            self.logprobs += entries
            return out + self._ev("response.output_text.delta", **self._where(), content_index=0,
                                  delta=ev.text, logprobs=entries)
        if isinstance(ev, ToolCallStart):
            if ev.kind == "custom":
                self.custom = CustomInputStream()
                return self._open(_custom_item(new_id("ctc_"), ev.id, ev.name, "", "in_progress"))
            return self._open(_call_item(new_id("fc_"), ev.id, ev.name, "", "in_progress"))
        if isinstance(ev, ToolCallDelta) and self.item["type"] == "custom_tool_call":
            return self._input_delta(self.custom.feed(ev.fragment))
        if isinstance(ev, ToolCallDelta):
            self.item["arguments"] += ev.fragment
            return self._ev("response.function_call_arguments.delta", **self._where(), delta=ev.fragment)
        if isinstance(ev, ToolCallDone) and self.item["type"] == "custom_tool_call":
            final = ev.input or ""
            out = self._input_delta(final[len(self.item["input"]):]) if final.startswith(self.item["input"]) else ""
            self.item = {**self.item, "input": final}
            out += self._ev("response.custom_tool_call_input.done", **self._where(), input=final)
            return out + self._close()
        if isinstance(ev, ToolCallDone):
            self.item = {**self.item, "arguments": ev.arguments}
            out = self._ev("response.function_call_arguments.done", **self._where(), arguments=ev.arguments)
            return out + self._close()
        if isinstance(ev, Finish):
            status = _status(ev)
            out = self._close("incomplete")
            kind = "response.completed" if status == "completed" else "response.incomplete"
            return out + self._ev(kind, response=_response(self.turn, self.output, ev, status))
        return ""
