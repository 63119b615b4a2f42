"""Constrained decoding overhead: decode tokens/s with a grammar mask vs without.

Workload (fixed): SmolLM2-135M-Instruct Q4_1 (the default model), ChatML, through
`ChatSession.chat` so every per-token cost of the real path is included (mask wait, mask
application on the 49,152 logits, matcher advance). Three constrained kinds, each paired with the
same request (same prompt, same tools) unconstrained (tool_choice "auto", no response_format),
run interleaved:

  text   tool_choice "none" with a tool given: free text that may not open a <tool_call>
         (the mask allows almost every token: the largest masks to compute and apply)
  tool   tool_choice "required": <tool_call> JSON with arguments per a schema
  json   response_format json_schema (strict)

Decode rate = completion tokens / decode seconds over --requests requests per arm (sampled at
temperature 0.7, fixed seeds shared by the arms). On a busy machine the rates are noisy, so the
main-thread time spent in the constraint per token (waiting for and applying the mask, advancing
the matcher) is timed too: `mask_ms_per_token`, and `ratio_timed` = unconstrained time per token
/ (that + mask time per token), the overhead with the noise of the decode itself taken out. The
mask for the next token is computed in a background thread while the engine evaluates the current
one; --sync computes it inline.
Output: rows appended to bench/results/constrained.csv and a final JSON line with the ratios
(constrained / unconstrained; target >= 0.90). Usage:
python bench/constrained.py [--model smollm2] [--threads 2] [--requests 8] [--max-tokens 96] [--sync]
"""
from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from results_log import append_rows, commit
from zen5 import constraints
from zen5.chat_types import ChatRequest, Finish, Message, ToolSpec
from zen5.engine import Engine
from zen5.sampling import SamplingParams
from zen5.session import ChatSession

WEATHER = ToolSpec("get_weather", "Get the weather forecast for a city", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]})
PERSON = {"type": "json_schema", "strict": True, "schema": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 60}, "age": {"type": "integer"},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 60}},
                   "bio": {"type": "string"}},
    "required": ["name", "age", "hobbies", "bio"]}}
# kind: (prompt, request fields shared by both arms, the fields that constrain it)
KINDS = {
    "text": ("Write a long story about a lighthouse keeper and a storm.",
             dict(tools=(WEATHER,)), dict(tool_choice="none")),
    "tool": ("What will the weather be in Lisbon, Oslo and Cairo this week?",
             dict(tools=(WEATHER,)), dict(tool_choice="required")),
    "json": ("Invent a detailed fictional person with many hobbies and a long biography.",
             {}, dict(response_format=PERSON)),
}


class MaskTimer:
    """Times the main thread's constraint calls (TokenConstraint.mask and .advance)."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("mask", "advance"):
            setattr(constraints.TokenConstraint, name, self._timed(getattr(constraints.TokenConstraint, name)))

    def _timed(self, fn):
        def wrapper(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def decode(session: ChatSession, prompt: str, extra: dict, seed: int, max_tokens: int):
    """(completion tokens, decode seconds) of one request from a cleared cache."""
    session.engine.reset()
    req = ChatRequest((Message.text("user", prompt),), max_tokens=max_tokens,
                      sampling=SamplingParams(temperature=0.7, seed=seed), **extra)
    fin = [e for e in session.chat(req) if isinstance(e, Finish)][0]
    return fin.usage.completion_tokens, fin.usage.decode_seconds


def run_kind(session: ChatSession, timer: MaskTimer, kind: str, requests: int, max_tokens: int) -> dict:
    prompt, shared, constraint = KINDS[kind]
    timer.seconds = 0.0
    tokens = {"constrained": 0, "unconstrained": 0}
    seconds = {"constrained": 0.0, "unconstrained": 0.0}
    for seed in range(requests):  # interleaved: both arms see the same machine state
        for arm, kw in (("unconstrained", shared), ("constrained", {**shared, **constraint})):
            n, t = decode(session, prompt, kw, seed, max_tokens)
            tokens[arm] += n
            seconds[arm] += t
    tps = {arm: tokens[arm] / seconds[arm] for arm in tokens}
    mask_per_token = timer.seconds / tokens["constrained"]
    per_token = seconds["unconstrained"] / tokens["unconstrained"]
    return dict(kind=kind, requests=requests,
                tokens_unconstrained=tokens["unconstrained"], tokens_constrained=tokens["constrained"],
                tps_unconstrained=round(tps["unconstrained"], 1),
                tps_constrained=round(tps["constrained"], 1),
                ratio=round(tps["constrained"] / tps["unconstrained"], 3),
                mask_ms_per_token=round(mask_per_token * 1e3, 3),
                ratio_timed=round(per_token / (per_token + mask_per_token), 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--sync", action="store_true", help="compute each mask inline, not in the background")
    a = ap.parse_args()
    constraints.BACKGROUND_MASK = not a.sync
    eng = Engine.load(a.model, threads=a.threads, n_ctx=2048)
    session = ChatSession(eng, "chatml", state_dir=tempfile.mkdtemp(prefix="zen5-bench-"))
    prompt, shared, constraint = KINDS["tool"]
    decode(session, prompt, {**shared, **constraint}, 0, 8)  # warm-up: weights, llguidance tokenizer
    timer = MaskTimer()
    rows = []
    for kind in KINDS:
        row = run_kind(session, timer, kind, a.requests, a.max_tokens)
        rows.append(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
                         model=Path(eng.weights.metadata["path"]).name, threads=eng.threads,
                         mask="sync" if a.sync else "background", **row))
        print(rows[-1], flush=True)
    out = Path(__file__).parent / "results" / "constrained.csv"
    append_rows(out, rows)
    total_c = sum(r["tokens_constrained"] / r["tps_constrained"] for r in rows)
    total_u = sum(r["tokens_unconstrained"] / r["tps_unconstrained"] for r in rows)
    overall = (sum(r["tokens_constrained"] for r in rows) / total_c) / \
              (sum(r["tokens_unconstrained"] for r in rows) / total_u)
    print(json.dumps({"mask": rows[0]["mask"], **{r["kind"]: r["ratio"] for r in rows},
                      "overall_ratio": round(overall, 3),
                      **{f"{r['kind']}_timed": r["ratio_timed"] for r in rows},
                      "mask_ms_per_token": max(r["mask_ms_per_token"] for r in rows)}))


if __name__ == "__main__":
    main()
