"""Frontier mode (the ds4-bench idea): how prefill and decode speed hold up as the context fills.

Walk the fixed text into one context, frontier by frontier (step, 2 x step, ... up to the
model's context). At each frontier F, with the cache holding the previous frontier P:
  prefill  evaluate tokens [P, F) and time only that interval (prefill_tokens = F - P), so the
           figure is the speed of adding text at depth P, not an average from zero;
  decode   gen_tokens greedy tokens (EOS suppressed) on top of F, timed, then rewind to F, so the
           walk continues from exactly the text.
Each interval and each decode is repeated `repeat` times (rewinding between) and the median kept.
kv_bytes is the K/V state the context holds at F: F x the snapshot's bytes per position (measured
from two snapshots, so it follows the engine's KV dtype without knowing it).

CSV columns, exactly: ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kv_bytes.
The context is allocated at the last frontier + gen_tokens so the last decode fits.
"""
from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path

from workload import WARMUP, decode, time_test

COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kv_bytes")


def kv_bytes_per_position(ctx, tokens: list[int]) -> int:
    ctx.rewind(0)
    ctx.eval(tokens[:1])
    one = len(ctx.snapshot())
    ctx.eval(tokens[1:2])
    two = len(ctx.snapshot())
    ctx.rewind(0)
    return two - one


def walk(engine, tokens: list[int], frontiers: list[int], gen_tokens: int, repeat: int,
         log=print) -> list[dict]:
    ctx = engine.ctx
    eos = sorted(engine.tokenizer.eos_ids)
    per_pos = kv_bytes_per_position(ctx, tokens)
    for test in WARMUP:
        time_test(ctx, tokens, test, eos)
    rows, prev = [], 0
    ctx.rewind(0)
    for f in frontiers:
        pre, gen = [], []
        for _ in range(repeat):
            ctx.rewind(prev)
            t0 = time.perf_counter()
            ctx.eval(tokens[prev:f])
            pre.append(time.perf_counter() - t0)
        for _ in range(repeat):
            ctx.rewind(f - 1)  # re-evaluate the frontier's last token: a rewind drops the logits
            ctx.eval(tokens[f - 1:f])
            t0 = time.perf_counter()
            decode(ctx, gen_tokens, eos)
            gen.append(time.perf_counter() - t0)
        ctx.rewind(f)
        row = dict(ctx_tokens=f, prefill_tokens=f - prev,
                   prefill_tps=round((f - prev) / statistics.median(pre), 1), gen_tokens=gen_tokens,
                   gen_tps=round(gen_tokens / statistics.median(gen), 1), kv_bytes=f * per_pos)
        log(f"frontier {f:5d}: prefill {row['prefill_tps']:8.1f} tok/s   decode {row['gen_tps']:7.1f} tok/s")
        rows.append(row)
        prev = f
    ctx.rewind(0)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["ctx_tokens"] for r in rows]
    fig, (top, bot) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(x, [r["prefill_tps"] for r in rows], "o-", color="tab:blue")
    top.set_ylabel("prefill tok/s\n(interval to frontier)")
    top.set_ylim(bottom=0)
    bot.plot(x, [r["gen_tps"] for r in rows], "o-", color="tab:orange")
    bot.set_ylabel(f"decode tok/s\n({rows[0]['gen_tokens']} tokens at frontier)")
    bot.set_xlabel("context tokens (frontier)")
    bot.set_ylim(bottom=0)
    for ax in (top, bot):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
