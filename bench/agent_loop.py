"""Agent-loop benchmark: time to first token per turn, live continuation vs cold prefill.

Workload (fixed): SmolLM2-135M-Instruct Q4_1 (the default model), ChatML, one `Read` tool. Each
turn the assistant calls the tool and the tool result is a ~450-token file listing, so the
transcript grows from ~1k to ~7k tokens over the run. The model's decisions are scripted (the
default model never calls tools by itself) so both arms see the identical transcript; every
token is still evaluated by the real engine. The two arms run interleaved, turn by turn.

Output: rows appended to bench/results/agent_loop.csv, and a final JSON line.
Arm "live": one ChatSession carried through the loop; arm "cold": a second session on the same
weights whose cache is cleared before each request. Usage:
python bench/agent_loop.py [--model smollm2] [--threads 2] [--max-ctx 7200]
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from results_log import append_rows, commit
from zen5 import session as session_mod
from zen5.chat_types import ChatRequest, Message, ToolResultBlock, ToolSpec, ToolUseBlock
from zen5.engine import Engine
from zen5.session import ChatSession

READ = ToolSpec("Read", "Reads a file", {"type": "object", "properties": {"path": {"type": "string"}},
                                         "required": ["path"]})
LISTING = "\n".join(f"{i:4d}\tdef handler_{i}(request):  # returns the response for route /api/v1/item/{i}"
                    for i in range(30))


class Script:
    """Replaces only the sampling decision: emit `text`, then EOS; records time to first token."""

    def __init__(self, session: ChatSession):
        self.s, self.tokens, self.t_first = session, [], None
        self.orig = session_mod._Generation._sample
        script = self

        def sample(gen, logits):
            if script.t_first is None:
                script.t_first = time.perf_counter()
            return script.tokens[min(gen.n_sampled, len(script.tokens) - 1)]

        session_mod._Generation._sample = sample

    def set(self, text: str):
        tok = self.s.engine.tokenizer
        self.tokens, self.t_first = tok.encode(text) + [min(tok.eos_ids)], None


def turn(session, script, msgs, text):
    script.set(text)
    t0 = time.perf_counter()
    events = list(session.chat(ChatRequest(tuple(msgs), tools=(READ,), max_tokens=64)))
    return script.t_first - t0, events[-1], events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-ctx", type=int, default=7200)
    a = ap.parse_args()
    live_eng = Engine.load(a.model, threads=a.threads, n_ctx=8192)
    cold_eng = Engine(live_eng.weights, threads=a.threads, n_ctx=8192)  # same mapped weights
    state = Path("/tmp") / "zen5-bench-state"
    live, cold = ChatSession(live_eng, "chatml", state_dir=state), ChatSession(cold_eng, "chatml", state_dir=state)
    script = Script(live)
    msgs = [Message.text("system", "You are a coding agent."), Message.text("user", "Summarize the handlers in src/.")]
    rows, i = [], 0
    while True:
        call = f'<tool_call>\n{{"name": "Read", "arguments": {{"path": "src/part{i}.py"}}}}\n</tool_call>'
        cold_eng.reset()
        cold_ttft, cold_fin, _ = turn(cold, script, msgs, call)
        live_ttft, live_fin, events = turn(live, script, msgs, call)
        prompt_tokens = live_fin.usage.prompt_tokens
        rows.append(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
                         threads=a.threads, turn=i, ctx_tokens=prompt_tokens,
                         live_source=live_fin.usage.cache_source, live_prefilled=live_fin.usage.prefilled_tokens,
                         live_ttft_ms=round(live_ttft * 1e3, 1), cold_prefilled=cold_fin.usage.prefilled_tokens,
                         cold_ttft_ms=round(cold_ttft * 1e3, 1), speedup=round(cold_ttft / live_ttft, 1)))
        print(rows[-1], flush=True)
        if prompt_tokens + 600 > a.max_ctx:
            break
        done = [e for e in events if type(e).__name__ == "ToolCallDone"][0]
        msgs += [Message("assistant", (ToolUseBlock(done.id, done.name, done.arguments),)),
                 Message("user", (ToolResultBlock(done.id, LISTING),))]
        i += 1
    out = Path(__file__).parent / "results" / "agent_loop.csv"
    append_rows(out, rows)
    last = rows[-1]
    print(json.dumps({"turns": len(rows), "final_ctx": last["ctx_tokens"], "live_ttft_ms": last["live_ttft_ms"],
                      "cold_ttft_ms": last["cold_ttft_ms"], "speedup_at_final_ctx": last["speedup"],
                      "live_prefill_tokens_total": sum(r["live_prefilled"] for r in rows),
                      "cold_prefill_tokens_total": sum(r["cold_prefilled"] for r in rows)}))


if __name__ == "__main__":
    main()
