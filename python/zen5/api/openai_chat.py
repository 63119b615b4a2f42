"""OpenAI Chat Completions (`POST /v1/chat/completions`) <-> neutral types.

Messages are system/developer/user/assistant/tool; an assistant turn carries `content` (a string,
"" or null), `tool_calls` with JSON-string `arguments`, and DeepSeek-style `reasoning_content`
(opencode echoes it on tool-call turns). That field has no room for a signature, so thinking we
emitted is recognised by its exact text (`ReasoningMemory`) and replayed exactly; anything else
degrades to canonical rendering in the session. Streams are bare `data:` chunks ending in
`data: [DONE]`: a role chunk, content / `reasoning_content` / tool-call fragments (the first per
call carries id, type and name), a chunk with `finish_reason`, then with
`stream_options.include_usage` a usage chunk with empty `choices`. Reused prompt tokens are
reported as `usage.prompt_tokens_details.cached_tokens`. `tool_choice`, `parallel_tool_calls`,
`response_format` and function `strict` become the neutral constraint fields (constraints.py
enforces them while decoding); a malformed value is a 400 naming the field.

Custom (free-form) tools: `{"type": "custom", "custom": {"name", "description", "format"}}` with
format `{"type": "text"}` (the default) or `{"type": "grammar", "grammar": {"syntax": "lark" |
"regex", "definition"}}`; the input is constrained to the grammar. Their calls come back as
`{"id", "type": "custom", "custom": {"name", "input"}}` (streamed: the first fragment carries id,
type and name, later ones `custom.input` pieces that concatenate to the input), `tool_choice`
`{"type": "custom", "custom": {"name"}}` forces one, and a replayed custom call plus its `tool`
result continue from the live state like a function call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from zen5.api import ApiContext, logprob_entries, new_id, sampling, sse
from zen5.api.conversations import Reply
from zen5.api.custom_input import CustomInputStream
from zen5.api.errors import ApiError, bad_request, openai_body
from zen5.api.fields import (
    arguments_text,
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
    SampledToken,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)

STYLE = "openai"
_TEXT = ("text", "input_text", "output_text")
_EFFORT = {"high": "high", "xhigh": "max", "max": "max"}   # -> DeepSeek V4 reasoning_effort


@dataclass
class Turn:
    id: str
    model: str
    stream: bool
    include_usage: bool
    request: ChatRequest
    created: int = field(default_factory=lambda: int(time.time()))

    def start(self, session):
        return session.chat(self.request)


# ---- request ---------------------------------------------------------------------------------
def parse(body: dict, api_ctx: ApiContext) -> Turn:
    model = get_str(body, "model", required=True)
    if get_int(body, "n", default=1, minimum=1) != 1:
        raise bad_request("n: only n=1 is supported", param="n")
    messages = _messages(get_list(body, "messages", required=True), api_ctx)
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    max_tokens = get_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", minimum=1)
    effort = get_str(body, "reasoning_effort")
    top_logprobs = get_int(body, "top_logprobs", minimum=0)
    if top_logprobs is not None and top_logprobs > 20:
        raise bad_request("top_logprobs: at most 20", param="top_logprobs")
    logprobs = get_bool(body, "logprobs")
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs: requires logprobs: true", param="top_logprobs")
    thinking = {"enabled": True, "disabled": False}.get(get_obj(body, "thinking").get("type"))
    if effort == "none":
        thinking = False
    try:
        request = ChatRequest(
            messages, tools=_tools(get_list(body, "tools")), tool_choice=_tool_choice(body),
            parallel_tool_calls=get_bool(body, "parallel_tool_calls", default=True),
            response_format=_response_format(body),
            sampling=sampling(get_num(body, "temperature", low=0, high=2), get_num(body, "top_p", low=0, high=1),
                              None, get_int(body, "seed")),
            max_tokens=api_ctx.max_tokens(max_tokens), stop=get_stop(body, "stop"),
            thinking=thinking, reasoning_effort=_EFFORT.get(effort or ""), id_prefix="call_",
            logprobs=(top_logprobs or 0) if logprobs else None)
    except ValueError as e:
        raise bad_request(str(e)) from None
    api_ctx.check_prompt_bytes(request.text_bytes(), "messages")
    include_usage = get_bool(get_obj(body, "stream_options"), "include_usage", "stream_options")
    return Turn(new_id("chatcmpl-"), model, get_bool(body, "stream"), include_usage, request)


def _messages(items: list, api_ctx: ApiContext) -> tuple[Message, ...]:
    out = []
    for i, item in enumerate(items):
        m, path = obj(item, at("messages", i)), at("messages", i)
        role = get_str(m, "role", path, required=True)
        content = m.get("content")
        if role in ("system", "developer", "user"):
            out.append(Message.text(role, text_parts(content, f"{path}.content", _TEXT)))
        elif role == "assistant":
            out.append(_assistant(m, path, api_ctx))
        elif role == "tool":
            out.append(Message("tool", (ToolResultBlock(get_str(m, "tool_call_id", path, required=True),
                                                        text_parts(content, f"{path}.content", _TEXT)),)))
        else:
            raise bad_request(f"{path}.role: expected system, developer, user, assistant or tool, "
                              f"got {role!r}", param=f"{path}.role")
    return tuple(out)


def _assistant(m: dict, path: str, api_ctx: ApiContext) -> Message:
    blocks = []
    reasoning = get_str(m, "reasoning_content", path)
    if reasoning is not None:
        blocks.append(ThinkingBlock(reasoning, api_ctx.reasoning.signature_for(reasoning)))
    text = text_parts(m.get("content"), f"{path}.content", _TEXT + ("refusal",))
    if text:
        blocks.append(TextBlock(text))
    for j, call in enumerate(get_list(m, "tool_calls", path)):
        c, cpath = obj(call, at(f"{path}.tool_calls", j)), at(f"{path}.tool_calls", j)
        kind = one_of(get_str(c, "type", cpath, default="function"), ("function", "custom"), f"{cpath}.type")
        call_id = get_str(c, "id", cpath, required=True)
        if kind == "custom":  # a call with one string argument, `input`, as on the Responses path
            cu, upath = get_obj(c, "custom", cpath, required=True), f"{cpath}.custom"
            blocks.append(ToolUseBlock.from_custom_input(call_id, get_str(cu, "name", upath, required=True),
                                                         get_str(cu, "input", upath, default="")))
            continue
        fn = get_obj(c, "function", cpath, required=True)
        blocks.append(ToolUseBlock(call_id, get_str(fn, "name", f"{cpath}.function", required=True),
                                   arguments_text(fn.get("arguments", "{}"), f"{cpath}.function.arguments")))
    return Message("assistant", tuple(blocks))


def _tools(items: list) -> tuple[ToolSpec, ...]:
    out = []
    for i, item in enumerate(items):
        t, path = obj(item, at("tools", i)), at("tools", i)
        kind = t.get("type", "function")
        if kind == "custom":
            out.append(_custom_tool(get_obj(t, "custom", path, required=True), f"{path}.custom"))
            continue
        if kind != "function":
            continue  # built-in tools: nothing this server can offer the model
        fn, fpath = get_obj(t, "function", path, required=True), f"{path}.function"
        params = get_obj(fn, "parameters", fpath) or {"type": "object", "properties": {}}
        out.append(ToolSpec(get_str(fn, "name", fpath, required=True), get_str(fn, "description", fpath, default=""),
                            params, strict=get_bool(fn, "strict", fpath)))
    return tuple(out)


def _custom_tool(c: dict, path: str) -> ToolSpec:
    """A tool's `custom` object: {"name", "description", "format": {"type": "text"} | {"type":
    "grammar", "grammar": {"syntax": "lark" | "regex", "definition"}}} (no format: free text).
    Whether the grammar compiles is the session's question (a 400 too)."""
    name, about = get_str(c, "name", path, required=True), get_str(c, "description", path, default="")
    fmt, fpath = get_obj(c, "format", path), at(path, "format")
    kind = one_of(get_str(fmt, "type", fpath, default="text"), ("text", "grammar"), at(fpath, "type"))
    if kind == "text":
        return ToolSpec(name, about, kind="custom")
    grammar, gpath = get_obj(fmt, "grammar", fpath, required=True), at(fpath, "grammar")
    syntax = one_of(get_str(grammar, "syntax", gpath, required=True), ("lark", "regex"), at(gpath, "syntax"))
    return ToolSpec(name, about, kind="custom", grammar=get_str(grammar, "definition", gpath, required=True),
                    grammar_syntax=syntax)


def _tool_choice(body: dict):
    """tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    | {"type": "custom", "custom": {"name": ...}}."""
    tc = body.get("tool_choice")
    if tc is None:
        return "auto"
    if isinstance(tc, str):
        return one_of(tc, ("none", "auto", "required"), "tool_choice")
    tc = obj(tc, "tool_choice")
    kind = get_str(tc, "type", "tool_choice", default="function")
    if kind not in ("function", "custom"):
        raise bad_request(f"tool_choice.type: {kind!r} is not supported; use \"none\", \"auto\", "
                          "\"required\", {\"type\": \"function\", \"function\": {\"name\": ...}} or "
                          "{\"type\": \"custom\", \"custom\": {\"name\": ...}}", param="tool_choice.type")
    named = get_obj(tc, kind, "tool_choice", required=True)
    return {"name": get_str(named, "name", f"tool_choice.{kind}", required=True)}


def _response_format(body: dict) -> dict | None:
    """`{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}` (strict defaults to false, as upstream)."""
    if body.get("response_format") is None:
        return None
    return output_format(get_obj(body, "response_format"), "response_format", nested="json_schema")


# ---- response --------------------------------------------------------------------------------
def usage(finish: Finish | None) -> dict:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.reused_tokens}}


def body(turn: Turn, reply: Reply, api_ctx: ApiContext) -> dict:
    msg: dict = {"role": "assistant", "content": reply.text or None}
    if reply.thinking:
        msg["reasoning_content"] = "".join(t.text for t in reply.thinking)
    if reply.tool_calls:
        msg["tool_calls"] = [_call(c) for c in reply.tool_calls]
    choice = {"index": 0, "message": msg, "finish_reason": reply.finish.reason,
              "logprobs": _logprobs(turn, reply.sampled)}
    return {"id": turn.id, "object": "chat.completion", "created": turn.created, "model": turn.model,
            "choices": [choice], "usage": usage(reply.finish)}


def _logprobs(turn: Turn, sampled: list[SampledToken]) -> dict | None:
    """OpenAI's `logprobs` of a choice: one `content` entry per sampled token (None when the
    request did not ask)."""
    if turn.request.logprobs is None:
        return None
    return {"content": logprob_entries(sampled), "refusal": None}


def _call(c: ToolCallDone) -> dict:
    if c.kind == "custom":
        return {"id": c.id, "type": "custom", "custom": {"name": c.name, "input": c.input or ""}}
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def remember(turn: Turn, reply: Reply, api_ctx: ApiContext) -> None:
    for t in reply.thinking:
        api_ctx.reasoning.remember(t.text, t.signature)


class Stream:
    def __init__(self, turn: Turn, api_ctx: ApiContext):
        self.turn = turn
        self.custom: dict[str, list] = {}       # open custom call id -> [input decoder, input sent]
        self.sampled: list[SampledToken] = []   # tokens not yet reported: the next chunk carries them

    def _chunk(self, delta: dict, finish: str | None = None) -> str:
        logprobs = _logprobs(self.turn, self.sampled) if self.sampled else None
        self.sampled = []
        return sse({"id": self.turn.id, "object": "chat.completion.chunk", "created": self.turn.created,
                    "model": self.turn.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})

    def start(self, planned=None) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def keepalive(self) -> str:
        return ": keep-alive\n\n"

    def error(self, err: ApiError) -> str:
        return sse(openai_body(err))

    def event(self, ev) -> str:
        if isinstance(ev, SampledToken):
            self.sampled.append(ev)
            return ""
        if isinstance(ev, ThinkingDelta):
            return self._chunk({"reasoning_content": ev.text})
        if isinstance(ev, TextDelta):
            return self._chunk({"content": ev.text})
        if isinstance(ev, ToolCallStart) and ev.kind == "custom":
            self.custom[ev.id] = [CustomInputStream(), ""]
            return self._chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "custom",
                                                "custom": {"name": ev.name, "input": ""}}]})
        if isinstance(ev, ToolCallStart):
            return self._chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                "function": {"name": ev.name, "arguments": ""}}]})
        if isinstance(ev, ToolCallDelta) and ev.id in self.custom:
            # the session streams the JSON text {"input": "..."}; the wire carries the decoded input
            return self._input(ev.index, ev.id, self.custom[ev.id][0].feed(ev.fragment))
        if isinstance(ev, ToolCallDelta):
            return self._chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
        if isinstance(ev, ToolCallDone) and ev.id in self.custom:
            # whatever the decoder could not follow (normally nothing) completes the input
            sent, final = self.custom.pop(ev.id)[1], ev.input or ""
            return self._input(ev.index, None, final[len(sent):] if final.startswith(sent) else "")
        if isinstance(ev, Finish):
            out = self._chunk({}, ev.reason)
            if self.turn.include_usage:
                out += sse({"id": self.turn.id, "object": "chat.completion.chunk", "created": self.turn.created,
                            "model": self.turn.model, "choices": [], "usage": usage(ev)})
            return out + "data: [DONE]\n\n"
        return ""

    def _input(self, index: int, call_id: str | None, text: str) -> str:
        """A custom call's input fragment (`call_id`: the open call whose sent input it extends)."""
        if not text:
            return ""
        if call_id is not None:
            self.custom[call_id][1] += text
        return self._chunk({"tool_calls": [{"index": index, "custom": {"input": text}}]})
