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
Several engines (the KV cache types) walk together, interleaved frontier by frontier, so they
share each time window; each gets its own rows.

Prompt lookup (`lookup=` names): those engines also time the same greedy decode through
zen5.lookup.DraftFeed (guesses copied from the context, kept when they are the argmax), in
rows named "<engine>+lookup" whose prefill figures are the engine's own. The tokens are the same
as the plain decode's; how many guesses are kept depends on the text (the fixed text repeats
sentences, which the model copies), so these rows measure the mechanism on this text, not a
general decode speed-up.

CSV columns, exactly: ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kv_bytes.
The context is allocated at the last frontier + gen_tokens so the last decode fits.
"""
from __future__ import annotations

import csv
import math
import statistics
import time
from pathlib import Path

import numpy as np

from workload import WARMUP, time_test
from zen5.lookup import MAX_DRAFT, DraftFeed, LookupStats

COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kv_bytes")


def kv_bytes_per_position(native_ctx, tokens: list[int]) -> int:
    native_ctx.rewind(0)
    native_ctx.eval(tokens[:1])
    one = len(native_ctx.snapshot())
    native_ctx.eval(tokens[1:2])
    two = len(native_ctx.snapshot())
    native_ctx.rewind(0)
    return two - one


def walk(engines: dict, tokens: list[int], frontiers: list[int], gen_tokens: int, repeat: int,
         log=print, lookup: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """engines: name -> Engine; returns name -> rows (and "<name>+lookup" -> rows for `lookup`)."""
    eos = sorted(next(iter(engines.values())).tokenizer.eos_ids)
    per_pos = {name: kv_bytes_per_position(e.native_ctx, tokens) for name, e in engines.items()}
    for e in engines.values():
        for test in WARMUP:
            time_test(e.native_ctx, tokens, test, eos)
        e.reset()
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    rows.update({f"{name}+lookup": [] for name in lookup})
    prev = 0
    for f in frontiers:
        for name, e in engines.items():
            r = _frontier(e, tokens, prev, f, gen_tokens, repeat, eos, per_pos[name])
            rows[name].append(r)
            line = (f"frontier {f:5d} {name:>5}: prefill {r['prefill_tps']:8.1f} tok/s"
                    f"   decode {r['gen_tps']:7.1f} tok/s")
            if name in lookup:
                tps, st = _decode(e, tokens, f, gen_tokens, repeat, eos, max_draft=MAX_DRAFT)
                rows[f"{name}+lookup"].append(dict(r, gen_tps=tps))
                line += f"   with prompt lookup {tps:7.1f} tok/s ({st.accepted}/{st.drafted} guesses kept)"
            log(line)
        prev = f
    for e in engines.values():
        e.reset()
    return rows


def _frontier(e, tokens: list[int], prev: int, f: int, gen_tokens: int, repeat: int, eos: list[int],
              per_pos: int) -> dict:
    """Time one frontier on an engine that holds tokens[:prev]; leaves it holding tokens[:f]."""
    pre = []
    for _ in range(repeat):
        e.rewind(prev)
        t0 = time.perf_counter()
        e.append(tokens[prev:f])
        pre.append(time.perf_counter() - t0)
    gen_tps, _ = _decode(e, tokens, f, gen_tokens, repeat, eos, max_draft=0)
    return dict(ctx_tokens=f, prefill_tokens=f - prev,
                prefill_tps=round((f - prev) / statistics.median(pre), 1), gen_tokens=gen_tokens,
                gen_tps=gen_tps, kv_bytes=f * per_pos)


def _decode(e, tokens: list[int], f: int, gen_tokens: int, repeat: int, eos: list[int],
            max_draft: int) -> tuple[float, LookupStats]:
    """The frontier's greedy decode (EOS suppressed), `repeat` times from tokens[:f]; max_draft
    > 0 with prompt lookup. Returns (tok/s median, the last repetition's lookup counters) and
    leaves the engine holding tokens[:f]."""
    times = []
    for _ in range(repeat):
        e.rewind(f - 1)  # re-evaluate the frontier's last token: a rewind drops the logits
        e.append(tokens[f - 1:f])
        t0 = time.perf_counter()
        feed = DraftFeed(e, max_draft=max_draft)
        for _ in range(gen_tokens):
            logits = feed.logits().copy()
            logits[eos] = -math.inf
            feed.push(int(np.argmax(logits)))
        feed.close()
        times.append(time.perf_counter() - t0)
    e.rewind(f)
    return round(gen_tokens / statistics.median(times), 1), feed.stats


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def plot(series: dict[str, list[dict]], path: Path, title: str) -> None:
    """series: label -> rows, one curve each in both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bot) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, rows in series.items():
        x = [r["ctx_tokens"] for r in rows]
        if not label.endswith("+lookup"):  # a lookup series' prefill is its engine's own
            top.plot(x, [r["prefill_tps"] for r in rows], "o-", label=label)
        bot.plot(x, [r["gen_tps"] for r in rows], "o--" if label.endswith("+lookup") else "o-", label=label)
    top.set_ylabel("prefill tok/s\n(interval to frontier)")
    first = next(iter(series.values()))
    bot.set_ylabel(f"decode tok/s\n({first[0]['gen_tokens']} tokens at frontier)")
    bot.set_xlabel("context tokens (frontier)")
    spec = any(label.endswith("+lookup") for label in series)
    for ax in (top, bot):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(title="KV cache (+ prompt lookup)" if ax is bot and spec else "KV cache")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
