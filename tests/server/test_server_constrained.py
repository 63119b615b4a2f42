"""Constrained decoding through the real server (issue 8's evidence at the protocol level).

A real `python -m zen5 serve` on SmolLM2-135M (which never calls tools by itself), driven by the
real `openai` and `anthropic` SDKs at temperature 1:

* forced tool calls: per protocol (Chat Completions, Responses, Anthropic Messages) 100 requests
  over 10 varied schemas (strings with lengths and patterns, integers and numbers with bounds,
  booleans, enums, nullable types, nested objects, arrays of scalars and of objects, required
  properties), forced by "required" / `any` or by name, a fifth of them streamed; every call
  returned validates against its tool's schema (jsonschema).
* structured outputs: per protocol 100 `json_schema` answers (Chat `response_format`, Responses
  `text.format`, Anthropic `output_config.format`) over 10 schemas all parse and validate.
* `parallel_tool_calls: false` / `disable_parallel_tool_use` give at most one call, `none` none
  (on the tool-tuned model, which does call under `auto`), a Responses custom tool's input
  matches its Lark or regex grammar (non-streaming and streamed with its
  `response.custom_tool_call_input.*` events) and replays live through `custom_tool_call_output`;
  the same through Chat Completions (`{"type": "custom", "custom": {...}}` tools and tool calls,
  streamed `custom.input` fragments, replayed with a `tool` message); malformed formats, tools
  and tool choices are 400s naming the field.
* DeepSeek V4 (the tiny random-weight model): a forced call through the server is DSML that the
  strict official parser reads, in chat mode and in thinking mode under Anthropic's
  `budget_tokens`; a json_schema response format is stated in the prompt.
"""
from __future__ import annotations

import json
import re
import time

import anthropic
import jsonschema
import openai
import pytest
import requests
from lark import Lark
from serverlib import sse_events

pytestmark = pytest.mark.model

N = 100                      # requests per protocol and kind (10 schemas x 10)
HOT = 1.0


def replay_diagnostics(rec: dict) -> list[str]:
    """The trace's diagnostics about the replayed history (a degrade would be one). Notes about the
    follow-up's own new output are dropped: a 2-16 token answer cut at its limit may end inside a
    <tool_call> it started (seen once in CI), which says nothing about the replay."""
    return [d for d in rec["diagnostics"] if not d.startswith("model output not executable")]


def obj(props: dict, required: list) -> dict:
    return {"type": "object", "properties": props, "required": required}


def S(n: int) -> dict:  # noqa: N802
    return {"type": "string", "maxLength": n}


def I(lo: int, hi: int) -> dict:  # noqa: N802,E743
    return {"type": "integer", "minimum": lo, "maximum": hi}


def E(*values) -> dict:  # noqa: N802
    return {"enum": list(values)}


BOOL, CUR = {"type": "boolean"}, E("USD", "EUR", "GBP")
TOOLS = [  # (name, description, parameters)
    ("get_weather", "Weather forecast for a city",
     obj({"city": S(16), "unit": E("celsius", "fahrenheit"), "days": I(1, 7)}, ["city", "unit"])),
    ("set_alarm", "Set an alarm",
     obj({"hour": I(0, 23), "minute": I(0, 59), "repeat": BOOL, "label": S(12)}, ["hour", "minute", "repeat"])),
    ("add_item", "Add an item to the shopping list",
     obj({"item": obj({"name": S(12), "qty": I(1, 99), "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                      ["name", "qty"]),
          "tags": {"type": "array", "items": E("food", "home", "work"), "maxItems": 3}}, ["item", "tags"])),
    ("search", "Search the web",
     obj({"query": S(20), "filters": obj({"lang": E("en", "fr", "de"), "safe": BOOL}, ["lang"]),
          "limit": I(1, 10)}, ["query", "filters"])),
    ("move", "Move the robot",
     obj({"to": {"type": "array", "items": I(0, 9), "minItems": 2, "maxItems": 2},
          "speed": {"type": ["string", "null"], "enum": ["slow", "fast", None]}}, ["to", "speed"])),
    ("send_email", "Send an email",
     obj({"to": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}, "subject": S(16), "urgent": BOOL},
         ["to", "subject"])),
    ("create_event", "Create a calendar event",
     obj({"title": S(16), "attendees": {"type": "array", "maxItems": 2,
                                        "items": obj({"name": S(10), "rsvp": E("yes", "no", "maybe")},
                                                     ["name", "rsvp"])}},
         ["title", "attendees"])),
    ("rate", "Rate a restaurant",
     obj({"score": {"type": "number", "minimum": 0, "maximum": 5}, "category": E("food", "service", "price"),
          "comment": S(20)}, ["score", "category"])),
    ("convert", "Convert money",
     obj({"amount": {"type": "number", "minimum": 0, "maximum": 10000}, "from": CUR, "to": CUR},
         ["amount", "from", "to"])),
    ("set_config", "Change the settings",
     obj({"settings": obj({"theme": E("light", "dark"),
                           "font": obj({"size": I(8, 32), "family": E("serif", "sans")}, ["size"])},
                          ["theme", "font"]),
          "dry_run": BOOL}, ["settings"])),
]
SCHEMA_OF = {name: params for name, _d, params in TOOLS}
ANSWERS = [
    obj({"name": S(16), "age": I(0, 120), "email": S(24)}, ["name", "age"]),
    obj({"items": {"type": "array", "maxItems": 3, "items": obj({"id": I(0, 999), "done": BOOL}, ["id", "done"])}},
        ["items"]),
    obj({"answer": E("yes", "no", "maybe"), "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        ["answer", "confidence"]),
    obj({"user": obj({"first": S(10), "last": S(10)}, ["first", "last"]),
         "roles": {"type": "array", "items": E("admin", "dev", "ops"), "maxItems": 2}}, ["user", "roles"]),
    obj({"x": I(-100, 100), "y": I(-100, 100), "label": {"type": ["string", "null"], "maxLength": 8}}, ["x", "y"]),
    obj({"city": S(16), "country": E("FR", "DE", "IT", "ES"), "population": I(0, 10_000_000)}, ["city", "country"]),
    obj({"scores": {"type": "array", "items": I(0, 9), "minItems": 1, "maxItems": 4}}, ["scores"]),
    obj({"r": I(0, 255), "g": I(0, 255), "b": I(0, 255), "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
        ["r", "g", "b"]),
    obj({"title": S(20), "year": I(1900, 2030), "available": BOOL,
         "genres": {"type": "array", "items": E("fiction", "history", "science"), "minItems": 1, "maxItems": 2}},
        ["title", "year", "genres"]),
    obj({"temp": {"type": "number", "minimum": -50, "maximum": 50}, "conditions": E("sunny", "rain", "snow", "cloudy"),
         "wind": obj({"speed": I(0, 200), "dir": E("N", "E", "S", "W")}, ["speed"])}, ["temp", "conditions"]),
]
PROMPTS = ("Hello there!", "What can you do?", "Tell me a joke.", "I need help with my day.", "Paris or Rome?",
           "Good morning", "Plan my week please.", "What is 2+2?", "Describe yourself.", "Any news today?")
# Budgets above the longest text the bounded schemas allow, so a sampled call or answer at
# temperature 1 is never cut short: with every string character a 6-byte escape (`\\u0006`) and
# compact JSON, the longest call (create_event, in `<tool_call>` tags with its name) is 370 bytes
# and the longest answer (ANSWERS[0]) 277, and every token adds at least one byte. Most requests
# end far earlier.
CALL_TOKENS, ANSWER_TOKENS = 400, 400

PATCH_GRAMMAR = r'''
start: "*** Begin Patch\n" hunk hunk? "*** End Patch"
hunk: "*** Add File: " FILENAME "\n" line line?
line: "+" LINE "\n"
FILENAME: /[a-z_]{1,12}\.py/
LINE: /[ -~]{1,30}/
'''
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the files",
              "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
WORDS = r"[a-z]{1,8}( [a-z]{1,8}){0,3}"
WORDS_MAX = 110  # the call's longest text (35 characters in its wrapper) is 103 bytes; a token adds >= 1
WORDS_TOOL = {"type": "custom", "name": "say", "description": "Say a few words",
              "format": {"type": "grammar", "syntax": "regex", "definition": WORDS}}
SHELL_TOOL = {"type": "function", "name": "shell", "description": "Run a command", "strict": True,
              "parameters": obj({"cmd": S(30)}, ["cmd"])}


def openai_client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)


def anthropic_client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)


def validate(instance, schema) -> None:
    jsonschema.Draft202012Validator(schema).validate(instance)


# ---- one request per protocol: (calls as [(name, arguments object)], finish, text) ---------------
def chat_tools(names, strict):
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": p, "strict": strict}}
            for n, d, p in TOOLS if n in names]


def chat_send(srv, prompt, seed, stream, **kw):
    client = openai_client(srv)
    kw = {"model": "zen5-local", "messages": [{"role": "user", "content": prompt}], "temperature": HOT,
          "seed": seed, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return calls, r.choices[0].finish_reason, m.content or ""
    calls, text, finish = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += (tc.function.name or "") if tc.function else ""
                entry[1] += (tc.function.arguments or "") if tc.function else ""
    return [(n, json.loads(a)) for n, a in calls.values()], finish, text


def responses_send(srv, prompt, stream, **kw):
    client = openai_client(srv)
    kw = {"model": "zen5-local", "input": prompt, "temperature": HOT, **kw}
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    return calls, r.status, r.output_text, r


def anthropic_send(srv, prompt, stream, **kw):
    client = anthropic_client(srv)
    kw = {"model": "zen5-local", "messages": [{"role": "user", "content": prompt}], "extra_body": {"temperature": HOT},
          **kw}
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    calls = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
    return calls, m.stop_reason, "".join(b.text for b in m.content if b.type == "text")


def forced(srv, protocol: str, i: int):
    """Request i of the forced-call run: tool k = i // 10 of the 10, forced by name (the first
    five of its ten requests) or by "required" / any (the other five, with tool k+1 offered
    beside it); one call at most; two of the ten streamed. Consecutive requests share their
    tools, so the server prefills little more than the user message."""
    k, j = divmod(i, 10)
    names = {TOOLS[k][0]} if j < 5 else {TOOLS[k][0], TOOLS[(k + 1) % len(TOOLS)][0]}
    named = TOOLS[k][0] if j < 5 else None
    prompt, stream, strict = PROMPTS[j], j % 5 == 0, j % 2 == 0
    if protocol == "chat":
        choice = {"type": "function", "function": {"name": named}} if named else "required"
        calls, finish, _ = chat_send(srv, prompt, i, stream, tools=chat_tools(names, strict), tool_choice=choice,
                                     parallel_tool_calls=False, max_tokens=CALL_TOKENS)
        ok_finish = finish == "tool_calls"
    elif protocol == "responses":
        tools = [{"type": "function", "name": n, "description": d, "parameters": p, "strict": strict}
                 for n, d, p in TOOLS if n in names]
        choice = {"type": "function", "name": named} if named else "required"
        calls, finish, _, r = responses_send(srv, prompt, stream, tools=tools, tool_choice=choice,
                                             parallel_tool_calls=False, max_output_tokens=CALL_TOKENS)
        ok_finish = finish == "completed" and r.parallel_tool_calls is False
    else:
        tools = [{"name": n, "description": d, "input_schema": p, "strict": strict} for n, d, p in TOOLS if n in names]
        choice = ({"type": "tool", "name": named} if named else {"type": "any"}) | {"disable_parallel_tool_use": True}
        calls, finish, _ = anthropic_send(srv, prompt, stream, tools=tools, tool_choice=choice, max_tokens=CALL_TOKENS)
        ok_finish = finish == "tool_use"
    problems = []
    if not ok_finish or len(calls) != 1:
        problems.append(f"finish {finish}, {len(calls)} calls")
    for name, args in calls:
        if name not in names or (named and name != named):
            problems.append(f"called {name}, allowed {sorted(names)}")
            continue
        try:
            validate(args, SCHEMA_OF[name])
        except jsonschema.ValidationError as e:
            problems.append(f"{name} {args}: {e.message}")
    return problems


def answered(srv, protocol: str, i: int):
    """Request i of the structured-output run: answer schema i // 10, two of its ten streamed."""
    k, j = divmod(i, 10)
    schema = ANSWERS[k]
    prompt, stream = PROMPTS[j], j % 5 == 0
    if protocol == "chat":
        fmt = {"type": "json_schema", "json_schema": {"name": f"answer{k}", "strict": True, "schema": schema}}
        _, finish, text = chat_send(srv, prompt, 1000 + i, stream, response_format=fmt, max_tokens=ANSWER_TOKENS)
        ok_finish = finish == "stop"
    elif protocol == "responses":
        fmt = {"type": "json_schema", "name": f"answer{k}", "strict": True, "schema": schema}
        _, finish, text, r = responses_send(srv, prompt, stream, text={"format": fmt}, max_output_tokens=ANSWER_TOKENS)
        ok_finish = finish == "completed" and r.text.format.type == "json_schema"
    else:
        _, finish, text = anthropic_send(srv, prompt, stream, max_tokens=ANSWER_TOKENS,
                                         output_config={"format": {"type": "json_schema", "schema": schema}})
        ok_finish = finish == "end_turn"
    if not ok_finish:
        return [f"finish {finish}: {text!r}"]
    try:
        validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return [f"{text!r}: {e}"]
    return []


def run_evidence(srv, protocol: str, kind: str, one) -> None:
    t0, failures = time.time(), {}
    for i in range(N):
        problems = one(srv, protocol, i)
        if problems:
            failures[i] = problems
    valid = N - len(failures)
    print(f"\n{protocol} {kind}: {valid}/{N} valid at temperature {HOT} ({time.time() - t0:.0f} s)")
    assert not failures, failures


PROTOCOLS = ["chat", "responses", "anthropic"]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_forced_calls_always_validate(smollm2_server, protocol):
    run_evidence(smollm2_server, protocol, "forced tool calls", forced)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_json_schema_outputs_always_validate(smollm2_server, protocol):
    run_evidence(smollm2_server, protocol, "json_schema outputs", answered)


def test_json_object_and_non_strict_formats_are_json(smollm2_server):
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "p", "schema": ANSWERS[0]}}):  # strict: false
        _, finish, text = chat_send(smollm2_server, "Who are you?", 7, False, response_format=fmt, max_tokens=160)
        if finish == "stop":  # an open object may run long: only a finished one must parse
            assert isinstance(json.loads(text), dict), text
    _, finish, text = chat_send(smollm2_server, "Who are you?", 7, False, response_format={"type": "text"},
                                max_tokens=8)
    assert finish in ("stop", "length")


# ---- tool choice and parallel calls ---------------------------------------------------------------
CITIES = "What is the weather in Lisbon, Oslo and Cairo? Check all three cities."
WEATHER = TOOLS[0]


def test_parallel_false_gives_exactly_one_call(smollm2_server):
    srv = smollm2_server
    tools = chat_tools({WEATHER[0]}, False)
    for seed in range(3):
        calls, finish, _ = chat_send(srv, CITIES, seed, False, tools=tools, tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=CALL_TOKENS)
        assert finish == "tool_calls" and len(calls) == 1, calls
        calls, finish, _ = chat_send(srv, CITIES, seed, False, tools=tools, tool_choice="required",
                                     max_tokens=3 * CALL_TOKENS)
        assert calls
        for _name, args in calls[:-1] if finish == "length" else calls:
            validate(args, WEATHER[2])
    rtools = [{"type": "function", "name": WEATHER[0], "description": WEATHER[1], "parameters": WEATHER[2]}]
    calls, status, _, r = responses_send(srv, CITIES, False, tools=rtools, tool_choice="required",
                                         parallel_tool_calls=False, max_output_tokens=CALL_TOKENS)
    assert status == "completed" and len(calls) == 1 and r.parallel_tool_calls is False
    atools = [{"name": WEATHER[0], "description": WEATHER[1], "input_schema": WEATHER[2]}]
    calls, stop, _ = anthropic_send(srv, CITIES, False, tools=atools, max_tokens=CALL_TOKENS,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert stop == "tool_use" and len(calls) == 1


def test_auto_with_parallel_false_and_none_on_the_tool_model(tools_server):
    """The tool-tuned model calls by itself under `auto` (greedy): `none` then gives no call at
    all, and `parallel_tool_calls: false` / `disable_parallel_tool_use` at most one."""
    srv = tools_server
    tools = chat_tools({WEATHER[0]}, False)
    client = openai_client(srv)

    def chat(**kw):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": CITIES}], tools=tools,
                                           max_tokens=3 * CALL_TOKENS, **kw)
        return r.choices[0].message.tool_calls or [], r.choices[0].message.content or ""

    calls, _ = chat(tool_choice="auto")
    assert calls, "the tool model no longer calls under auto; pick another prompt"
    calls, text = chat(tool_choice="none")
    assert not calls and "<tool_call>" not in text
    calls, _ = chat(tool_choice="auto", parallel_tool_calls=False)
    assert len(calls) <= 1
    r = openai_client(srv).responses.create(
        model="m", input=CITIES, tool_choice="none", max_output_tokens=CALL_TOKENS,
        tools=[{"type": "function", "name": WEATHER[0], "description": WEATHER[1], "parameters": WEATHER[2]}])
    assert not [o for o in r.output if o.type == "function_call"] and "<tool_call>" not in r.output_text
    m = anthropic_client(srv).messages.create(
        model="m", max_tokens=3 * CALL_TOKENS, messages=[{"role": "user", "content": CITIES}],
        tools=[{"name": WEATHER[0], "description": WEATHER[1], "input_schema": WEATHER[2]}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert len([b for b in m.content if b.type == "tool_use"]) <= 1
    m = anthropic_client(srv).messages.create(
        model="m", max_tokens=CALL_TOKENS, messages=[{"role": "user", "content": CITIES}],
        tools=[{"name": WEATHER[0], "description": WEATHER[1], "input_schema": WEATHER[2]}],
        tool_choice={"type": "none"})
    assert not [b for b in m.content if b.type == "tool_use"] and m.stop_reason != "tool_use"


# ---- Responses custom tools ---------------------------------------------------------------------
PATCH_PROMPT = "Create hello.py that prints hello."
# The grammar bounds a patch to 211 printable ASCII characters; with JSON escapes (at most one
# extra character each) and the tool-call wrapper that is under 400 tokens even at one token per
# character, so a call at temperature 1 always ends inside this budget (200 was occasionally too
# few: the response came back incomplete).
PATCH_MAX = 400


def test_custom_tool_calls_follow_their_grammar(smollm2_server):
    srv, checker = smollm2_server, Lark(PATCH_GRAMMAR, parser="earley")
    client = openai_client(srv)
    for i in range(6):
        choice = {"type": "custom", "name": "apply_patch"} if i % 2 else "required"
        r = client.responses.create(model="m", input=PATCH_PROMPT, tools=[PATCH_TOOL], tool_choice=choice,
                                    parallel_tool_calls=False, temperature=HOT, max_output_tokens=PATCH_MAX)
        items = [o for o in r.output if o.type == "custom_tool_call"]
        assert r.status == "completed" and len(items) == 1 and not [o for o in r.output if o.type == "function_call"]
        item = items[0]
        assert item.name == "apply_patch" and item.call_id.startswith("call_") and item.id.startswith("ctc_")
        checker.parse(item.input)
    for i in range(4):  # a regex custom tool beside a function tool, forced by name
        r = client.responses.create(model="m", input="Say something nice.", tools=[SHELL_TOOL, WORDS_TOOL],
                                    tool_choice={"type": "custom", "name": "say"}, parallel_tool_calls=False,
                                    temperature=HOT, max_output_tokens=WORDS_MAX)
        (item,) = [o for o in r.output if o.type == "custom_tool_call"]
        assert re.fullmatch(WORDS, item.input), item.input
    # format {"type": "text"}: free-form input, still a custom_tool_call
    free = {"type": "custom", "name": "note", "description": "Write a note", "format": {"type": "text"}}
    r = client.responses.create(model="m", input="Take a note: buy milk.", tools=[free], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=40)
    assert [o.type for o in r.output] in (["custom_tool_call"], [])  # a long note may hit the limit
    if r.status == "completed":
        assert isinstance(r.output[0].input, str)


def test_custom_tool_call_streams_its_input_events(smollm2_server):
    srv, checker = smollm2_server, Lark(PATCH_GRAMMAR, parser="earley")
    body = {"model": "m", "input": PATCH_PROMPT, "tools": [PATCH_TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": HOT, "max_output_tokens": PATCH_MAX, "stream": True}
    r = requests.post(srv.url + "/v1/responses", json=body, stream=True, timeout=120)
    assert r.status_code == 200
    events = [(n, d) for n, d in sse_events(r) if n != "comment"]
    names = [n for n, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
    assert set(names[3:-3]) == {"response.custom_tool_call_input.delta"}
    added, done_item = events[2][1]["item"], events[-2][1]["item"]
    assert added["type"] == "custom_tool_call" and added["input"] == "" and added["status"] == "in_progress"
    deltas = [d for n, d in events if n == "response.custom_tool_call_input.delta"]
    assert all(d["item_id"] == added["id"] and d["output_index"] == 0 for d in deltas)
    streamed = "".join(d["delta"] for d in deltas)
    final = events[-3][1]["input"]
    assert streamed == final == done_item["input"] and done_item["status"] == "completed"
    assert done_item["call_id"] == added["call_id"] and events[-1][1]["response"]["output"] == [done_item]
    assert events[-1][1]["response"]["parallel_tool_calls"] is False
    checker.parse(final)
    seq = [d["sequence_number"] for _, d in events]
    assert seq == list(range(1, len(seq) + 1))
    # the SDK reassembles the same item
    with openai_client(srv).responses.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
        kinds = {ev.type for ev in s}
        final = s.get_final_response()
    assert "response.custom_tool_call_input.delta" in kinds and final.output[0].type == "custom_tool_call"
    checker.parse(final.output[0].input)


def test_custom_tool_call_output_replays_live(smollm2_server):
    """Codex's loop with store=false: the client replays the custom_tool_call it got and answers
    it with custom_tool_call_output; the server continues from the live state, no degrade."""
    srv, client = smollm2_server, openai_client(smollm2_server)
    r = client.responses.create(model="m", input=[{"role": "user", "content": PATCH_PROMPT}], tools=[PATCH_TOOL],
                                tool_choice="required", parallel_tool_calls=False, store=False, temperature=HOT,
                                max_output_tokens=PATCH_MAX)
    (call,) = r.output
    replay = [{"role": "user", "content": PATCH_PROMPT}, call.model_dump(exclude_none=True),
              {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    r2 = client.responses.create(model="m", input=replay, tools=[PATCH_TOOL], store=False, temperature=0,
                                 max_output_tokens=16)
    rec = srv.trace()[-1]
    assert rec["cache"]["source"] == "live" and replay_diagnostics(rec) == [], rec
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1
    assert json.dumps(call.input, ensure_ascii=False)[1:-1] in rec["prompt"]
    # stored: previous_response_id carries the custom call the same way
    r = client.responses.create(model="m", input=PATCH_PROMPT, tools=[PATCH_TOOL], tool_choice="required",
                                parallel_tool_calls=False, temperature=HOT, max_output_tokens=PATCH_MAX)
    client.responses.create(model="m", previous_response_id=r.id, tools=[PATCH_TOOL], temperature=0,
                            max_output_tokens=16,
                            input=[{"type": "custom_tool_call_output", "call_id": r.output[0].call_id,
                                    "output": "Done!"}])
    rec = srv.trace()[-1]
    assert rec["cache"]["source"] == "live" and replay_diagnostics(rec) == [], rec


# ---- Chat Completions custom tools ----------------------------------------------------------------
CHAT_PATCH_TOOL = {"type": "custom", "custom": {
    "name": "apply_patch", "description": "Apply a patch to the files",
    "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": PATCH_GRAMMAR}}}}
CHAT_WORDS_TOOL = {"type": "custom", "custom": {
    "name": "say", "description": "Say a few words",
    "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": WORDS}}}}


def delta_custom(tc) -> dict:
    """A streamed tool-call delta's `custom` part (this SDK keeps it as an untyped extra field)."""
    c = getattr(tc, "custom", None)
    return {} if c is None else c if isinstance(c, dict) else c.model_dump(exclude_none=True)


def test_chat_custom_tool_calls_follow_their_grammar(smollm2_server):
    srv, checker = smollm2_server, Lark(PATCH_GRAMMAR, parser="earley")
    client = openai_client(srv)
    msgs = [{"role": "user", "content": PATCH_PROMPT}]
    for i in range(4):
        choice = {"type": "custom", "custom": {"name": "apply_patch"}} if i % 2 else "required"
        r = client.chat.completions.create(model="m", messages=msgs, tools=[CHAT_PATCH_TOOL], tool_choice=choice,
                                           parallel_tool_calls=False, temperature=HOT, seed=i, max_tokens=PATCH_MAX)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1, m
        call = m.tool_calls[0]
        assert call.type == "custom" and call.custom.name == "apply_patch" and call.id.startswith("call_")
        checker.parse(call.custom.input)
    # a regex custom tool beside a function tool, forced by name
    shell = {"type": "function", "function": {k: v for k, v in SHELL_TOOL.items() if k != "type"}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say something nice."}],
                                       tools=[shell, CHAT_WORDS_TOOL], tool_choice={"type": "custom", "custom": {
                                           "name": "say"}}, parallel_tool_calls=False, temperature=HOT, seed=9,
                                       max_tokens=WORDS_MAX)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "custom" and re.fullmatch(WORDS, call.custom.input), call


def test_chat_custom_tool_call_streams_its_input(smollm2_server):
    srv, checker = smollm2_server, Lark(PATCH_GRAMMAR, parser="earley")
    deltas, finish = [], None
    for chunk in openai_client(srv).chat.completions.create(
            model="m", messages=[{"role": "user", "content": PATCH_PROMPT}], tools=[CHAT_PATCH_TOOL],
            tool_choice="required", parallel_tool_calls=False, temperature=HOT, seed=5, max_tokens=PATCH_MAX,
            stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            deltas += choice.delta.tool_calls or []
    assert finish == "tool_calls" and deltas
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.type == "custom" and first.function is None
    assert delta_custom(first) == {"name": "apply_patch", "input": ""}
    assert all(d.index == 0 and d.id is None and d.function is None and set(delta_custom(d)) == {"input"}
               for d in rest)
    streamed = "".join(delta_custom(d)["input"] for d in rest)
    checker.parse(streamed)
    (logged,) = srv.trace()[-1]["output"]["tool_calls"]
    assert logged["id"] == first.id and json.loads(logged["arguments"])["input"] == streamed


def test_chat_custom_tool_call_replays_live(smollm2_server):
    """The client sends back the assistant message with its custom tool call and a `tool` result:
    the server continues from the live state, the call re-rendered byte for byte, no degrade."""
    srv, client = smollm2_server, openai_client(smollm2_server)
    msgs = [{"role": "user", "content": PATCH_PROMPT}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[CHAT_PATCH_TOOL], tool_choice="required",
                                       parallel_tool_calls=False, temperature=HOT, seed=11, max_tokens=PATCH_MAX)
    m = r.choices[0].message
    (call,) = m.tool_calls
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Done!"}]
    assert msgs[1]["tool_calls"][0]["type"] == "custom"
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=[CHAT_PATCH_TOOL], temperature=0,
                                        max_tokens=16)
    rec = srv.trace()[-1]
    assert rec["cache"]["source"] == "live" and replay_diagnostics(rec) == [], rec
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert json.dumps(call.custom.input, ensure_ascii=False)[1:-1] in rec["prompt"]


# ---- echoes and 400s ------------------------------------------------------------------------------
def test_responses_echo_parallel_and_format(smollm2_server):
    fmt = {"type": "json_schema", "name": "verdict", "strict": True, "schema": ANSWERS[2]}
    r = openai_client(smollm2_server).responses.create(model="m", input="Is it raining?", temperature=HOT,
                                                       text={"format": fmt}, parallel_tool_calls=False,
                                                       max_output_tokens=ANSWER_TOKENS)
    assert r.parallel_tool_calls is False and r.text.format.type == "json_schema" and r.text.format.name == "verdict"
    validate(json.loads(r.output_text), ANSWERS[2])
    r = openai_client(smollm2_server).responses.create(model="m", input="Hi", max_output_tokens=4)
    assert r.parallel_tool_calls is True and r.text.format.type == "text"


def post(srv, path, body):
    return requests.post(srv.url + path, json=body, timeout=60)


CHAT_MSG = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RESP_MSG = {"model": "m", "input": "hi", "max_output_tokens": 4}
ANTH_MSG = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD = [  # (path, body, words the error message must contain)
    ("/v1/chat/completions", {**CHAT_MSG, "response_format": {"type": "yaml"}}, ["response_format.type", "'yaml'"]),
    ("/v1/chat/completions", {**CHAT_MSG, "response_format": "json"}, ["response_format", "object"]),
    ("/v1/chat/completions", {**CHAT_MSG, "response_format": {"type": "json_schema"}},
     ["response_format.json_schema", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     ["response_format.json_schema.schema", "object"]),
    ("/v1/chat/completions", {**CHAT_MSG, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}, "strict": "yes"}}}, ["response_format.json_schema.strict", "boolean"]),
    ("/v1/chat/completions", {**CHAT_MSG, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": 5}}}, "strict": True}}}, ["schema"]),
    ("/v1/chat/completions", {**CHAT_MSG, "parallel_tool_calls": "no"}, ["parallel_tool_calls", "boolean"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [FN], "tool_choice": "always"}, ["tool_choice", "'always'"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [FN], "tool_choice": {"type": "function", "function": {}}},
     ["tool_choice.function.name", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [FN], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, ["'g'", "not among the tools"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tool_choice": "required"}, ["required", "tool"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{**FN, "function": {**FN["function"], "strict": 1}}]},
     ["tools[0].function.strict", "boolean"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "name": "p"}]},
     ["tools[0].custom", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "custom": {"format": {"type": "text"}}}]},
     ["tools[0].custom.name", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "custom": {"name": "p", "format": {
        "type": "yaml"}}}]}, ["tools[0].custom.format.type", "'yaml'"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "custom": {"name": "p", "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: \"x\""}}}]},   # the Responses shape
     ["tools[0].custom.format.grammar", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "custom": {"name": "p", "format": {
        "type": "grammar", "grammar": {"syntax": "ebnf", "definition": "x"}}}}]},
     ["tools[0].custom.format.grammar.syntax", "'ebnf'"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "custom": {"name": "p", "format": {
        "type": "grammar", "grammar": {"syntax": "lark"}}}}]},
     ["tools[0].custom.format.grammar.definition", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [{"type": "custom", "custom": {"name": "p", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": "start: ("}}}}], "tool_choice": "required"},
     ["custom tool 'p'", "grammar"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [FN], "tool_choice": {"type": "custom"}},
     ["tool_choice.custom", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [FN], "tool_choice": {"type": "custom", "custom": {
        "name": "g"}}}, ["'g'", "not among the tools"]),
    ("/v1/chat/completions", {**CHAT_MSG, "tools": [FN], "tool_choice": {"type": "allowed_tools"}},
     ["tool_choice.type", "'allowed_tools'"]),
    ("/v1/chat/completions", {**CHAT_MSG, "messages": [CHAT_MSG["messages"][0], {
        "role": "assistant", "tool_calls": [{"id": "call_1", "type": "custom"}]}]},
     ["messages[1].tool_calls[0].custom", "required"]),
    ("/v1/chat/completions", {**CHAT_MSG, "messages": [CHAT_MSG["messages"][0], {
        "role": "assistant", "tool_calls": [{"id": "call_1", "type": "custom",
                                             "custom": {"name": "p", "input": 3}}]}]},
     ["messages[1].tool_calls[0].custom.input", "string"]),
    ("/v1/responses", {**RESP_MSG, "text": {"format": {"type": "xml"}}}, ["text.format.type", "'xml'"]),
    ("/v1/responses", {**RESP_MSG, "text": {"format": {"type": "json_schema", "name": "x"}}},
     ["text.format.schema", "required"]),
    ("/v1/responses", {**RESP_MSG, "text": {"format": "json"}}, ["text.format", "object"]),
    ("/v1/responses", {**RESP_MSG, "parallel_tool_calls": 0}, ["parallel_tool_calls", "boolean"]),
    ("/v1/responses", {**RESP_MSG, "tools": [{"type": "custom", "name": "p", "format": {"type": "grammar",
                                                                                         "syntax": "ebnf",
                                                                                         "definition": "x"}}]},
     ["tools[0].format.syntax", "'ebnf'"]),
    ("/v1/responses", {**RESP_MSG, "tools": [{"type": "custom", "name": "p", "format": {"type": "grammar",
                                                                                         "syntax": "lark"}}]},
     ["tools[0].format.definition", "required"]),
    ("/v1/responses", {**RESP_MSG, "tools": [{"type": "custom", "name": "p", "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: ("}}], "tool_choice": "required"},
     ["custom tool 'p'", "grammar"]),
    ("/v1/responses", {**RESP_MSG, "tools": [{"type": "custom", "name": "p", "format": {"type": "yaml"}}]},
     ["tools[0].format.type", "'yaml'"]),
    ("/v1/responses", {**RESP_MSG, "tool_choice": {"type": "web_search"}}, ["tool_choice.type", "'web_search'"]),
    ("/v1/responses", {**RESP_MSG, "tool_choice": {"type": "custom"}}, ["tool_choice.name", "required"]),
    ("/v1/messages", {**ANTH_MSG, "output_config": {"format": {"type": "json_object"}}},
     ["output_config.format.type", "'json_schema'"]),
    ("/v1/messages", {**ANTH_MSG, "output_config": {"format": {"type": "json_schema"}}},
     ["output_config.format.schema", "required"]),
    ("/v1/messages", {**ANTH_MSG, "output_config": {"format": {"type": "json_schema", "schema": []}}},
     ["output_config.format.schema", "object"]),
    ("/v1/messages", {**ANTH_MSG, "output_config": "json"}, ["output_config", "object"]),
    ("/v1/messages", {**ANTH_MSG, "tool_choice": {"type": "some"}}, ["tool_choice.type", "'some'"]),
    ("/v1/messages", {**ANTH_MSG, "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}},
     ["tool_choice.disable_parallel_tool_use", "boolean"]),
    ("/v1/messages", {**ANTH_MSG, "thinking": {"type": "enabled", "budget_tokens": "many"}},
     ["thinking.budget_tokens", "integer"]),
    ("/v1/messages", {**ANTH_MSG, "tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": "on"}]},
     ["tools[0].strict", "boolean"]),
]


def test_malformed_constraint_fields_are_400_with_a_clear_message(smollm2_server):
    for path, body, words in BAD:
        r = post(smollm2_server, path, body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert all(w in err["message"] for w in words), (body, err["message"])
        assert err["type"] == "invalid_request_error"


# ---- DeepSeek V4 (tiny random-weight model): DSML through the server ---------------------------
def sampled_turn(prompt: str) -> str:
    """The previous assistant turn as sampled, from a live continuation's prompt: the text after
    the last-but-one `<｜Assistant｜>`, up to and including its end-of-sentence token."""
    turn = prompt.split("<｜Assistant｜>")[-2]
    return turn[:turn.index("<｜end▁of▁sentence｜>") + len("<｜end▁of▁sentence｜>")]


def test_dsml_forced_calls_parse_with_the_official_parser(dsml_server):
    from zen5.dialects.deepseek_v4 import parse_message_from_completion_text

    srv = dsml_server
    tools = chat_tools({"get_weather", "search"}, True)
    client = openai_client(srv)
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "search"}}]):
        msgs = [{"role": "user", "content": "Do something useful."}]
        r = client.chat.completions.create(model="m", messages=msgs, tools=tools, tool_choice=choice, seed=i,
                                           temperature=HOT, max_tokens=400, reasoning_effort="none")
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls
        msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": c.id, "content": "ok"}
                                                      for c in m.tool_calls]
        client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=2, reasoning_effort="none")
        rec = srv.trace()[-1]
        assert rec["cache"]["source"] == "live"
        text = sampled_turn(rec["prompt"])
        assert text.startswith("</think>")
        parsed = parse_message_from_completion_text(text[len("</think>"):], "chat")
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]]
        assert got == [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]
        for name, args in got:
            validate(args, SCHEMA_OF[name])
    # Anthropic thinking with budget_tokens: the reasoning is capped, then the forced call follows
    aclient = anthropic_client(srv)
    atools = [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOLS[:3]]
    msgs = [{"role": "user", "content": "Set an alarm."}]
    m = aclient.messages.create(model="m", max_tokens=400, messages=msgs, tools=atools,
                                tool_choice={"type": "tool", "name": "set_alarm", "disable_parallel_tool_use": True},
                                thinking={"type": "enabled", "budget_tokens": 8}, extra_body={"temperature": HOT})
    kinds = [b.type for b in m.content]
    assert m.stop_reason == "tool_use" and kinds == ["thinking", "tool_use"], kinds
    assert m.usage.output_tokens <= 400
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id, "content": "ok"}]}]
    aclient.messages.create(model="m", max_tokens=2, messages=msgs, tools=atools)
    rec = srv.trace()[-1]
    assert rec["cache"]["source"] == "live" and replay_diagnostics(rec) == []
    text = sampled_turn(rec["prompt"])
    assert text.startswith("<think>")
    parsed = parse_message_from_completion_text(text[len("<think>"):], "thinking")
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["set_alarm"]
    validate(json.loads(parsed["tool_calls"][0]["function"]["arguments"]), SCHEMA_OF["set_alarm"])
    assert json.loads(parsed["tool_calls"][0]["function"]["arguments"]) == m.content[1].input
    assert parsed["reasoning_content"] == m.content[0].thinking


def test_dsml_response_format_is_in_the_prompt_and_followed(dsml_server):
    from zen5.dialects.deepseek_v4 import RESPONSE_FORMAT_PREFIX

    schema = ANSWERS[3]
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "strict": True, "schema": schema}}
    r = openai_client(dsml_server).chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Who?"}],
        response_format=fmt, temperature=HOT, seed=3, max_tokens=400, reasoning_effort="none")
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), schema)
    prompt = dsml_server.trace()[-1]["prompt"]
    want = "Answer in JSON.\n\n" + RESPONSE_FORMAT_PREFIX + json.dumps(fmt, ensure_ascii=False) + "<｜User｜>Who?"
    assert want in prompt, prompt[:600]
