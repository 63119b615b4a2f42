"""`python -m zen5 serve` on the default model, driven by the real `anthropic` and `openai` SDKs:
non-streaming and streaming (deltas reassembled), count_tokens, completions, Responses
streaming; errors that need the model (over-long prompts, unknown tool IDs, bad signatures);
overload, disconnect and clean shutdown of a real process."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time

import anthropic
import openai
import pytest
import requests
from serverlib import sse_events, start_server

pytestmark = pytest.mark.model

QUESTION = "What is the capital of France?"


def anthropic_client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)


def openai_client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)


def test_anthropic_sdk_messages(smollm2_server):
    client = anthropic_client(smollm2_server)
    msg = client.messages.create(model="zen5-local", max_tokens=40, messages=[{"role": "user", "content": QUESTION}])
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.content[0].text.strip()
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 20

    with client.messages.stream(model="zen5-local", max_tokens=40,
                                messages=[{"role": "user", "content": QUESTION}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == final.content[0].text
    # the same prompt again: all but the last prompt token comes from the cache
    assert final.usage.cache_read_input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens - 1

    count = client.messages.count_tokens(model="zen5-local", messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_anthropic_message_start_reports_the_input_counts(smollm2_server):
    """message_start is sent before the prefill, yet carries the prompt's counts (the plan's):
    tokens to prefill as input_tokens, tokens kept from the cache as cache_read_input_tokens,
    the same as the end of the stream reports; a repeated prompt reads all but one from cache."""
    client = anthropic_client(smollm2_server)
    prompt = [{"role": "user", "content": "Name three rivers in Europe."}]
    total = client.messages.count_tokens(model="zen5-local", messages=prompt).input_tokens
    seen = []
    for _ in range(2):
        with client.messages.stream(model="zen5-local", max_tokens=3, messages=prompt) as s:
            events = list(s)
        start = events[0]
        assert start.type == "message_start"
        end = [e for e in events if e.type == "message_delta"][-1].usage
        planned = start.message.usage
        assert ((planned.input_tokens, planned.cache_read_input_tokens)
                == (end.input_tokens, end.cache_read_input_tokens))
        assert planned.input_tokens + planned.cache_read_input_tokens == total and planned.output_tokens == 0
        seen.append(planned.cache_read_input_tokens)
    assert seen[1] == total - 1


def test_count_tokens_of_a_split_assistant_turn_is_the_prompt_generation_reads(smollm2_server):
    """Issue 19, defect 8: a client that sends one assistant turn as several messages (text, then
    the tool_use) gets the count of the prompt the server really renders, which is the bundled
    turn's: count_tokens once rendered each message as a turn of its own (402 against 397)."""
    client = anthropic_client(smollm2_server)
    tools = [{"name": "get_weather", "description": "Get the weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    text = {"type": "text", "text": "Let me look that up."}
    call = {"type": "tool_use", "id": "toolu_split0", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_split0", "content": "Sunny"}]}
    # a system prompt of its own: no earlier request's cache or checkpoint shares this prompt's text
    head = dict(model="zen5-local", tools=tools, system="You count tokens (split-turn test).")
    question = {"role": "user", "content": "Weather in Paris?"}
    split = [question, {"role": "assistant", "content": [text]}, {"role": "assistant", "content": [call]}, result]
    bundled = [question, {"role": "assistant", "content": [text, call]}, result]

    counted = client.messages.count_tokens(messages=split, **head).input_tokens
    assert counted == client.messages.count_tokens(messages=bundled, **head).input_tokens
    msg = client.messages.create(max_tokens=1, messages=split, **head)
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_anthropic_stop_sequences_report_which_one_stopped(smollm2_server):
    """A reply ended by one of the request's stop_sequences says so: stop_reason
    "stop_sequence" and the string, in the body and in the stream's message_delta; the text ends
    before it."""
    client = anthropic_client(smollm2_server)
    stops = ["e", "a", "o"]  # an English answer meets one within a few characters
    msg = client.messages.create(model="zen5-local", max_tokens=40, stop_sequences=stops,
                                 messages=[{"role": "user", "content": QUESTION}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence in stops
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert not any(s in text for s in stops)
    with client.messages.stream(model="zen5-local", max_tokens=40, stop_sequences=stops,
                                messages=[{"role": "user", "content": QUESTION}]) as s:
        events = list(s)
    delta = [e for e in events if e.type == "message_delta"][-1].delta
    assert delta.stop_reason == "stop_sequence" and delta.stop_sequence in stops
    # without stop sequences the field stays null
    plain = client.messages.create(model="zen5-local", max_tokens=5, messages=[{"role": "user", "content": QUESTION}])
    assert plain.stop_sequence is None and plain.stop_reason in ("end_turn", "max_tokens")


def test_openai_chat_logprobs(smollm2_server):
    """`logprobs` / `top_logprobs` on chat: one entry per sampled token (the end-of-sequence one
    aside) whose tokens spell the content; greedy picks the top alternative; the stream carries
    the same entries on its chunks; asking for alternatives without logprobs is a 400."""
    client = openai_client(smollm2_server)
    kw = dict(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0)
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and 0 >= tops[0] >= e.logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob   # greedy
        assert bytes(e.bytes) == e.token.encode() and sum(math.exp(t) for t in tops) <= 1 + 1e-6
    # a token may be part of a UTF-8 character: its bytes are exact, and together they spell the text
    r = client.chat.completions.create(
        **{**kw, "messages": [{"role": "user", "content": "Say 🚀 and 東京 three times."}], "max_tokens": 24},
        logprobs=True)
    raw = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content)
    assert raw.decode(errors="replace") == r.choices[0].message.content
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None
    for bad in (dict(top_logprobs=2), dict(logprobs=True, top_logprobs=21)):
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(**bad, **kw)


def test_openai_responses_logprobs(smollm2_server):
    """Responses `include: ["message.output_text.logprobs"]` with `top_logprobs`: the message's
    output_text carries one entry per sampled token (the end-of-sequence one aside) that spells
    its text, the same tokens and values as Chat for the same prompt; the stream's deltas carry
    the same entries, and so do the done events; without the include the list stays empty."""
    client = openai_client(smollm2_server)
    kw = dict(model="m", input=QUESTION, max_output_tokens=12, temperature=0)
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, **kw)
    part = next(o for o in r.output if o.type == "message").content[0]
    assert len(part.logprobs) == r.usage.output_tokens - (r.status == "completed")
    assert "".join(e.token for e in part.logprobs) == part.text == r.output_text
    for e in part.logprobs:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token   # greedy
        assert bytes(e.bytes) == e.token.encode()
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    assert [e.token for e in chat.choices[0].logprobs.content] == [e.token for e in part.logprobs]
    assert [e.logprob for e in chat.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in part.logprobs], abs=1e-5)
    events = list(client.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, stream=True, **kw))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    final = next(o for o in events[-1].response.output if o.type == "message").content[0]
    for got in (deltas, done.logprobs, final.logprobs):
        assert [e.token for e in got] == [e.token for e in part.logprobs]
    assert client.responses.create(**kw).output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.responses.create(top_logprobs=21, **kw)


def test_openai_sdk_chat_completions_responses(smollm2_server):
    client = openai_client(smollm2_server)
    text, usage = "", None
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=40, stream=True, stream_options={"include_usage": True}):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text.strip() and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens >= 0

    done = client.completions.create(model="m", prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    assert done.choices[0].text and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12
    streamed = [c.choices[0] for c in client.completions.create(
        model="m", prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) and streamed[-1].finish_reason == "length"

    with client.responses.stream(model="m", input=QUESTION, instructions="Answer briefly.",
                                 max_output_tokens=40) as s:
        events = list(s)
    # a sampled answer may run past 40 tokens: then the stream ends with response.incomplete
    # (the SDK's get_final_response() accepts only response.completed, so read the last event)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    final = last.response
    assert final.status == last.type.split(".")[1] and "".join(deltas) == final.output_text
    if final.status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 40
    assert final.usage.input_tokens > 0


def test_prompt_over_the_context_is_a_400_in_each_shape(smollm2_server):
    long = "word " * 3000                                   # > 2048 tokens
    r = requests.post(smollm2_server.url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
                       ("/v1/responses", {"input": long}), ("/v1/completions", {"prompt": long})):
        r = requests.post(smollm2_server.url + path, json={"model": "m", **body}, timeout=60)
        assert r.status_code == 400 and "context" in r.json()["error"]["message"], (path, r.text)
    assert requests.get(smollm2_server.url + "/health", timeout=5).ok


def test_a_huge_prompt_is_refused_before_tokenizing_and_the_server_stays_live(smollm2_server):
    """10 MB of text cannot fit 2,048 tokens of context (the longest token is 81 bytes): each API
    refuses it by that bound, before any tokenizing (which took 13 s with the GIL held, /health
    waiting all along), and /health answers meanwhile."""
    huge = "hello world, this is a test " * 360_000          # 10 MB
    bodies = [("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": huge}]}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
              ("/v1/responses", {"input": huge}), ("/v1/completions", {"prompt": huge}),
              ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": huge}]})]
    health = []

    def poll():
        while len(health) < 1000 and not stop.is_set():
            t0 = time.monotonic()
            requests.get(smollm2_server.url + "/health", timeout=30)
            health.append(time.monotonic() - t0)
            time.sleep(0.05)

    stop = threading.Event()
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for path, body in bodies:
            r = requests.post(smollm2_server.url + path, json={"model": "m", **body}, timeout=120)
            assert r.status_code == 400, (path, r.text)
            msg = r.json()["error"]["message"]
            assert "more than the context of 2048 tokens can hold" in msg and "81 bytes per token" in msg, msg
    finally:
        stop.set()
        poller.join()
    assert health and max(health) < 2.0, health


def test_tokenizing_lets_other_threads_run(smollm2):
    """The tokenizer releases the GIL while it works, so the server's event loop answers other
    clients while the worker tokenizes a long prompt (a prompt within the bound can still take
    seconds)."""
    text = "hello world, this is a test " * 40_000
    done, ticks = threading.Event(), []
    worker = threading.Thread(target=lambda: (smollm2.tokenizer.encode(text), done.set()))
    t0 = time.monotonic()
    worker.start()
    while not done.is_set():
        time.sleep(0.005)
        ticks.append(time.monotonic())
    took = time.monotonic() - t0
    worker.join()
    # held GIL: one tick for the whole encode; released: ticks all along
    assert len(ticks) >= min(20, took / 0.02), (len(ticks), took)


def test_unknown_tool_id_and_bad_signature(smollm2_server):
    r = requests.post(smollm2_server.url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_forged", "content": "x"}]}]})
    assert r.status_code == 400 and "toolu_forged" in r.json()["error"]["message"]
    r = requests.post(smollm2_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"},
                                   {"role": "tool", "tool_call_id": "call_forged", "content": "x"}]})
    assert r.status_code == 400 and "replay the full history" in r.json()["error"]["message"]
    # a forged thinking signature degrades that message (diagnostic in the trace), not the request
    r = requests.post(smollm2_server.url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "forged"},
                                              {"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "bye"}]})
    assert r.status_code == 200, r.text
    assert any("signature" in d for d in smollm2_server.trace()[-1]["diagnostics"])


def test_trace_records_prompt_cache_and_output(smollm2_server):
    openai_client(smollm2_server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8)
    rec = smollm2_server.trace()[-1]
    assert rec["api"] == "openai_chat" and rec["prompt"].endswith("<|im_start|>assistant\n")
    assert rec["cache"]["source"] in ("cold", "token_prefix", "text_prefix", "live", "disk")
    assert rec["output"]["text"]


@pytest.fixture()
def small_queue_server(tmp_path):
    srv = start_server("smollm2", tmp_path, "--queue", "1", "--threads", "2", "--ctx", "1024")
    yield srv
    srv.stop()


COUNT = {"model": "m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 900, "stream": True}


def test_overload_disconnect_and_clean_shutdown(small_queue_server, smollm2):
    srv = small_queue_server
    running = requests.post(srv.url + "/v1/completions", json=COUNT, stream=True, timeout=60)
    lines = running.iter_lines()
    next(lines)                                              # it runs: counting goes on for ~900 tokens
    t = threading.Thread(target=lambda: requests.post(srv.url + "/v1/completions",
                                                json={**COUNT, "stream": False, "max_tokens": 2}, timeout=120))
    t.start()
    deadline = time.time() + 10
    while requests.get(srv.url + "/health", timeout=5).json()["queue_depth"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    a = requests.post(srv.url + "/v1/messages", timeout=30,
                      json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    o = requests.post(srv.url + "/v1/chat/completions", timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert a.status_code == 529 and a.json()["error"]["type"] == "overloaded_error"
    assert o.status_code == 429 and o.json()["error"]["type"] == "rate_limit_error"
    # the client of the long generation leaves: it stops, the queued request runs at once
    running.close()
    t.join(60)
    m = srv.metrics()
    assert m["zen5_requests_cancelled_total"] == 1 and m["zen5_requests_rejected_total"] == 2
    # a cancelled job's tokens are not in the metrics; the trace keeps the text it had made
    (gone,) = [r for r in srv.trace() if r["cancelled"]]
    assert len(smollm2.tokenizer.encode(gone["output"]["text"])) < 400, "the cancelled generation ran on"
    t0 = time.time()
    assert requests.post(srv.url + "/v1/completions", json={**COUNT, "stream": False, "max_tokens": 4},
                         timeout=60).ok
    assert time.time() - t0 < 10
    assert srv.stop() == 0
    log = srv.log()
    assert "shutting down" in log and "Finished server process" in log


def test_long_prefill_keeps_the_stream_alive_and_logs_progress(smollm2_server):
    """~1,900 prompt tokens take several seconds on two cores even on the int8 path: the
    Anthropic stream sends `ping` events after message_start while the prefill runs, and the
    server log shows its progress (every 2 s, and a summary line when the prefill ends)."""
    long = "Summarize: " + " ".join(("alpha", "beta", "gamma", "delta", "omega")[i % 5] for i in range(1850))
    r = requests.post(smollm2_server.url + "/v1/messages", stream=True, timeout=120, json={
        "model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": long}]})
    names = [n for n, _ in sse_events(r)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    first_block = next(i for i, n in enumerate(names) if n in ("content_block_start", "message_delta"))
    assert "ping" in names[1:first_block], names
    assert re.search(r"prefill \d+ tokens done in [\d.]+ s \(\d+ tok/s\)", smollm2_server.log())


def test_clean_shutdown_saves_and_a_restart_resumes_from_disk(tmp_path):
    """SIGTERM saves the live state (session.close(): disk checkpoints); a new process on the same
    --state-dir serves the same prompt from disk instead of prefilling it."""
    facts = " ".join(f"Fact {i}: the sky is blue." for i in range(70))          # ~700 tokens
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": facts + " Which fact is first?"}]}
    usages = []
    for _ in range(2):
        srv = start_server("smollm2", tmp_path, "--threads", "2", "--ctx", "2048")
        r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        usages.append((r.json()["usage"], srv.trace()[-1]["cache"]["source"]))
        assert srv.stop() == 0
    (first, src1), (second, src2) = usages
    assert src1 == "cold" and src2 == "disk", usages
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 64


def test_sigterm_during_a_stream_ends_it_cleanly_and_saves_what_was_computed(tmp_path):
    """SIGTERM while a reply streams: after the grace period (--shutdown-timeout, less a margin)
    the stream is cut with an error event in its protocol's shape (it once just stopped, with a
    CancelledError traceback in the log), the prompt and the tokens generated so far are saved
    (the log once said "saved" when nothing was), and a restart serves that prompt from disk."""
    facts = " ".join(f"Fact {i}: the sky is blue." for i in range(70))          # ~700 tokens
    body = {"model": "m", "max_tokens": 1500, "messages": [
        {"role": "user", "content": facts + " Now write a very long story about the sky, in many chapters."}]}
    srv = start_server("smollm2", tmp_path, "--threads", "2", "--ctx", "2048", "--shutdown-timeout", "1")
    r = requests.post(srv.url + "/v1/messages", json={**body, "stream": True}, stream=True, timeout=120)
    events, lines = [], r.iter_lines(decode_unicode=True)
    for line in lines:
        if line.startswith("event: content_block_delta"):
            break
    srv.proc.send_signal(signal.SIGTERM)
    name = None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line[5:])))
    assert srv.proc.wait(60) == 0
    srv.stop()
    assert events and events[-1][0] == "error", events[-3:]
    error = events[-1][1]["error"]
    assert error["type"] == "api_error" and "shutting down" in error["message"]
    log = srv.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
    saved = re.search(r"session: saved (\d+) tokens as checkpoint", log)
    assert saved, log
    assert int(saved.group(1)) > 700, "the saved state holds the prompt and the reply so far"

    srv = start_server("smollm2", tmp_path, "--threads", "2", "--ctx", "2048")
    try:
        r = requests.post(srv.url + "/v1/messages", json={**body, "max_tokens": 4}, timeout=120)
        assert r.ok, r.text
        assert srv.trace()[-1]["cache"]["source"] == "disk"
        assert r.json()["usage"]["cache_read_input_tokens"] >= 640
    finally:
        srv.stop()


@pytest.mark.parametrize("how", ["read-only", "not a directory"])
def test_unusable_state_dir_serves_with_a_key_in_memory(tmp_path, tmpfs, how):
    """Issue 19, defect 6: a --state-dir that cannot hold the thinking key crashed at start with a
    traceback. Now the server starts, says in one warning line that it keeps the key in memory
    and runs without disk checkpoints, answers, and exits 0."""
    state, restore = tmp_path / "state", None          # start_server passes workdir/state
    if how == "not a directory":
        state.write_text("")
    elif os.geteuid() == 0:                            # root writes through chmod 0555
        tmpfs("size=1m,ro", "state")
    else:
        state.mkdir(mode=0o555)
        restore = state
    try:
        srv = start_server("smollm2", tmp_path, "--threads", "2", "--ctx", "1024")
        r = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert srv.stop() == 0
    finally:
        if restore is not None:
            restore.chmod(0o755)
    log = srv.log()
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert "Traceback" not in log and len(warnings) == 1, log
    assert "key held in memory" in warnings[0] and "without disk checkpoints" in warnings[0]


def test_q8_kv_cache_server_keeps_its_own_checkpoints(tmp_path):
    """`serve --kv-type q8_0` answers, saves its disk checkpoints in a directory of its own
    (<fingerprint>-int8-q8_0: a q8_0 snapshot cannot restore into an f16 cache), resumes from
    them after a restart, and a default (f16) server on the same --state-dir neither uses nor
    removes them."""
    facts = " ".join(f"Fact {i}: the sea is green." for i in range(70))  # ~700 tokens: worth a file
    body = {"model": "m", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": facts + " Which fact is first?"}]}
    runs = []
    for kv in ("q8_0", "q8_0", "f16"):
        srv = start_server("smollm2", tmp_path, "--threads", "2", "--ctx", "1024", "--kv-type", kv)
        r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        runs.append(srv.trace()[-1]["cache"]["source"])
        assert srv.stop() == 0
    assert runs == ["cold", "disk", "cold"], runs
    dirs = sorted(p.name for p in (tmp_path / "state" / "checkpoints").iterdir())
    assert len(dirs) == 2 and dirs[1] == dirs[0] + "-int8-q8_0", dirs
    assert list((tmp_path / "state" / "checkpoints" / dirs[1]).glob("*.z5kv"))


def test_prompt_lookup_through_the_server_changes_speed_not_the_reply(smollm2_server, smollm2_path, tmp_path):
    """The server decodes with prompt lookup on (the default): a greedy reply that copies from
    its prompt keeps guessed tokens (/metrics counts them) and is word for word the reply of an
    in-process session with lookup off."""
    from zen5.chat_types import ChatRequest, Message, TextDelta
    from zen5.engine import Engine
    from zen5.session import ChatSession

    listing = "\n".join(f"- item {i}: the quick brown fox jumps over the lazy dog" for i in range(1, 12)) + "\n- item"
    content = "Continue this list up to item 20:\n" + listing
    before = smollm2_server.metrics()
    r = openai_client(smollm2_server).chat.completions.create(
        model="zen5-local", max_tokens=120, temperature=0, messages=[{"role": "user", "content": content}])
    after = smollm2_server.metrics()
    kept = after["zen5_lookup_kept_tokens_total"] - before["zen5_lookup_kept_tokens_total"]
    guessed = after["zen5_lookup_guessed_tokens_total"] - before["zen5_lookup_guessed_tokens_total"]
    assert 20 <= kept <= guessed

    s = ChatSession(Engine.load(smollm2_path, n_ctx=2048, threads=2, lookup=0), "chatml", state_dir=tmp_path)
    events = list(s.chat(ChatRequest((Message.text("user", content),), max_tokens=120)))
    assert events[-1].usage.guessed_tokens == 0
    assert r.choices[0].message.content == "".join(e.text for e in events if isinstance(e, TextDelta))
