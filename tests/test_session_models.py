"""Unforced tool loops with the models that really decide to call tools (../shared/models):
the tool-tuned SmolLM2 (ChatML) and dsml-tiny (DeepSeek V4, thinking on). Every turn after the
first must be served by live continuation, and replayed thinking must verify."""
from __future__ import annotations

import pytest

from test_session import assistant_turn, calls_of
from zen5.chat_types import ChatRequest, Message, ToolResultBlock, ToolSpec
from zen5.engine import Engine
from zen5.registry import ModelNotFound, resolve_model
from zen5.session import ChatSession

pytestmark = pytest.mark.model

TOOLS = (
    ToolSpec("get_weather", "Get the current weather for a city",
             {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
              "required": ["city"]}),
    ToolSpec("Bash", "Run a shell command",
             {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
)


def session_for(name, tmp_path):
    try:
        path = resolve_model(name)
    except ModelNotFound as e:
        pytest.skip(str(e))
    return ChatSession(Engine.load(path, n_ctx=4096), state_dir=tmp_path)


@pytest.mark.parametrize("name,questions", [
    ("smollm2-tools", ["What's the weather in Paris right now?", "Run ls in the current directory.",
                       "What is the weather like in Tokyo?"]),
    ("dsml-tiny", ["What is the weather in Lisbon?", "List the files in /tmp.", "Weather in Madrid?"])])
def test_unforced_tool_loops_are_served_live(name, questions, tmp_path):
    """One conversation per question, each looping through the tool calls the model decides to
    make until it answers; then a follow-up question. Every turn that answers tool results must
    be live; the follow-up must reuse the whole cache (the history it holds, thinking and calls
    included, re-renders byte-identically)."""
    s = session_for(name, tmp_path)
    log, n_calls = [], 0
    for q in questions:
        msgs = [Message.text("system", "You are a helpful assistant."), Message.text("user", q)]
        for _ in range(3):
            events = list(s.chat(ChatRequest(tuple(msgs), tools=TOOLS, max_tokens=160)))
            fin = events[-1]
            after_results = isinstance(msgs[-1].blocks[0], ToolResultBlock)
            log.append((q[:12], fin.reason, fin.usage.cache_source))
            assert not [d for d in fin.diagnostics if "signature" in d or "canonically" in d], fin.diagnostics
            assert fin.usage.cache_source == "live" if after_results else True, log
            msgs.append(assistant_turn(events))
            if fin.reason != "tool_calls":
                break
            n_calls += len(calls_of(events))
            msgs.append(Message("user", tuple(ToolResultBlock(c.id, '{"temp_c": 21, "sky": "clear"}')
                                              for c in calls_of(events))))
    held = s.engine.n_tokens
    msgs.append(Message.text("user", "Thanks! Anything else?"))
    fin = list(s.chat(ChatRequest(tuple(msgs), tools=TOOLS, max_tokens=40)))[-1]
    print(f"{name}: {log}, {n_calls} tool calls; follow-up reused {fin.usage.reused_tokens}/{held}")
    assert fin.usage.reused_tokens == held
    assert n_calls >= 2, "the model called tools for fewer than two questions"
    assert sum(src == "live" for *_, src in log) >= 2
