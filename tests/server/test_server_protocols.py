"""The HTTP layer over a scripted session (no weights, runs everywhere in seconds): the exact SSE
event sequences of each protocol, the real SDKs reassembling them, protocol state (Responses
previous_response_id, Anthropic threads), the tolerance list of the spec's section 0, every
error shape, overload, disconnect-cancels, keep-alive and clean shutdown."""
from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import openai
import pytest
import requests
from serverlib import TOOL_TOKENS, FakeSession, InProcessServer, sse_events

from zen5.chat_types import RedactedThinkingBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock


@pytest.fixture(scope="module")
def fake():
    session = FakeSession()
    srv = InProcessServer(session, keepalive=0.2)
    srv.session = session
    yield srv
    srv.stop()


def post(srv, path, body, **headers):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(srv.url + path, data=data, headers={"content-type": "application/json", **headers},
                         timeout=30)


def stream(srv, path, body):
    r = requests.post(srv.url + path, json=body, stream=True, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return sse_events(r)


ANTHROPIC = {"model": "any", "max_tokens": 64, "messages": [{"role": "user", "content": "tool please"}]}
CHAT = {"model": "any", "messages": [{"role": "user", "content": "tool please"}]}
RESPONSES = {"model": "any", "input": "tool please"}


# ---- exact event sequences ------------------------------------------------------------------
def test_unicode_line_breaks_never_split_an_event(fake):
    """U+2028, U+2029 and U+0085 in generated text are escaped on the wire: a client that splits
    lines with str.splitlines() (this helper, via requests) still reads every event whole."""
    from serverlib import LINE_BREAKS
    for path, body, text_of in (
            ("/v1/chat/completions", CHAT, lambda d: d["choices"][0]["delta"].get("content") or ""),
            ("/v1/messages", ANTHROPIC, lambda d: d.get("delta", {}).get("text", "")),
            ("/v1/responses", RESPONSES,
             lambda d: d.get("delta", "") if d["type"] == "response.output_text.delta" else "")):
        req = {**body, "stream": True, **({"messages": [{"role": "user", "content": "breaks"}]} if "messages" in body
                                         else {"input": "breaks"})}
        raw = requests.post(fake.url + path, json=req, timeout=30).content.decode()
        assert not any(c in raw for c in "\u2028\u2029\x85\x1c")
        events = stream(fake, path, req)
        assert "".join(text_of(d) for _, d in events if isinstance(d, dict)) == LINE_BREAKS
    chunks = openai.OpenAI(base_url=fake.url + "/v1", api_key="k").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "breaks"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == LINE_BREAKS



def test_anthropic_stream_sequence(fake):
    events = [e for e in stream(fake, "/v1/messages", {**ANTHROPIC, "stream": True}) if e[0] != "ping"]
    names = [n for n, _ in events]
    assert names == ["message_start",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in events)          # event name and data.type agree
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta",
                      "input_json_delta", "input_json_delta"]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
    assert starts[2]["id"].startswith("toolu_") and starts[2]["input"] == {}
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1, 2]
    md = events[-2][1]
    assert md["delta"]["stop_reason"] == "tool_use" and md["usage"]["output_tokens"] == 5


def test_openai_chat_stream_sequence(fake):
    events = [d for n, d in stream(fake, "/v1/chat/completions",
                                   {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
              if n != "comment"]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert deltas[:2] == [{"reasoning_content": "Let me "}, {"reasoning_content": "check."}]
    assert deltas[2] == {"content": "Checking."}
    first = deltas[3]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[4:]) == '{"city": "Paris"}'
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 10


def test_responses_stream_sequence(fake):
    events = [e for e in stream(fake, "/v1/responses", {**RESPONSES, "stream": True}) if e[0] != "comment"]
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(1, len(events) + 1))
    added = [d["item"]["type"] for n, d in events if n == "response.output_item.added"]
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call"] == [i["type"] for i in done]
    assert done[0]["summary"] == [{"type": "summary_text", "text": "Let me check."}]
    assert done[2]["call_id"].startswith("call_") and done[2]["arguments"] == '{"city": "Paris"}'
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"] == done


def test_responses_logprobs_cover_the_message_text_only(fake):
    """Responses logprobs belong to output_text: of the tokens sampled for thinking, text and a
    tool call, the message gets exactly the two that made its text ("Check", "ing."), in the
    body, on the delta, in the done events and in the final response; Chat reports every token."""
    want = {**RESPONSES, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    body = post(fake, "/v1/responses", want).json()
    msg = next(o for o in body["output"] if o["type"] == "message")
    entries = msg["content"][0]["logprobs"]
    assert [e["token"] for e in entries] == ["Check", "ing."]
    assert entries[0] == {"token": "Check", "logprob": -0.5, "bytes": list(b"Check"),
                          "top_logprobs": [{"token": "Check", "logprob": -0.5, "bytes": list(b"Check")},
                                           {"token": "x", "logprob": -2.0, "bytes": [120]}]}
    events = [e for e in stream(fake, "/v1/responses", {**want, "stream": True}) if e[0] != "comment"]
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert [[e["token"] for e in d["logprobs"]] for d in deltas] == [["Check", "ing."]]
    done = next(d for n, d in events if n == "response.output_text.done")
    final = next(o for o in events[-1][1]["response"]["output"] if o["type"] == "message")
    assert done["logprobs"] == final["content"][0]["logprobs"] == entries
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=0)
    r = client.responses.create(**want)   # the SDK parses the entries
    assert [e.token for e in next(o for o in r.output if o.type == "message").content[0].logprobs] == ["Check", "ing."]
    chat = post(fake, "/v1/chat/completions", {**CHAT, "logprobs": True}).json()
    assert [e["token"] for e in chat["choices"][0]["logprobs"]["content"]] == sum(TOOL_TOKENS, [])   # every token
    assert post(fake, "/v1/responses", RESPONSES).json()["output"][1]["content"][0]["logprobs"] == []


# ---- SDKs reassemble -----------------------------------------------------------------------
def test_anthropic_sdk_stream_and_nonstream(fake):
    client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
    with client.messages.stream(**ANTHROPIC) as s:
        msg = s.get_final_message()
    plain = client.messages.create(**ANTHROPIC)
    for m in (msg, plain):
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
        assert m.content[0].thinking == "Let me check." and m.content[0].signature == "z5s1.sig"
        assert m.content[2].input == {"city": "Paris"} and m.stop_reason == "tool_use"
    redacted = client.messages.create(**ANTHROPIC, thinking={"type": "enabled", "budget_tokens": 1024,
                                                              "display": "omitted"})
    assert redacted.content[0].type == "redacted_thinking" and redacted.content[0].data == "z5e1.blob"


def test_openai_sdks_reassemble(fake):
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=0)
    args = ""
    for chunk in client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                args += tc.function.arguments or ""
    assert args == '{"city": "Paris"}'
    with client.responses.stream(**RESPONSES, include=["reasoning.encrypted_content"]) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].encrypted_content == "z5e1.blob"
    assert final.output_text == "Checking."
    assert fake.session.requests[-1].redact_thinking


# ---- protocol state ------------------------------------------------------------------------
def test_previous_response_id_and_gone_state(fake):
    first = post(fake, "/v1/responses", RESPONSES).json()
    call = next(o for o in first["output"] if o["type"] == "function_call")
    second = post(fake, "/v1/responses", {"model": "any", "previous_response_id": first["id"],
                                          "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                                     "output": "22C"}]})
    assert second.status_code == 200, second.text
    req = fake.session.requests[-1]
    roles = [m.role for m in req.messages]
    assert roles[0] == "user" and roles[-1] == "tool" and "assistant" in roles
    blocks = [b for m in req.messages for b in m.blocks]
    assert any(isinstance(b, ThinkingBlock) and b.signature == "z5s1.sig" for b in blocks)
    assert any(isinstance(b, ToolUseBlock) and b.id == call["call_id"] for b in blocks)
    gone = post(fake, "/v1/responses", {"model": "any", "previous_response_id": "resp_nope", "input": "hi"})
    assert gone.status_code == 400
    assert gone.json()["error"]["param"] == "previous_response_id"
    assert "send the full input" in gone.json()["error"]["message"]
    unstored = post(fake, "/v1/responses", {**RESPONSES, "store": False}).json()
    assert post(fake, "/v1/responses", {"model": "any", "previous_response_id": unstored["id"],
                                        "input": "hi"}).status_code == 400


def test_anthropic_thread_create_continue_and_gone(fake):
    first = post(fake, "/v1/messages", {**ANTHROPIC, "system": "Be brief.", "thread": {"type": "create"},
                                        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
    body = first.json()
    tool = body["content"][2]
    cont = post(fake, "/v1/messages", {"model": "any", "max_tokens": 64,
                                       "thread": {"type": "continue", "previous_message_id": body["id"]},
                                       "messages": [{"role": "user", "content": [
                                           {"type": "tool_result", "tool_use_id": tool["id"], "content": "22C"}]}]})
    assert cont.status_code == 200 and cont.json()["content"][0]["text"] == "Sunny."
    req = fake.session.requests[-1]
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user"]
    assert [t.name for t in req.tools] == ["get_weather"]          # create-time tools kept
    assert isinstance(req.messages[-1].blocks[0], ToolResultBlock)
    gone = post(fake, "/v1/messages", {"model": "any", "max_tokens": 8, "messages": [],
                                       "thread": {"type": "continue", "previous_message_id": "msg_gone"}})
    assert gone.status_code == 400
    assert gone.json()["error"]["details"] == {"error_code": "thread_not_found"}


@pytest.mark.parametrize("thread", [False, None])
def test_anthropic_sdk_tool_runner(fake, thread):
    """The SDK's tool runner, with full-history requests (thread=False) and with its default
    server-side thread (only the tool_result goes up on the second turn)."""
    client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
    calls = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        calls.append(city)
        return "22C and sunny"

    kw = {} if thread is None else {"thread": thread}
    n0, stored = len(fake.session.requests), len(fake.zen.api_ctx.conversations)
    runner = client.beta.messages.tool_runner(model="any", max_tokens=64, tools=[get_weather],
                                              messages=[{"role": "user", "content": "tool please"}], **kw)
    final = runner.until_done()
    assert calls == ["Paris"] and final.content[-1].text == "Sunny."
    second = fake.session.requests[n0 + 1]
    assert isinstance(second.messages[-1].blocks[0], ToolResultBlock)
    assert (len(fake.zen.api_ctx.conversations) > stored) == (thread is None)   # the default runs a thread
    assert any(isinstance(b, ToolUseBlock) for m in second.messages for b in m.blocks)


def test_stored_conversations_drop_foreign_encrypted_content(fake):
    """Issue 19, defect 3: 16 MB of opaque `encrypted_content` per Responses request was kept in
    the store although the prompt drops it. Now a chain of such requests stores only what the
    prompt renders (a few bytes of text), the chain still continues, and reasoning we issued
    (our encrypted blob, continued by id and replayed) is still stored exactly."""
    store = fake.zen.api_ctx.conversations
    garbage = "z5e1." + "A" * (16 << 20)          # looks like ours, does not decrypt
    rid = None
    for i in range(6):
        body = {"model": "any", "input": [
            {"type": "reasoning", "id": f"rs_{i}", "summary": [], "encrypted_content": garbage},
            {"role": "user", "content": f"hello {i}"}]}
        r = post(fake, "/v1/responses", {**body, **({"previous_response_id": rid} if rid else {})})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
    texts = [b.text for m in fake.session.requests[-1].messages for b in m.blocks if hasattr(b, "text")]
    assert [t for t in texts if t.startswith("hello")] == [f"hello {i}" for i in range(6)]   # the chain holds
    stored = store.get(rid).messages
    assert not any(isinstance(b, RedactedThinkingBlock) for m in stored for b in m.blocks)
    assert store.nbytes < 1 << 20                  # the other tests' small conversations, no garbage
    ours = post(fake, "/v1/responses", {**RESPONSES, "include": ["reasoning.encrypted_content"]}).json()
    assert ours["output"][0]["encrypted_content"] == "z5e1.blob"
    call = next(o for o in ours["output"] if o["type"] == "function_call")
    follow = post(fake, "/v1/responses", {"model": "any", "previous_response_id": ours["id"], "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "22C"}]}).json()
    again = post(fake, "/v1/responses", {"model": "any", "previous_response_id": follow["id"], "input": "thanks"})
    assert again.status_code == 200, again.text
    blocks = [b for m in fake.session.requests[-1].messages for b in m.blocks]
    assert RedactedThinkingBlock("z5e1.blob") in blocks


def test_conversation_store_is_bounded_by_bytes():
    """LRU by the bytes of text held: the oldest go first once the budget is passed; a chain
    continued by id shares its messages, counted once; an entry over the whole budget is not kept."""
    from zen5.api.conversations import Conversation, ConversationStore
    from zen5.chat_types import Message
    store = ConversationStore(max_bytes=1 << 20)
    big = lambda i: Message.text("user", f"{i}" + "x" * (300 << 10))   # noqa: E731 (~300 KB each)
    for i in range(10):
        store.put(f"a{i}", Conversation((big(i),)))
        assert store.nbytes <= store.max_bytes
    assert store.get("a0") is None and store.get("a9") is not None and len(store) == 3
    chain = ConversationStore(max_bytes=1 << 20)
    history = ()
    for i in range(3):                                 # ~900 KB in all, though the entries add to 1.8 MB
        history += (big(i),)
        chain.put(f"c{i}", Conversation(history))
    assert len(chain) == 3 and 900 << 10 < chain.nbytes <= chain.max_bytes
    chain.put("huge", Conversation((Message.text("user", "x" * (2 << 20)),)))
    assert chain.get("huge") is None and len(chain) == 3
    for key in ("c0", "c1", "c2"):                     # what is released is uncounted exactly
        chain.put(key, Conversation(()))
    assert chain.nbytes == 0


# ---- tolerance (spec section 0) ------------------------------------------------------------
def test_claude_code_shapes_are_accepted(fake):
    body = {"model": "claude-opus-4-8", "max_tokens": 32000, "stream": False,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
                       {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user",
                          "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": [{"type": "text", "text": "agents: none"}]}],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
                      {"name": "Deferred", "input_schema": {"type": "object"}, "defer_loading": True},
                      {"type": "web_search_20250305", "name": "web_search"}],
            "thinking": {"type": "adaptive", "display": "updates"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "{\"device_id\": \"x\"}"}, "unknown_field": {"a": 1}}
    r = post(fake, "/v1/messages?beta=true", body, **{"anthropic-version": "2026-10-21",
                                                       "anthropic-beta": "made-up-beta-2099"})
    assert r.status_code == 200, r.text
    req = fake.session.requests[-1]
    assert req.messages[0].blocks[0].text == "You are Claude Code."      # billing header dropped
    assert [m.role for m in req.messages] == ["system", "user", "system"]
    assert [t.name for t in req.tools] == ["Read"]


def test_head_probes_and_misc_endpoints(fake):
    for path in ("/", "/api/hello", "/v1/messages"):
        assert requests.head(fake.url + path, timeout=5).status_code == 200
    models = requests.get(fake.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "fake" and models["has_more"] is False
    assert requests.get(fake.url + "/openapi.json", timeout=5).json()["openapi"].startswith("3.")
    text = requests.get(fake.url + "/metrics", timeout=5).text
    for name in ("zen5_requests_total", "zen5_prompt_tokens_reused_total", "zen5_prompt_tokens_prefilled_total",
                 "zen5_cache_source_total", "zen5_prefill_tokens_per_second", "zen5_decode_tokens_per_second",
                 "zen5_queue_depth"):
        assert f"# TYPE {name}" in text


def test_responses_items_without_type_and_developer_role(fake):
    r = post(fake, "/v1/responses", {"model": "any", "input": [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
        {"role": "user", "content": "hello"}], "store": False, "unknown": 1})
    assert r.status_code == 200, r.text
    assert [m.role for m in fake.session.requests[-1].messages] == ["developer", "user"]


def test_reasoning_content_replay_is_recognised(fake):
    """Chat Completions has no signature field: thinking we emitted is recognised by its text."""
    first = post(fake, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    assert first["reasoning_content"] == "Let me check."
    post(fake, "/v1/chat/completions", {"model": "any", "messages": [
        CHAT["messages"][0], {**first, "content": ""},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "22C"}]})
    thinking = [b for m in fake.session.requests[-1].messages for b in m.blocks if isinstance(b, ThinkingBlock)]
    assert thinking == [ThinkingBlock("Let me check.", "z5s1.sig")]


def test_redacted_reasoning_replay(fake):
    post(fake, "/v1/responses", {"model": "any", "store": False, "input": [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "z5e1.blob"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]})
    blocks = [b for m in fake.session.requests[-1].messages for b in m.blocks]
    assert blocks[0] == RedactedThinkingBlock("z5e1.blob")


# ---- errors ---------------------------------------------------------------------------------
ANTHROPIC_BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"model": "m", "messages": []}, "max_tokens: this field is required"),
    ({"model": "m", "max_tokens": "lots", "messages": []}, "max_tokens: expected an integer, got a string"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, "text only"),
    ({"model": "m", "max_tokens": 5, "temperature": "hot", "messages": [{"role": "user", "content": "x"}]},
     "temperature: expected a finite number"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": "prefill"}]}, "prefill"),
]


@pytest.mark.parametrize("body,fragment", ANTHROPIC_BAD)
def test_anthropic_bad_input_shapes(fake, body, fragment):
    r = post(fake, "/v1/messages", body)
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert fragment in j["error"]["message"] and j["request_id"].startswith("req_")
    assert r.headers["x-should-retry"] == "false"


OPENAI_BAD = [
    ("/v1/chat/completions", b"", "not valid JSON"),
    ("/v1/chat/completions", {"model": "m"}, "messages: this field is required"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "text only"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function: this field is required"),
    ("/v1/chat/completions", {"model": "m", "n": 3, "messages": [{"role": "user", "content": "x"}]}, "n=1"),
    ("/v1/completions", {"model": "m", "prompt": {"a": 1}}, "prompt:"),
    ("/v1/responses", {"model": "m"}, "input: this field is required"),
    ("/v1/responses", {"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ("/v1/responses", {"model": 5, "input": "x"}, "model: expected a string"),
]


@pytest.mark.parametrize("path,body,fragment", OPENAI_BAD)
def test_openai_bad_input_shapes(fake, path, body, fragment):
    r = post(fake, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path,field,base", [("/v1/chat/completions", "stop", CHAT),
                                              ("/v1/completions", "stop", {"model": "m", "prompt": "hi"}),
                                              ("/v1/messages", "stop_sequences", ANTHROPIC)])
def test_stop_strings_are_bounded(fake, path, field, base):
    """Issue 19 (security): the number of stop strings, and their length, had no bound (each is
    matched at every sampled token). Past the limits: a 400 in the protocol's shape naming the
    limit and the field. (Responses has no stop field.)"""
    from zen5.api.fields import MAX_STOP_CHARS, MAX_STOP_STRINGS, get_stop
    for value, param, says in (
            ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], field, f"at most {MAX_STOP_STRINGS} stop strings"),
            (["ok", "x" * (MAX_STOP_CHARS + 1)], f"{field}[1]", f"at most {MAX_STOP_CHARS} characters"),
            ("x" * (MAX_STOP_CHARS + 1), field, f"at most {MAX_STOP_CHARS} characters")):
        r = post(fake, path, {**base, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and says in err["message"] and param in err["message"]
        if path != "/v1/messages":
            assert err["param"] == param
    at_limit = ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    assert get_stop({field: at_limit}, field) == tuple(at_limit)
    if path != "/v1/completions":                      # the scripted session serves chat turns only
        assert post(fake, path, {**base, field: at_limit}).status_code == 200


def test_session_refusals_map_to_protocol_errors(fake):
    r = post(fake, "/v1/messages", {**ANTHROPIC, "messages": [{"role": "user", "content": "unknown-id"}]})
    assert r.status_code == 400 and "replay the full history" in r.json()["error"]["message"]
    r = post(fake, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "stale"}]})
    assert r.status_code == 409 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-should-retry"] == "false"
    r = post(fake, "/v1/messages", {**ANTHROPIC, "stream": True, "messages": [{"role": "user", "content": "stale"}]})
    assert r.status_code == 409 and r.json()["type"] == "error"     # refused before the stream starts
    r = requests.get(fake.url + "/v1/nope", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_internal_error_mid_stream_and_server_keeps_serving(fake):
    events = stream(fake, "/v1/messages", {**ANTHROPIC, "stream": True,
                                           "messages": [{"role": "user", "content": "crash"}]})
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    r = post(fake, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "crash"}]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert post(fake, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}]}).ok


def test_keepalive_during_a_long_prefill(fake):
    events = stream(fake, "/v1/messages", {**ANTHROPIC, "stream": True,
                                           "messages": [{"role": "user", "content": "wait"}]})
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names.index("ping") < names.index("content_block_start")
    events = stream(fake, "/v1/chat/completions", {**CHAT, "stream": True,
                                                   "messages": [{"role": "user", "content": "wait"}]})
    assert any(n == "comment" for n, _ in events)


def test_disconnect_cancels_generation(fake):
    fake.session.cancelled.clear()
    before = fake.metrics().get("zen5_requests_cancelled_total", 0)
    r = requests.post(fake.url + "/v1/messages", json={**ANTHROPIC, "stream": True,
                                                        "messages": [{"role": "user", "content": "slow"}]},
                      stream=True, timeout=30)
    lines = r.iter_lines()
    for _ in range(12):
        next(lines)
    r.close()
    assert fake.session.cancelled.wait(5), "the generation went on after the client left"
    t0 = time.time()
    assert post(fake, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}]}).ok
    assert time.time() - t0 < 2
    assert fake.metrics()["zen5_requests_cancelled_total"] == before + 1
    # a non-streaming client that gives up is noticed too (the handler polls for the disconnect)
    fake.session.cancelled.clear()
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "slow"}]}).encode()
    with socket.create_connection(("127.0.0.1", fake.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
    assert fake.session.cancelled.wait(5)
    assert fake.metrics()["zen5_requests_cancelled_total"] == before + 2


# ---- servers with other settings ------------------------------------------------------------
def test_overload_answers_each_protocols_error():
    session = FakeSession()
    srv = InProcessServer(session, queue=1)
    try:
        slow = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "slow"}]}
        running = requests.post(srv.url + "/v1/messages", json={**slow, "stream": True}, stream=True, timeout=30)
        lines = running.iter_lines()                     # keep it: dropping it closes the stream
        next(lines)                                      # the worker is busy with it
        waiting = threading.Thread(target=lambda: post(srv, "/v1/messages", {**slow, "messages": [
            {"role": "user", "content": "hi"}]}))
        waiting.start()
        deadline = time.time() + 5
        while srv.zen.worker.depth < 1 and time.time() < deadline:
            time.sleep(0.02)
        a = post(srv, "/v1/messages", slow)
        o = post(srv, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert a.status_code == 529 and a.json()["error"]["type"] == "overloaded_error"
        assert o.status_code == 429 and o.json()["error"]["type"] == "rate_limit_error"
        assert a.headers["x-should-retry"] == "true" and "retry-after" in a.headers
        assert srv.metrics()["zen5_requests_rejected_total"] == 2
        running.close()
        waiting.join(30)
    finally:
        srv.stop()
    assert session.closed, "shutdown did not call session.close()"


def test_api_key_both_headers_and_401_shapes():
    srv = InProcessServer(FakeSession(), api_key="sekrit", cors=True)
    try:
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        assert post(srv, "/v1/messages", body, **{"x-api-key": "sekrit"}).ok
        assert post(srv, "/v1/messages", body, Authorization="Bearer sekrit").ok
        bad = post(srv, "/v1/messages", body, **{"x-api-key": "wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        bad = post(srv, "/v1/chat/completions", {"model": "m", "messages": []})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        assert requests.get(srv.url + "/health", timeout=5).ok           # health needs no key
        pre = requests.options(srv.url + "/v1/messages", timeout=5, headers={
            "Origin": "http://example.test", "Access-Control-Request-Method": "POST"})
        assert pre.headers.get("access-control-allow-origin") in ("*", "http://example.test")
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
def test_what_python_parses_but_json_is_not_is_a_400(path):
    """Python's json module takes more than JSON, and each of these once became a 500: nesting
    deeper than the recursion limit, NaN / Infinity, and lone surrogate escapes (streamed too,
    where the connection once closed with no bytes). A surrogate pair is text and is served."""
    srv = InProcessServer(FakeSession())
    try:
        msg = ('{"model": "m", "max_output_tokens": 5, %s"input": [{"role": "user", "content": "%s"}]%s}'
               if path == "/v1/responses" else
               '{"model": "m", "max_tokens": 5, %s"messages": [{"role": "user", "content": "%s"}]%s}')
        assert post(srv, path, (msg % ("", "hi", "")).encode()).ok  # the template itself is valid
        deep = msg % ("", "hi", ', "metadata": ' + "[" * 5000 + "]" * 5000)
        for raw in (deep, msg % ('"temperature": NaN, ', "hi", ""), msg % ('"top_p": Infinity, ', "hi", ""),
                    msg % ("", "a\\ud800b", ""), msg % ('"stream": true, ', "a\\udc00", ""),
                    msg % ("", "hi", ', "metadata": {"\\ud800": "x"}')):
            r = post(srv, path, raw.encode())
            assert r.status_code == 400, (path, raw[:80], r.status_code, r.text[:200])
            assert "error" in r.json()
        assert post(srv, path, (msg % ("", "smile \\ud83d\\ude00", "")).encode()).ok
    finally:
        srv.stop()


def test_non_ascii_api_key_matches_its_utf8_bytes():
    """Headers are bytes: a client sends a non-ASCII key as UTF-8, which must match `--api-key`
    (it once never did: the header was decoded as latin-1, the key encoded as UTF-8)."""
    key = "clé-ключ-🔑"
    srv = InProcessServer(FakeSession(), api_key=key)
    try:
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        assert post(srv, "/v1/messages", body, **{"x-api-key": key.encode("utf-8")}).ok
        assert post(srv, "/v1/messages", body, Authorization=b"Bearer " + key.encode("utf-8")).ok
        assert post(srv, "/v1/messages", body, **{"x-api-key": "cl\u00e9".encode()}).status_code == 401
        assert post(srv, "/v1/messages", body, **{"x-api-key": key[:-1].encode("utf-8")}).status_code == 401
    finally:
        srv.stop()


def test_custom_tool_input_decodes_incrementally_at_any_split():
    """A custom tool call's input streams as decoded text (response.custom_tool_call_input.delta)
    while the session streams the JSON of {"input": ...}: any fragmenting, escapes and surrogate
    pairs included, joins to the whole input, and nothing past the closing quote leaks."""
    from zen5.api.custom_input import CustomInputStream

    value = 'a"b\\c\n\t*** Begin Patch\u00e9\U0001F600 \u2028end'
    for ascii_only in (False, True):
        text = json.dumps({"input": value}, ensure_ascii=ascii_only)
        for step in (1, 2, 3, 5, 7, len(text)):
            dec = CustomInputStream()
            out = "".join(dec.feed(text[i:i + step]) for i in range(0, len(text), step))
            assert out == value, (ascii_only, step, out)
    dec = CustomInputStream()
    assert dec.feed('{"inp') == "" and dec.feed('ut": "ab') == "ab" and dec.feed('\\u00') == ""
    assert dec.feed('e9"}') == "\u00e9" and dec.feed("more") == ""
    assert CustomInputStream().feed('{"other": "x"}') == ""  # not a custom input: only .done carries it


def _raw_request(srv, head: bytes, body_chunks=(), timeout: float = 10.0) -> bytes:
    """Send a request by hand (a declared length it never sends, a chunked body that never
    ends) and return what the server answers first."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except OSError:          # the server answered and closed while we were still sending
            pass
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _content_length(answer):
            piece = s.recv(65536)
            if not piece:
                break
            answer += piece
        return answer


def _content_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_an_oversize_body_is_refused_before_it_is_read(fake):
    """A Content-Length over the 64 MiB limit is a 413 at once, with none of the body sent (it
    was once buffered whole first); a chunked body is cut off as soon as it passes the limit."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: 209715200\r\n\r\n")
    answer = _raw_request(fake, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"over the limit of 67108864" in answer

    head = (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    mib = b"x" * (1 << 20)
    chunks = [b"100000\r\n" + mib + b"\r\n"] * 65        # 65 MiB, and no terminating chunk
    answer = _raw_request(fake, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert requests.get(fake.url + "/health", timeout=5).ok


def test_foreign_host_and_origin_are_refused_unless_cors():
    """A web page can POST to a localhost server as text/plain (no preflight) and, through DNS
    rebinding, read the answer: a foreign Host or Origin is a 403 in the path's error shape
    (both were once served). Clients that send neither, or our own address, are served; --cors
    lets browsers in; --allowed-hosts names a proxy's host."""
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    srv = InProcessServer(FakeSession())
    try:
        assert post(srv, "/v1/messages", body).ok
        assert post(srv, "/v1/messages", body, Host=f"localhost:{srv.port}").ok
        rebound = post(srv, "/v1/messages", body, Host=f"attacker.example:{srv.port}")
        assert rebound.status_code == 403 and rebound.json()["error"]["type"] == "permission_error"
        page = post(srv, "/v1/chat/completions", body, Origin="https://attacker.example",
                    **{"content-type": "text/plain"})
        assert page.status_code == 403 and "--cors" in page.json()["error"]["message"]
        assert post(srv, "/v1/messages", body, Origin=f"http://127.0.0.1:{srv.port}").ok
        assert requests.get(srv.url + "/health", headers={"Host": "attacker.example"}, timeout=5).status_code == 403
    finally:
        srv.stop()
    srv = InProcessServer(FakeSession(), cors=True, allowed_hosts="zen5.internal")
    try:
        assert post(srv, "/v1/messages", body, Origin="https://app.example").ok
        assert post(srv, "/v1/messages", body, Host="zen5.internal").ok
        assert post(srv, "/v1/messages", body, Host="attacker.example").status_code == 403
    finally:
        srv.stop()


def test_api_key_guards_metrics_and_openapi_but_not_health_or_head():
    """With --api-key, /metrics and /openapi.json need the key too (they were open); /health
    (liveness) and the bodiless HEAD probe Claude Code sends first stay open."""
    srv = InProcessServer(FakeSession(), api_key="sekrit")
    try:
        for path in ("/metrics", "/openapi.json", "/v1/models"):
            assert requests.get(srv.url + path, timeout=5).status_code == 401, path
            assert requests.get(srv.url + path, headers={"x-api-key": "sekrit"}, timeout=5).ok, path
        assert requests.get(srv.url + "/health", timeout=5).ok
        head = requests.head(srv.url + "/", timeout=5)
        assert head.status_code == 200 and head.content == b""
    finally:
        srv.stop()


def test_slow_and_idle_clients_are_bounded():
    """A client that never finishes its headers is dropped after --read-timeout, a body that
    stops arriving is a 408, and past --max-connections uvicorn answers 503 (slow clients once
    kept their connections, and the server's memory, forever)."""
    srv = InProcessServer(FakeSession(), read_timeout=0.5, max_connections=4)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")      # and nothing more
            t0 = time.monotonic()
            assert s.recv(100) == b""                                           # closed by the server
            assert time.monotonic() - t0 < 3
        head = (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n")
        answer = _raw_request(srv, head, [b'{"model": "m"'])
        assert answer.startswith(b"HTTP/1.1 408") and b"stopped arriving" in answer, answer[:300]
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
        try:
            time.sleep(0.1)
            assert requests.get(srv.url + "/health", timeout=5).status_code == 503
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)
        assert requests.get(srv.url + "/health", timeout=5).ok
    finally:
        srv.stop()
