"""Quick engine speed check (the full benchmark against peers and roofs is `python -m zen5 bench`).

Workload: prefill prompts of 128 and 512 tokens (a fixed text, tokenized and cut), then decode
128 tokens greedily with EOS ignored, at 1 and 2 threads. Warm-up excluded; each figure is the
median of --repeat runs. Rows are appended to bench/results/<cpu>.csv; the last line printed is
JSON. Usage: python bench/quick.py [--model smollm2] [--repeat 3] [--isa avx512|ref]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import numpy as np

from results_log import append_rows, commit, cpu_name
from zen5.engine import Engine

TEXT = ("The history of computing is a story of abstractions layered on top of one another. "
        "Each generation of engineers hides the details of the previous one, ") * 64


def steal() -> int:
    return int(Path("/proc/stat").read_text().split("\n")[0].split()[8])


def measure(eng: Engine, n_prompt: int, n_gen: int) -> tuple[float, float]:
    toks = eng.tokenizer.encode(TEXT)[:n_prompt]
    eng.reset()
    t0 = time.perf_counter()
    eng.native_ctx.eval(toks)
    t1 = time.perf_counter()
    for _ in range(n_gen):
        logits = eng.native_ctx.logits()
        logits[list(eng.tokenizer.eos_ids)] = -np.inf
        eng.native_ctx.eval([int(np.argmax(logits))])
    t2 = time.perf_counter()
    eng.reset()
    return n_prompt / (t1 - t0), n_gen / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--isa", default=None)
    a = ap.parse_args()
    out = Path(__file__).parent / "results" / f"{cpu_name()}.csv"
    rows = []
    for threads in (1, 2):
        eng = Engine.load(a.model, threads=threads, n_ctx=1024, isa=a.isa)
        measure(eng, 32, 8)  # warm-up: page in the weights
        for n_prompt in (128, 512):
            st0 = steal()
            runs = [measure(eng, n_prompt, 128) for _ in range(a.repeat)]
            rows.append(dict(
                date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
                model=Path(eng.weights.metadata["path"]).name, threads=threads, isa=eng.isa,
                prompt_tokens=n_prompt, gen_tokens=128,
                prefill_tps=round(statistics.median(r[0] for r in runs), 1),
                decode_tps=round(statistics.median(r[1] for r in runs), 1),
                steal_ticks=steal() - st0))
            print(rows[-1])
    append_rows(out, rows)
    print(json.dumps({f"{r['threads']}t_pp{r['prompt_tokens']}": [r["prefill_tps"], r["decode_tps"]] for r in rows}))


if __name__ == "__main__":
    main()
