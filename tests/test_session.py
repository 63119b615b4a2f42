"""The session layer on real weights: the cache ladder, exact replay, ID rules, degrade paths.

Scripted turns: `scripted(session, text)` makes the model "sample" exactly `text` then EOS by
replacing only the sampling decision (the engine still evaluates every token for real), so a
test can drive a tool loop with a model that would not call tools by itself. The unforced loops
with the tool-tuned models live in test_session_models.py.
"""
from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

from zen5 import session as session_mod
from zen5.chat_types import (
    ChatError,
    ChatRequest,
    Finish,
    Message,
    RedactedThinkingBlock,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDone,
    ToolCallDone,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from zen5.engine import Engine
from zen5.sampling import SamplingParams
from zen5.session import ChatSession

pytestmark = pytest.mark.model

WEATHER = ToolSpec("get_weather", "Get the weather for a city",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@contextlib.contextmanager
def scripted(session: ChatSession, text: str, record: list | None = None):
    """Force the next generation to produce `text` then EOS; optionally record the logits
    the model saw at the first sampling step."""
    tok = session.engine.tokenizer
    script = tok.encode(text) + [min(tok.eos_ids)]
    orig = session_mod._Generation._sample

    def fake(self, logits):
        if record is not None and not record:
            record.append(np.array(logits))
        return script[min(self.n_sampled, len(script) - 1)]

    session_mod._Generation._sample = fake
    try:
        yield
    finally:
        session_mod._Generation._sample = orig


def run(session, messages, **kw) -> tuple[list, Finish]:
    kw.setdefault("tools", (WEATHER,))
    kw.setdefault("max_tokens", 200)
    events = list(session.chat(ChatRequest(tuple(messages), **kw)))
    return events, events[-1]


def calls_of(events):
    return [e for e in events if isinstance(e, ToolCallDone)]


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def assistant_turn(events, respell=False) -> Message:
    """The assistant message a client would replay: thinking (signed), text, tool calls."""
    blocks = [ThinkingBlock(e.text, e.signature) for e in events if isinstance(e, ThinkingDone)]
    if text_of(events):
        blocks.append(TextBlock(text_of(events)))
    for c in calls_of(events):
        args = json.dumps(json.loads(c.arguments), sort_keys=True, separators=(",", ":")) if respell else c.arguments
        blocks.append(ToolUseBlock(c.id, c.name, args))
    return Message("assistant", tuple(blocks))


def cold_tokens(s: ChatSession, msgs, **kw) -> list[int]:
    """The request rendered and tokenized from scratch, as a cold prefill would see it."""
    req = ChatRequest(tuple(msgs), tools=(WEATHER,), **kw)
    mode = s._thinking_mode(req)
    return s.engine.tokenizer.encode_segments(s._render_segments(req, s._dialect_messages(req, mode)[0], mode))


def chatml_calls(*cities):
    return "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                     for c in cities)


def dsml_calls(*cities):
    invokes = "\n".join(f'<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">{c}'
                        f'</｜DSML｜parameter>\n</｜DSML｜invoke>' for c in cities)
    return f"Checking.</think>\n\n<｜DSML｜tool_calls>\n{invokes}\n</｜DSML｜tool_calls>"


@pytest.fixture(scope="module")
def smol_session(smollm2_path, tmp_path_factory):
    return ChatSession(Engine.load(smollm2_path, n_ctx=4096), "chatml",
                       state_dir=tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def ds_session(tiny_deepseek_dir, tmp_path_factory):
    return ChatSession(Engine.load(str(tiny_deepseek_dir), n_ctx=4096),
                       state_dir=tmp_path_factory.mktemp("state"))


SESSIONS = {"chatml": ("smol_session", chatml_calls), "deepseek_v4": ("ds_session", dsml_calls)}


@pytest.mark.parametrize("dialect", list(SESSIONS))
def test_live_continuation_equals_cold_prefill(dialect, request):
    fixture, calls = SESSIONS[dialect]
    s = request.getfixturevalue(fixture)
    assert s.dialect.name == dialect
    msgs = [Message.text("user", "Weather in Paris and Rome?")]
    with scripted(s, calls("Paris", "Rome")):
        ev, fin = run(s, msgs)
    assert fin.reason == "tool_calls" and len(calls_of(ev)) == 2
    msgs += [assistant_turn(ev), Message("user", tuple(ToolResultBlock(c.id, f"{c.arguments} -> 20C")
                                                   for c in reversed(calls_of(ev))))]
    live_logits: list = []
    with scripted(s, "Both are 20C.", record=live_logits):
        ev2, fin2 = run(s, msgs)
    assert fin2.usage.cache_source == "live"
    # cold: a fresh context prefills the same history rendered from scratch
    cold = Engine(s.engine.weights, n_ctx=4096)
    cold.append(cold_tokens(s, msgs))
    assert cold.tokens == s.engine.tokens[: cold.n_tokens]
    diff = float(np.abs(cold.native_ctx.logits() - live_logits[0]).max())
    print(f"{dialect}: live vs cold max logit difference {diff:.3g}")
    assert diff < 1e-3


@pytest.mark.parametrize("dialect", list(SESSIONS))
def test_ten_turn_tool_session_prefills_only_the_suffix(dialect, request):
    fixture, calls = SESSIONS[dialect]
    s = request.getfixturevalue(fixture)
    s.engine.reset()
    msgs = [Message.text("system", "You are a weather bot."), Message.text("user", "Plan a trip.")]
    new_total = prefilled_total = 0
    for turn in range(10):
        cities = [f"City{turn}a", f"City{turn}b", f"City{turn}c"][: 1 + turn % 3]
        before = s.engine.n_tokens
        with scripted(s, calls(*cities)):
            ev, fin = run(s, msgs)
        full = cold_tokens(s, msgs)
        if turn:
            assert fin.usage.cache_source == "live", turn
            assert fin.usage.reused_tokens == before
            assert list(s.engine.tokens[: len(full)]) == full   # live state == cold rendering
        new_total += len(full) - (before if turn else 0)       # the new suffix, independently
        prefilled_total += fin.usage.prefilled_tokens
        assert fin.usage.prefilled_tokens == fin.usage.prompt_tokens - fin.usage.reused_tokens
        msgs.append(assistant_turn(ev))
        # results out of order
        msgs.append(Message("user", tuple(ToolResultBlock(c.id, f"sunny in {c.arguments}")
                                          for c in reversed(calls_of(ev)))))
    ratio = prefilled_total / new_total
    print(f"{dialect}: 10-turn re-prefill ratio {ratio:.2f} ({prefilled_total} prefilled / {new_total} new)")
    assert ratio == 1.0


def test_replay_with_respelled_json_renders_the_sampled_bytes(smol_session):
    s = smol_session
    # a call spelled the way a canonical renderer would not (arguments before name)
    sampled = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    msgs = [Message.text("user", "Weather in Oslo?")]
    with scripted(s, sampled):
        ev, _ = run(s, msgs)
    run(s, [Message.text("user", "unrelated question")], max_tokens=2)  # evicts the live state
    msgs += [assistant_turn(ev, respell=True), Message("user", (ToolResultBlock(calls_of(ev)[0].id, "cold"),))]
    req = ChatRequest(tuple(msgs), tools=(WEATHER,))
    rendered = "".join(x.text for x in s._render_segments(req, s._dialect_messages(req, "chat")[0], "chat"))
    assert sampled in rendered
    with scripted(s, "Cold."):
        _, fin = run(s, msgs)
    assert not [d for d in fin.diagnostics if "canonically" in d]


def test_evicted_tool_memory_falls_back_to_canonical(smol_session):
    s = smol_session
    msgs = [Message.text("user", "Weather in Lima?")]
    with scripted(s, chatml_calls("Lima")):
        ev, _ = run(s, msgs)
    s.memory._items.clear()  # as if evicted
    msgs += [assistant_turn(ev, respell=True), Message("user", (ToolResultBlock(calls_of(ev)[0].id, "warm"),))]
    with scripted(s, "Warm."):
        ev2, fin = run(s, msgs)
    assert any("canonically" in d for d in fin.diagnostics)
    assert text_of(ev2) == "Warm."


def test_unknown_tool_id_is_400_and_stale_live_state_is_409(smol_session):
    s = smol_session
    with pytest.raises(ChatError) as e:
        s.chat(ChatRequest((Message.text("user", "hi"), Message("user", (ToolResultBlock("call_" + "0" * 32, "x"),)))))
    assert e.value.status == 400 and "replay the full history" in e.value.message
    with scripted(s, chatml_calls("Kyiv")):
        ev, _ = run(s, [Message.text("user", "Weather in Kyiv?")])
    cid = calls_of(ev)[0].id
    # live: the result alone (no replayed call) is served by live continuation
    only_result = (Message("user", (ToolResultBlock(cid, "mild"),)),)
    assert s.live_tool_ids == (cid,)
    run(s, [Message.text("user", "something else")], max_tokens=2)  # the live state moves on
    with pytest.raises(ChatError) as e:
        s.chat(ChatRequest(only_result))
    assert e.value.status == 409
    # a request accepted on live state, then overtaken before it runs
    with scripted(s, chatml_calls("Kyiv")):
        ev, _ = run(s, [Message.text("user", "Weather in Kyiv?")])
    pending = s.chat(ChatRequest((Message("user", (ToolResultBlock(calls_of(ev)[0].id, "mild"),)),)))
    run(s, [Message.text("user", "cut in line")], max_tokens=2)
    with pytest.raises(ChatError) as e:
        next(pending)
    assert e.value.status == 409
    # and the session keeps serving
    _, fin = run(s, [Message.text("user", "still there?")], max_tokens=3)
    assert fin.usage.completion_tokens >= 1


def test_truncated_tool_call_is_not_executable_and_the_next_request_works(smol_session):
    s = smol_session
    msgs = [Message.text("user", "Weather in Quito?")]
    with scripted(s, chatml_calls("Quito")):
        ev, fin = run(s, msgs, max_tokens=8)  # cut inside the call
    assert fin.reason == "length" and not calls_of(ev)
    assert s.live_tool_ids == ()
    kept = text_of(ev)
    msgs += ([Message.text("assistant", kept)] if kept else []) + [Message.text("user", "Try again.")]
    with scripted(s, chatml_calls("Quito")):
        ev2, fin2 = run(s, msgs)
    assert fin2.reason == "tool_calls" and fin2.usage.reused_tokens > 0


def test_thinking_degrade_paths(ds_session):
    s = ds_session
    s.engine.reset()
    msgs = [Message.text("user", "Weather in Cairo?")]
    with scripted(s, dsml_calls("Cairo")):
        ev, fin = run(s, msgs)
    done = [e for e in ev if isinstance(e, ThinkingDone)][0]
    assert done.text == "Checking." and s.signer.verify(done.text, done.signature)
    result = Message("user", (ToolResultBlock(calls_of(ev)[0].id, "hot"),))
    good = assistant_turn(ev)
    variants = {
        "bad signature": Message("assistant", (ThinkingBlock(done.text, "z5s1.forged"),) + good.blocks[1:]),
        "altered thinking": Message("assistant", (ThinkingBlock("Changed.", done.signature),) + good.blocks[1:]),
        "dropped thinking": Message("assistant", good.blocks[1:]),
        "thinking as text": Message("assistant", (TextBlock(done.text),) + good.blocks[1:]),
        "foreign redacted": Message("assistant", (RedactedThinkingBlock("z5e1.AAAA"),) + good.blocks[1:]),
    }
    for name, turn in variants.items():
        run(s, [Message.text("user", "reset live")], max_tokens=2)
        with scripted(s, "It is hot."):
            ev2, fin2 = run(s, msgs + [turn, result])
        assert fin2.reason == "stop", name
        if "signature" in name or "altered" in name or "redacted" in name:
            assert fin2.diagnostics, name
        # the session keeps working after every degrade
        with scripted(s, "Sure."):
            _, fin3 = run(s, msgs + [turn, result, assistant_turn(ev2), Message.text("user", "thanks")])
        assert fin3.reason == "stop" and fin3.usage.cache_source != "cold", name
    # redaction mode round trip: the encrypted blob restores the exact text
    with scripted(s, dsml_calls("Cairo")):
        evr, _ = run(s, msgs, redact_thinking=True)
    assert not [e for e in evr if type(e).__name__ == "ThinkingDelta"]
    blob = [e for e in evr if isinstance(e, ThinkingDone)][0].encrypted
    replay = Message("assistant", (RedactedThinkingBlock(blob),) + assistant_turn(evr).blocks[1:])
    run(s, [Message.text("user", "reset live")], max_tokens=2)
    with scripted(s, "Hot."):
        _, finr = run(s, msgs + [replay, Message("user", (ToolResultBlock(calls_of(evr)[0].id, "hot"),))])
    assert not finr.diagnostics


def test_adjacent_assistant_messages_render_like_one_turn(ds_session):
    s = ds_session
    with scripted(s, dsml_calls("Lagos")):
        ev, _ = run(s, [Message.text("user", "Weather in Lagos?")])
    bundled = assistant_turn(ev)
    split = [Message("assistant", (b,)) for b in bundled.blocks]
    result = Message("user", (ToolResultBlock(calls_of(ev)[0].id, "humid"),))

    def req(turns):
        return ChatRequest(tuple([Message.text("user", "Weather in Lagos?")] + turns + [result]), tools=(WEATHER,))

    mode = s._thinking_mode(req([bundled]))
    a = s._render_segments(req([bundled]), s._dialect_messages(req([bundled]), mode)[0], mode)
    b = s._render_segments(req(split), s._dialect_messages(req(split), mode)[0], mode)
    assert "".join(x.text for x in a) == "".join(x.text for x in b)


@pytest.mark.parametrize("dialect", list(SESSIONS))
def test_count_prompt_tokens_is_the_rendered_prompt(dialect, request):
    """The count a server answers count_tokens with is the prompt generation renders: a turn
    split into several assistant messages counts as the bundled turn it renders as (issue 19,
    defect 8), and both equal the cold prefill's tokens. A count applies no tool-ID rule."""
    fixture, calls = SESSIONS[dialect]
    s = request.getfixturevalue(fixture)
    question = Message.text("user", "Weather in Lagos?")
    with scripted(s, ("Let me check.\n" if dialect == "chatml" else "") + calls("Lagos")):
        ev, _ = run(s, [question])
    bundled = assistant_turn(ev)   # text (and thinking), then the call
    split = [Message("assistant", (b,)) for b in bundled.blocks]
    assert len(split) > 1
    result = Message("user", (ToolResultBlock(calls_of(ev)[0].id, "humid"),))
    req = lambda turns: ChatRequest(tuple([question] + turns + [result]), tools=(WEATHER,))  # noqa: E731
    n = len(cold_tokens(s, [question, bundled, result]))
    assert s.count_prompt_tokens(req(split)) == s.count_prompt_tokens(req([bundled])) == n
    orphan = ChatRequest((question, Message("user", (ToolResultBlock("toolu_unknown", "x"),))))
    assert s.count_prompt_tokens(orphan) > 0


def test_prompt_over_context_is_400(smollm2_path, tmp_path):
    s = ChatSession(Engine.load(smollm2_path, n_ctx=64), "chatml", state_dir=tmp_path)
    with pytest.raises(ChatError) as e:
        s.chat(ChatRequest((Message.text("user", "word " * 200),)))
    assert e.value.status == 400 and "context" in e.value.message


def test_syntax_greedy_decodes_structure_greedily(smol_session):
    """Where the dialect tracker says "structure", the token is the argmax whatever the
    request's temperature; payload positions use the request's sampler."""
    s = smol_session
    msgs = [Message.text("user", "Weather in Bern?")]
    hot = dict(sampling=SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), max_tokens=12)
    greedy = text_of(run(s, msgs, sampling=SamplingParams(temperature=0.0), max_tokens=12)[0])

    class AlwaysStructure:
        def feed(self, text): return "structure"
        def next_kind(self): return "structure"

    orig = s.dialect.syntax_tracker
    s.dialect.syntax_tracker = lambda **kw: AlwaysStructure()
    try:
        assert text_of(run(s, msgs, **hot)[0]) == greedy
    finally:
        s.dialect.syntax_tracker = orig
    s.syntax_greedy = False
    try:
        assert text_of(run(s, msgs, **hot)[0]) != greedy
    finally:
        s.syntax_greedy = True
