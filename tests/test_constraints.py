"""Constrained decoding (constraints.py, lark_json_string.py) at the session level.

The evidence issue 8 asks for: with SmolLM2-135M (which never calls tools by itself) sampling at
temperature 1, forced tool calls always parse and their arguments validate against the tool's
schema (jsonschema), json_schema answers always parse and validate, "none" never yields a call,
parallel_tool_calls false yields exactly one, custom tools' inputs always match their Lark
grammar (checked with the `lark` package); with the tiny random-weight DeepSeek-vocabulary model,
forced DSML calls parse with the strict official parser in thinking and chat mode. The grammar
helpers are also tested without a model: canonical renderings are accepted, the JSON-escaped
grammar rewrite agrees with Python's `re` on random strings.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import llguidance
import pytest
from lark import Lark

from zen5.chat_types import ChatError, ChatRequest, Finish, Message, TextDelta, ThinkingDone, ToolCallDone, ToolSpec
from zen5.constraints import Demand, demand_of, llg_tokenizer
from zen5.dialects.chatml import ChatMLDialect
from zen5.dialects.deepseek_v4 import EOS, DeepSeekV4Dialect, parse_message_from_completion_text, render_tool_calls
from zen5.engine import Engine
from zen5.grammar import narrowed
from zen5.lark_json_string import GrammarError, escape_regex, json_string_grammar
from zen5.sampling import SamplingParams
from zen5.session import ChatSession
from zen5.tokenizer import Tokenizer

HOT = SamplingParams(temperature=1.0)


# ---- tools and schemas -----------------------------------------------------------------------
def tool(name, props, required, description=""):
    return ToolSpec(name, description, {"type": "object", "properties": props, "required": required})


S = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
TOOLS = (
    tool("get_weather", {"city": S(20), "unit": {"enum": ["celsius", "fahrenheit"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         ["city", "unit"], "Weather forecast for a city"),
    tool("set_alarm", {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                       "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                       "label": S(16), "repeat": {"type": "boolean"}},
         ["hour", "minute", "repeat"], "Set an alarm"),
    tool("add_item", {"item": {"type": "object", "properties": {
                          "name": S(16), "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                          "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                          "required": ["name", "qty"]},
                      "tags": {"type": "array", "items": {"enum": ["food", "home", "work"]},
                               "maxItems": 3}},
         ["item", "tags"], "Add an item to the shopping list"),
    tool("search", {"query": S(24), "filters": {"type": "object", "properties": {
                        "lang": {"enum": ["en", "fr", "de"]}, "safe": {"type": "boolean"}},
                        "required": ["lang"]},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
         ["query", "filters"], "Search the web"),
    tool("move", {"to": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                         "minItems": 2, "maxItems": 2},
                  "speed": {"type": ["string", "null"], "enum": ["slow", "fast", None]}},
         ["to", "speed"], "Move the robot"),
)
BY_NAME = {t.name: t for t in TOOLS}
PROMPTS = ("Hello there!", "What can you do?", "Tell me a joke.", "I need help with my day.",
           "Paris or Rome?", "Good morning", "Plan my week please.", "What is 2+2?")
ANSWERS = (
    {"type": "object", "properties": {"name": S(20), "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "email": S(30)}, "required": ["name", "age"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "done": {"type": "boolean"}}, "required": ["id", "done"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"first": S(12), "last": S(12)},
                                               "required": ["first", "last"]},
                                      "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                                                "maxItems": 2}},
     "required": ["user", "roles"]},
)
# Every string above may be all 6-byte escapes (`\\u0006`; a non-ASCII character is at most 4
# bytes), JSON is compact and numbers are bounded, so the longest strict answer (ANSWERS[0]) is
# 337 bytes and the longest forced call (search, in `<tool_call>` tags with its name) 270; every
# token adds at least one byte, so both always end within this many tokens (CI once sampled a
# 12-character name of escapes that ran past an earlier limit of 96).
JSON_MAX = 400
PATCH_GRAMMAR = r'''
start: "*** Begin Patch\n" hunk hunk? "*** End Patch"
hunk: "*** Add File: " FILENAME "\n" line line?
line: "+" LINE "\n"
FILENAME: /[a-z_]{1,12}\.py/
LINE: /[ -~]{1,30}/
'''
# The grammar bounds a patch to 211 printable ASCII characters: with the call's wrapper and JSON
# escapes (one extra character at most each) it always ends within this many tokens.
PATCH_MAX = 400
PATCH = ToolSpec("apply_patch", "Apply a patch", kind="custom", grammar=PATCH_GRAMMAR)


def chat(session, prompt, **kw):
    kw.setdefault("sampling", HOT)
    events = list(session.chat(ChatRequest((Message.text("user", prompt),), **kw)))
    assert isinstance(events[-1], Finish)
    return events, events[-1]


def calls_of(events):
    return [e for e in events if isinstance(e, ToolCallDone)]


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def validates(instance, schema):
    jsonschema.Draft202012Validator(schema).validate(instance)


@pytest.fixture(scope="module")
def smol(smollm2_path, tmp_path_factory):
    return ChatSession(Engine.load(smollm2_path, n_ctx=4096), "chatml",
                       state_dir=tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def ds(tiny_deepseek_dir, tmp_path_factory):
    return ChatSession(Engine.load(str(tiny_deepseek_dir), n_ctx=4096),
                       state_dir=tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def ds_tokenizer(tiny_deepseek_dir):
    return Tokenizer.from_files(tiny_deepseek_dir / "tokenizer.json")


def accepts(tokenizer, grammar, text) -> bool:
    """Whether the grammar accepts `text` (as the tokenizer spells it) as a complete output."""
    m = llguidance.LLMatcher(llg_tokenizer(tokenizer), grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()


# ---- without a model -------------------------------------------------------------------------
def test_demand_of_reads_the_neutral_fields():
    msgs = (Message.text("user", "hi"),)
    assert demand_of(ChatRequest(msgs, tools=TOOLS)) is None  # auto, nothing strict: no cost
    d = demand_of(ChatRequest(msgs, tools=TOOLS, tool_choice={"name": "move"}, parallel_tool_calls=False))
    assert (d.calls, [t.name for t in d.tools], d.parallel) == ("forced", ["move"], False)
    assert demand_of(ChatRequest(msgs, tools=(PATCH,))).calls == "auto"       # custom: constrained
    assert demand_of(ChatRequest(msgs, tools=TOOLS, tool_choice="none")).calls == "none"
    one = demand_of(ChatRequest(msgs, tools=TOOLS, parallel_tool_calls=False))  # at most one call
    assert (one.calls, one.parallel) == ("auto", False)
    assert demand_of(ChatRequest(msgs, parallel_tool_calls=False)) is None       # no tools: no cost
    loose = demand_of(ChatRequest(msgs, response_format={"type": "json_schema", "schema": ANSWERS[0]}))
    assert loose.answer == {"type": "object"} and not loose.answer_strict   # strict not set
    for bad in ({"name": "nope"}, "sometimes"):
        with pytest.raises(ValueError):
            demand_of(ChatRequest(msgs, tools=TOOLS, tool_choice=bad))
    with pytest.raises(ValueError):
        demand_of(ChatRequest(msgs, tool_choice="required"))


def test_narrowed_keeps_outputs_valid():
    s = narrowed(ANSWERS[1])
    assert s["additionalProperties"] is False
    assert s["properties"]["items"]["items"]["additionalProperties"] is False
    odd = {"type": "object", "properties": {"a": {}}, "required": ["b"]}  # would become unsatisfiable
    assert "additionalProperties" not in narrowed(odd)
    n = narrowed({"type": ["number", "null"], "minimum": 0})
    assert n["minimum"] == 0 and n["maximum"] == 10**15 and n["multipleOf"] == 1e-9
    assert narrowed({"type": "integer", "exclusiveMaximum": 5})["minimum"] == -(2**53 - 1)


def test_escape_regex_matches_the_escaped_language(ds_tokenizer):
    """The rewritten regex (Rust syntax, run by llguidance) accepts exactly the JSON escapes of
    the strings Python's `re` matches."""
    pats = [r"[a-z]+", r".*", r"(?s:.*)", r"[^x]*", r'a"b\\c', r"\d{1,3}(\.\d+)?", r"[\s\S]*",
            r"(?i)ab[c-e]", r"[^\n]{0,5}\n", r"(foo|ba+r)?[\t ]\W"]
    rng = random.Random(0)
    alphabet = list('ab"\\\n\t x.19cDEfo\x01é/r')
    for p in pats:
        g = llguidance.LLMatcher.grammar_from_regex(escape_regex(p))
        for _ in range(150):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            want = re.fullmatch(p, s) is not None
            assert accepts(ds_tokenizer, g, json.dumps(s, ensure_ascii=False)[1:-1]) == want, (p, s)


APPLY_PATCH = r'''
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
'''


def test_json_string_grammar_of_codex_apply_patch(ds_tokenizer):
    g = llguidance.grammar_from("lark", json_string_grammar(APPLY_PATCH))
    patch = ('*** Begin Patch\n*** Update File: src/a.py\n@@ def f():\n-    return "x"\n'
             "+    return 'y\\n'\n*** Add File: b.txt\n+hello\t\"world\"\n*** End Patch\n")
    esc = lambda t: json.dumps(t, ensure_ascii=False)[1:-1]  # noqa: E731
    assert accepts(ds_tokenizer, g, esc(patch))
    assert not accepts(ds_tokenizer, g, patch)                      # raw newlines are not JSON
    assert not accepts(ds_tokenizer, g, esc(patch.replace("*** End Patch\n", "")))
    recursive = 'start: "(" start ")" | "x"'                        # not regular: rules are kept
    assert accepts(ds_tokenizer, llguidance.grammar_from("lark", json_string_grammar(recursive)), "((x))")
    with pytest.raises(GrammarError):
        json_string_grammar("start: %json {}")


@pytest.mark.model
def test_chatml_grammar_accepts_canonical_calls(smol):
    tok = smol.engine.tokenizer
    d = Demand("forced", TOOLS[:2], True, None)
    g = ChatMLDialect().grammar(d)
    one = smol.dialect.render_tool_calls([("get_weather", {"city": "Paris", "unit": "celsius"})])
    two = smol.dialect.render_tool_calls([("get_weather", {"city": "Oslo", "unit": "fahrenheit", "days": 3}),
                                          ("set_alarm", {"hour": 7, "minute": 30, "repeat": False})])
    assert accepts(tok, g, one) and accepts(tok, g, two)
    assert not accepts(tok, g, "Sure! " + one)                                      # forced: no text
    assert not accepts(tok, g, one.replace('"celsius"', '"kelvin"'))               # enum
    assert not accepts(tok, ChatMLDialect().grammar(Demand("forced", TOOLS[:2], False, None)), two)
    none = ChatMLDialect().grammar(Demand("none", (), True, None))
    assert accepts(tok, none, "Just text.") and not accepts(tok, none, one)


@pytest.mark.parametrize("thinking", [False, True])
def test_dsml_grammar_accepts_canonical_calls(ds_tokenizer, thinking):
    d = Demand("forced", TOOLS, True, None)
    mode = "thinking" if thinking else "chat"
    g = DeepSeekV4Dialect().grammar(d, ds_tokenizer.token_to_id, thinking_mode=mode)
    block = render_tool_calls([("get_weather", json.dumps({"city": "Paris", "unit": "celsius"})),
                               ("add_item", json.dumps({"item": {"name": "milk", "qty": 2}, "tags": ["food"]})),
                               ("move", json.dumps({"to": [1, 2], "speed": None}))])
    prefix = "Let me check.</think>" if thinking else ""
    assert accepts(ds_tokenizer, g, prefix + block)
    assert not accepts(ds_tokenizer, g, prefix + "Sure." + block)
    assert not accepts(ds_tokenizer, g, prefix + block.replace("Paris", "Pa｜DSML｜ris"))


@pytest.mark.parametrize("thinking", [False, True])
def test_dsml_auto_grammar_with_a_custom_tool(ds_tokenizer, thinking):
    """Codex's case in DSML: free content, or content then a block whose custom input follows
    its grammar; the block opener cannot appear anywhere else."""
    mode = "thinking" if thinking else "chat"
    g = DeepSeekV4Dialect().grammar(demand_of(ChatRequest((Message.text("user", "x"),), tools=(PATCH, TOOLS[0]))),
                                    ds_tokenizer.token_to_id, thinking_mode=mode)
    prefix = "Plan.</think>" if thinking else ""
    patch = "*** Begin Patch\n*** Add File: a.py\n+print(1)\n*** End Patch"
    block = render_tool_calls([("apply_patch", json.dumps({"input": patch}))])
    assert accepts(ds_tokenizer, g, prefix + "Just text.")
    assert accepts(ds_tokenizer, g, prefix + "Patching." + block)
    assert accepts(ds_tokenizer, g, prefix + block)
    assert not accepts(ds_tokenizer, g, prefix + "Patching." + block.replace("+print", "print"))
    assert not accepts(ds_tokenizer, g, prefix + "Text ｜DSML｜ text")


def test_dropped_constraints_never_write_freed_memory(tiny_deepseek_dir):
    """A request dropped after its constraint was built (a 400 in planning, a client gone) must
    not free the mask buffer under the background computation: run in a child process, since a
    regression corrupts the heap."""
    code = f"""
import json
from zen5.constraints import Demand, TokenConstraint
from zen5.chat_types import ToolSpec
from zen5.dialects.deepseek_v4 import DeepSeekV4Dialect
from zen5.tokenizer import Tokenizer
tok = Tokenizer.from_files({str(tiny_deepseek_dir / "tokenizer.json")!r})
tool = ToolSpec("f", "", {{"type": "object", "properties": {{"a": {{"type": "string"}}}}}})
g = DeepSeekV4Dialect().grammar(Demand("forced", (tool,), True, None), tok.token_to_id, thinking_mode="thinking")
junk = []
for i in range(300):
    TokenConstraint(tok, g)
    junk.append(bytearray(20000))
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# ---- SmolLM2 (ChatML), temperature 1 ---------------------------------------------------------
@pytest.mark.model
@pytest.mark.slow
def test_forced_calls_always_validate(smol):
    """100 sampled requests, forced by "required" (all tools offered) or by name."""
    rng = random.Random(8)
    for i in range(100):
        choice = "required" if i % 2 else {"name": TOOLS[i % len(TOOLS)].name}
        ev, fin = chat(smol, rng.choice(PROMPTS), tools=TOOLS, tool_choice=choice,
                       parallel_tool_calls=False, max_tokens=JSON_MAX)
        calls = calls_of(ev)
        assert fin.reason == "tool_calls" and len(calls) == 1, (i, fin, text_of(ev))
        if isinstance(choice, dict):
            assert calls[0].name == choice["name"]
        validates(json.loads(calls[0].arguments), BY_NAME[calls[0].name].parameters)


@pytest.mark.model
@pytest.mark.slow
def test_json_schema_answers_always_validate(smol):
    rng = random.Random(9)
    for i in range(100):
        schema = ANSWERS[i % len(ANSWERS)]
        fmt = {"type": "json_schema", "schema": schema, "strict": True}
        ev, fin = chat(smol, rng.choice(PROMPTS), response_format=fmt, max_tokens=JSON_MAX)
        assert fin.reason == "stop", (i, text_of(ev))
        validates(json.loads(text_of(ev)), schema)


@pytest.mark.model
def test_json_object_and_loose_schema_answers_are_json(smol):
    finished = 0
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "schema": ANSWERS[0]}):
        for prompt in PROMPTS[:3]:
            ev, fin = chat(smol, prompt, response_format=fmt, max_tokens=160)
            if fin.reason == "stop":  # an open object may be long: only a finished one must parse
                assert isinstance(json.loads(text_of(ev)), dict)
                finished += 1
    assert finished


@pytest.mark.model
def test_none_never_calls(smol):
    weather = "Call get_weather for Paris now, using <tool_call> exactly as instructed."
    for i in range(10):
        ev, fin = chat(smol, weather, tools=TOOLS, tool_choice="none", max_tokens=48)
        assert not calls_of(ev) and "<tool_call>" not in text_of(ev)
        assert fin.reason in ("stop", "length")


@pytest.mark.model
def test_parallel_calls_validate_and_parallel_false_gives_one(smol):
    for parallel in (True, False):
        ev, fin = chat(smol, "Weather in Lisbon, Oslo and Cairo?", tools=TOOLS[:1],
                       tool_choice="required", parallel_tool_calls=parallel, max_tokens=JSON_MAX)
        calls = calls_of(ev)
        assert calls and (parallel or (len(calls) == 1 and fin.reason == "tool_calls"))
        for c in calls:
            validates(json.loads(c.arguments), TOOLS[0].parameters)


@pytest.mark.model
@pytest.mark.slow
def test_custom_tool_input_matches_its_grammar(smol):
    checker = Lark(PATCH_GRAMMAR, parser="earley")
    for i in range(20):
        ev, fin = chat(smol, "Create hello.py that prints hello.", tools=(TOOLS[0], PATCH),
                       tool_choice={"name": "apply_patch"}, parallel_tool_calls=False, max_tokens=PATCH_MAX)
        calls = calls_of(ev)
        assert fin.reason == "tool_calls" and len(calls) == 1, (i, fin)
        assert calls[0].kind == "custom" and calls[0].input is not None
        checker.parse(calls[0].input)


@pytest.mark.model
def test_auto_with_custom_tool_constrains_any_call(smol):
    """Codex's case: tool_choice auto, a custom tool. Text is free; a call, if any, is valid."""
    checker = Lark(PATCH_GRAMMAR, parser="earley")
    for prompt in ("Create hello.py that prints hello.", "Say hi."):
        ev, fin = chat(smol, prompt, tools=(PATCH,), max_tokens=120)
        for c in calls_of(ev):
            if fin.reason == "tool_calls":
                checker.parse(c.input)


@pytest.mark.model
def test_constraint_errors_are_400(smol):
    msgs = (Message.text("user", "hi"),)
    bad = [dict(tools=TOOLS, tool_choice={"name": "nope"}), dict(tool_choice="required"),
           dict(tools=(ToolSpec("p", kind="custom", grammar="start: ("),), tool_choice="required"),
           dict(tools=(ToolSpec("p", kind="custom", grammar='start: "a" ""'),), tool_choice="required"),
           dict(response_format={"type": "yaml"})]
    for kw in bad:
        with pytest.raises(ChatError) as e:
            smol.chat(ChatRequest(msgs, **kw))
        assert e.value.status == 400


# ---- the tiny DeepSeek-vocabulary model (DSML), random weights ------------------------------
def generated(session: ChatSession, thinking: bool) -> str:
    """The sampled text of the last request (after the prompt's <think> / </think>), with EOS."""
    text = session._live.text
    tail = text[text.rindex("<｜Assistant｜>") + len("<｜Assistant｜>"):]
    return tail[len("<think>" if thinking else "</think>"):] + EOS


@pytest.mark.parametrize("thinking", [False, True])
def test_forced_dsml_calls_parse_strictly(ds, thinking):
    for i in range(12):
        choice = "required" if i % 2 else {"name": TOOLS[i % len(TOOLS)].name}
        ev, fin = chat(ds, "Do something useful.", tools=TOOLS, tool_choice=choice, thinking=thinking,
                       thinking_budget=8 if thinking else None, parallel_tool_calls=i % 3 != 0,
                       max_tokens=400)
        assert fin.reason == "tool_calls", (i, fin)
        msg = parse_message_from_completion_text(generated(ds, thinking), "thinking" if thinking else "chat")
        parsed = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        assert parsed == [(c.name, c.arguments) for c in calls_of(ev)]
        assert msg["content"] == "" and (msg["reasoning_content"] != "") == thinking
        for name, args in parsed:
            validates(json.loads(args), BY_NAME[name].parameters)


@pytest.mark.parametrize("thinking", [False, True])
def test_dsml_none_custom_and_json(ds, thinking):
    mode = "thinking" if thinking else "chat"
    budget = 8 if thinking else None
    ev, fin = chat(ds, "Hi", tools=TOOLS, tool_choice="none", thinking=thinking, thinking_budget=budget,
                   max_tokens=40)
    assert not calls_of(ev) and "｜DSML｜" not in ds._live.text.rsplit("<｜Assistant｜>", 1)[1]
    ev, fin = chat(ds, "Patch", tools=(PATCH,), tool_choice="required", thinking=thinking,
                   thinking_budget=budget, parallel_tool_calls=False, max_tokens=400)
    assert fin.reason == "tool_calls"
    parse_message_from_completion_text(generated(ds, thinking), mode)
    Lark(PATCH_GRAMMAR, parser="earley").parse(calls_of(ev)[0].input)
    fmt = {"type": "json_schema", "schema": ANSWERS[3], "strict": True}
    ev, fin = chat(ds, "JSON", response_format=fmt, thinking=thinking, thinking_budget=budget, max_tokens=400)
    assert fin.reason == "stop"
    msg = parse_message_from_completion_text(generated(ds, thinking), mode)
    validates(json.loads(msg["content"]), ANSWERS[3])


def test_thinking_budget_caps_the_reasoning(ds):
    for budget in (0, 3, 8):
        ev, fin = chat(ds, "Think briefly", thinking=True, thinking_budget=budget, max_tokens=40)
        assert len([e for e in ev if isinstance(e, ThinkingDone)]) == 1
        tok, cache = ds.engine.tokenizer, list(ds.engine.tokens)
        start = len(cache) - 1 - cache[::-1].index(tok.token_to_id("<think>"))
        assert cache.index(tok.token_to_id("</think>"), start) - start - 1 <= budget  # sampled tokens
