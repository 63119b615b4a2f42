"""Tool loops through each protocol on the two models that really call tools (ChatML
smollm2-tools; DeepSeek V4 dsml-tiny, which thinks): the turn that answers tool results is a live
continuation, its usage reports the reused tokens in the protocol's own field and /metrics shows
only the suffix prefilled; a follow-up reuses everything; thinking comes back as signed thinking
blocks / reasoning_content / reasoning items and round-trips without a degrade; no DSML or
<tool_call> markup ever reaches visible text. Also the Anthropic SDK tool runner, threaded and
not."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import anthropic
import openai
import pytest

pytestmark = pytest.mark.model

SYSTEM = "You are a helpful assistant."
QUESTION = {"smollm2-tools": "What's the weather in Paris right now?", "dsml-tiny": "What is the weather in Lisbon?"}
RESULT = '{"temp_c": 21, "sky": "clear"}'
FOLLOW_UP = "Thanks! Anything else?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
          "required": ["city"]}
DESCRIPTION = "Get the current weather for a city"
MARKUP = ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>", "｜DSML｜", "<think>", "</think>",
          "<｜end▁of▁sentence｜>")


@dataclass
class Turn:
    prompt: int                  # prompt tokens
    reused: int                  # as the protocol reports cached input tokens
    completion: int
    prefilled_metric: int        # growth of zen5_prompt_tokens_prefilled_total during the request
    source: str                  # cache rung, from the trace
    diagnostics: list
    calls: list = field(default_factory=list)
    visible: list = field(default_factory=list)     # text, thinking and tool arguments shown
    thinking: list = field(default_factory=list)


@pytest.fixture(params=["smollm2-tools", "dsml-tiny"])
def model_server(request):
    return request.getfixturevalue({"smollm2-tools": "tools_server", "dsml-tiny": "dsml_server"}[request.param])


def measured(srv, send) -> tuple[object, int, dict]:
    before = srv.metrics().get("zen5_prompt_tokens_prefilled_total", 0)
    out = send()
    rec = srv.trace()[-1]
    return out, int(srv.metrics()["zen5_prompt_tokens_prefilled_total"] - before), rec


# ---- one loop per protocol ------------------------------------------------------------------
def anthropic_loop(srv, question: str) -> list[Turn]:
    client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}]
    msgs, turns, followed = [{"role": "user", "content": question}], [], False
    for _ in range(5):
        r, grew, rec = measured(srv, lambda: client.messages.create(
            model="zen5-local", max_tokens=160, system=SYSTEM, tools=tools, messages=msgs))
        u = r.usage
        calls = [b for b in r.content if b.type == "tool_use"]
        turns.append(Turn(u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, u.output_tokens,
                          grew, rec["cache"]["source"], rec["diagnostics"], [(b.name, b.input) for b in calls],
                          [b.text for b in r.content if b.type == "text"] + [b.thinking for b in r.content
                                                                             if b.type == "thinking"],
                          [(b.thinking, b.signature) for b in r.content if b.type == "thinking"]))
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        if calls:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": RESULT}
                                                     for b in calls]})
        elif followed:
            break
        else:
            msgs.append({"role": "user", "content": FOLLOW_UP})
            followed = True
    return turns


def chat_loop(srv, question: str) -> list[Turn]:
    """Streaming, reassembled by hand, reasoning_content echoed back on the assistant turn."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                               "parameters": SCHEMA}}]
    msgs, turns, followed = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], [], False
    for _ in range(5):
        def send():
            return list(client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=160,
                                                       stream=True, stream_options={"include_usage": True}))
        chunks, grew, rec = measured(srv, send)
        text, reasoning, calls, usage = "", "", {}, chunks[-1].usage
        for ch in chunks:
            for c in ch.choices:
                text += c.delta.content or ""
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        calls = [calls[k] for k in sorted(calls)]
        turns.append(Turn(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens,
                          grew, rec["cache"]["source"], rec["diagnostics"],
                          [(c["name"], json.loads(c["arguments"])) for c in calls],
                          [text, reasoning] + [c["arguments"] for c in calls], [reasoning] if reasoning else []))
        msg = {"role": "assistant", "content": text or None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        msgs.append(msg)
        if calls:
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": RESULT} for c in calls]
        elif followed:
            break
        else:
            msgs.append({"role": "user", "content": FOLLOW_UP})
            followed = True
    return turns


def responses_loop(srv, question: str, stored: bool) -> list[Turn]:
    """Streaming through the SDK's Responses helper; either stateless replay of every output item
    (Codex style: store false, encrypted reasoning) or previous_response_id (store true)."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}]
    history = [{"role": "user", "content": question}]
    new, prev, turns, followed = history, None, [], False
    for _ in range(5):
        kw = ({"previous_response_id": prev, "store": True} if stored and prev else
              {"store": stored, "include": [] if stored else ["reasoning.encrypted_content"]})

        def send():
            with client.responses.stream(model="m", instructions=SYSTEM, tools=tools, max_output_tokens=160,
                                         input=new if stored else history, **kw) as s:
                return s.get_final_response()
        r, grew, rec = measured(srv, send)
        calls = [o for o in r.output if o.type == "function_call"]
        reasoning = [o for o in r.output if o.type == "reasoning"]
        thinking = ["".join(p.text for p in o.summary) for o in reasoning]
        turns.append(Turn(r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens,
                          grew, rec["cache"]["source"], rec["diagnostics"],
                          [(c.name, json.loads(c.arguments)) for c in calls],
                          [r.output_text] + thinking + [c.arguments for c in calls], thinking))
        assert not stored or not reasoning or reasoning[0].encrypted_content is None
        assert stored or not reasoning or reasoning[0].encrypted_content.startswith("z5e1.")
        if calls:
            new = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT} for c in calls]
        elif followed:
            break
        else:
            new, followed = [{"role": "user", "content": FOLLOW_UP}], True
        history = history + [o.model_dump(exclude_none=True) for o in r.output] + new
        prev = r.id
    return turns


LOOPS = {"anthropic": anthropic_loop, "chat": chat_loop,
         "responses": lambda srv, q: responses_loop(srv, q, stored=False),
         "responses_stored": lambda srv, q: responses_loop(srv, q, stored=True)}


@pytest.mark.parametrize("protocol", list(LOOPS))
def test_tool_loop_reuses_the_cache(model_server, protocol):
    name = model_server.model
    turns = LOOPS[protocol](model_server, QUESTION[name])
    log = [(t.source, t.prompt, t.reused, t.prefilled_metric, [c[0] for c in t.calls]) for t in turns]
    print(f"\n{name} {protocol}: " + "; ".join(f"{s} prompt {p} reused {r} prefilled {f} calls {c}"
                                               for s, p, r, f, c in log))
    assert turns[0].calls, f"the model called no tool: {log}"
    for prev, t in zip(turns, turns[1:]):
        assert t.reused >= prev.prompt, log                  # everything before is reused
        assert t.prefilled_metric == t.prompt - t.reused, log  # /metrics: only the suffix was prefilled
        if prev.calls:
            # usually live; a prefix rung that kept every cached token is the same work (seen
            # when dsml-tiny's chat-mode turn did not end cleanly after its block)
            assert t.source in ("live", "token_prefix", "text_prefix"), log
        assert t.prefilled_metric < t.prompt / 2, log
    for t in turns:
        assert not [d for d in t.diagnostics if "signature" in d or "canonical" in d or "redacted" in d], \
            t.diagnostics
        for shown in t.visible:
            assert not any(m in (shown or "") for m in MARKUP), shown
    if name == "dsml-tiny":
        assert all(t.thinking for t in turns), "dsml-tiny thinks on every turn"
        if protocol == "anthropic":
            assert all(sig.startswith("z5s1.") for t in turns for _, sig in t.thinking)


@pytest.mark.parametrize("thread", [False, None], ids=["thread_false", "thread_default"])
def test_anthropic_sdk_tool_runner(model_server, thread):
    client = anthropic.Anthropic(base_url=model_server.url, api_key="k", max_retries=0)
    name = model_server.model
    cities = []

    @anthropic.beta_tool(input_schema=SCHEMA)          # the schema the model was tuned with
    def get_weather(city: str) -> str:
        """Get the current weather for a city"""
        cities.append(city)
        return RESULT

    n0 = len(model_server.trace())
    kw = {} if thread is None else {"thread": thread}
    runner = client.beta.messages.tool_runner(model="zen5-local", max_tokens=160, system=SYSTEM,
                                              tools=[get_weather], max_iterations=3,
                                              messages=[{"role": "user", "content": QUESTION[name]}], **kw)
    messages = list(runner)
    assert len(messages) >= 2 and any(b.type == "tool_use" for b in messages[0].content)
    if name == "smollm2-tools":     # (dsml-tiny calls a Bash tool it was trained on: the runner
        assert cities               #  answers it with an is_error result, and the loop goes on)
    second = model_server.trace()[n0 + 1]
    assert second["cache"]["source"] == "live" and second["cache"]["reused"] > second["cache"]["prefilled"]
