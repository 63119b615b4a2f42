"""What the KV cache type costs in accuracy: the fixed benchmark text (workload.fixed_text) read by
SmolLM2 Q4_1 under several (matmul, KV cache) configurations evaluated in lockstep, 256 tokens at
a time, each scored against the exact one (f32 matmuls, f32 cache) at every position:

  ppl            perplexity of the text's next tokens (all positions, and the last quarter,
                 where most cached positions are attended)
  kl_vs_exact    mean KL(exact || config) of the next-token distributions, in nats
  top1_vs_exact  share of positions whose most likely next token equals the exact one's

Rows are appended to bench/results/kv_quality.csv (this is a measurement, not a speed test: one
run suffices, nothing is timed). Usage:
    python bench/kv_quality.py [--tokens 4096] [--out bench/results]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from results_log import append_rows, commit  # noqa: E402
from workload import fixed_text, model_path  # noqa: E402

CONFIGS = (("f32", "f32"), ("int8", "f16"), ("int8", "q8_0"), ("f32", "q8_0"))   # the first is exact
CHUNK = 256


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def measure(n_tokens: int, threads: int | None = None) -> list[dict]:
    from zen5.engine import Engine
    from zen5.loader import load_weights

    path = model_path("Q4_1")
    weights = load_weights(path)
    engines = [Engine(weights, threads=threads, n_ctx=n_tokens, matmul=m, kv_type=k) for m, k in CONFIGS]
    tokens = engines[0].tokenizer.encode(fixed_text())[:n_tokens]
    if len(tokens) < n_tokens:
        raise ValueError(f"the fixed text has {len(tokens)} tokens, fewer than {n_tokens}")
    nll = [[] for _ in engines]
    kl = [[] for _ in engines]
    top1 = [[] for _ in engines]
    for c0 in range(0, n_tokens - 1, CHUNK):
        chunk = tokens[c0:min(c0 + CHUNK, n_tokens - 1)]
        target = np.array(tokens[c0 + 1:c0 + 1 + len(chunk)])
        logp = [_log_softmax(e.native_ctx.eval(chunk, all_logits=True)) for e in engines]
        exact = logp[0]
        for i, lp in enumerate(logp):
            nll[i].append(-lp[np.arange(len(chunk)), target])
            kl[i].append((np.exp(exact) * (exact - lp)).sum(axis=1))
            top1[i].append(lp.argmax(axis=1) == exact.argmax(axis=1))
    date = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for (m, k), n, d, t in zip(CONFIGS, nll, kl, top1):
        n = np.concatenate(n)
        rows.append(dict(date=date, commit=commit(), model=Path(path).name, tokens=n_tokens, matmul=m, kv_type=k,
                         ppl=round(float(np.exp(n.mean())), 4),
                         ppl_last_quarter=round(float(np.exp(n[-len(n) // 4:].mean())), 4),
                         kl_vs_exact=round(float(np.concatenate(d).mean()), 6),
                         top1_vs_exact=round(float(np.concatenate(t).mean()), 4)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args(argv)
    rows = measure(a.tokens, a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    append_rows(a.out / "kv_quality.csv", rows)
    for r in rows:
        print(f"matmul {r['matmul']:4} KV {r['kv_type']:4}: ppl {r['ppl']:8.4f} "
              f"(last quarter {r['ppl_last_quarter']:.4f}), "
              f"KL vs exact {r['kl_vs_exact']:.5f} nats, top-1 = exact at {100 * r['top1_vs_exact']:.1f}%")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
