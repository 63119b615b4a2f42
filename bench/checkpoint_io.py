"""Disk checkpoint I/O: is restoring N tokens from disk far cheaper than prefilling them?

Workload (fixed): the default model (SmolLM2-135M-Instruct Q4_1), a fixed text cut to N tokens
(--tokens, default 1024 and 4096), prefilled in one call. Then, each the median of --repeat runs:
  save     CheckpointStore.save of that state (native snapshot + header, text, tokens, logits,
           KV rows, CRC; temp file + rename) into a fresh directory under --dir (default: the
           temp directory, which must be on a real disk, not a tmpfs)
  restore  CheckpointStore.load (read + verify) + Engine.restore into a second engine, with the
           file in the page cache ("warm") and evicted from it with posix_fadvise ("cold": only
           this file is dropped, nothing else on the machine)
  copy     shutil.copyfile of the same file, warm and cold: the plain-I/O roof on this disk
The ratio restore / prefill is the cost of resuming N tokens from disk relative to recomputing
them. Rows are appended to bench/results/checkpoints.csv; the last line printed is JSON.
Usage: python bench/checkpoint_io.py [--model smollm2] [--tokens 1024 4096] [--repeat 3]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from results_log import append_rows, commit
from zen5.checkpoints import CheckpointStore
from zen5.engine import Engine

TEXT = ("The history of computing is a story of abstractions layered on top of one another. "
        "Each generation of engineers hides the details of the previous one, ") * 400


def evict_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(eng: Engine, other: Engine, n: int, repeat: int, work: Path) -> dict:
    tokens = eng.tokenizer.encode(TEXT)[:n]
    text = eng.tokenizer.decode(tokens)
    eng.reset()
    prefill = timed(lambda: eng.append(tokens))
    fp = eng.native.fingerprint
    saves, entry = [], None
    for i in range(repeat):
        st = CheckpointStore(work / f"save{n}_{i}", fingerprint=fp, min_tokens=1)
        saves.append(timed(lambda: st.save(text, eng.tokens, eng.native_ctx.logits(), eng.snapshot(), eng.n_ctx,
                                           "cold")))
        entry, store = st.entries()[0], st
    size = entry.size

    def restore():
        ck = store.load(entry)
        other.restore(ck.tokens, ck.kv)

    restore()  # first touch of the second engine's KV pages
    warm = [timed(restore) for _ in range(repeat)]
    cold = []
    for _ in range(repeat):
        evict_from_page_cache(entry.path)
        cold.append(timed(restore))
    assert other.tokens == eng.tokens
    copy_to = work / "copy.bin"
    copy_warm = [timed(lambda: shutil.copyfile(entry.path, copy_to)) for _ in range(repeat)]
    copy_cold = []
    for _ in range(repeat):
        evict_from_page_cache(entry.path)
        copy_cold.append(timed(lambda: shutil.copyfile(entry.path, copy_to)))
    med = statistics.median
    mb = size / 1e6
    return dict(tokens=n, file_mb=round(mb, 1), prefill_s=round(prefill, 3),
                save_s=round(med(saves), 3), save_mbps=round(mb / med(saves)), save_tps=round(n / med(saves)),
                restore_s=round(med(warm), 3), restore_mbps=round(mb / med(warm)), restore_tps=round(n / med(warm)),
                restore_cold_s=round(med(cold), 3), restore_cold_mbps=round(mb / med(cold)),
                copy_mbps=round(mb / med(copy_warm)), copy_cold_mbps=round(mb / med(copy_cold)),
                restore_over_prefill=round(med(warm) / prefill, 4),
                restore_cold_over_prefill=round(med(cold) / prefill, 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default=None, help="where to write (default: the temp dir; use a real disk, not tmpfs)")
    a = ap.parse_args()
    n_ctx = max(a.tokens) + 16
    eng = Engine.load(a.model, threads=a.threads, n_ctx=n_ctx)
    other = Engine(eng.weights, threads=a.threads, n_ctx=n_ctx)
    eng.append(eng.tokenizer.encode(TEXT)[:32])  # warm-up: page in the weights
    out = Path(__file__).parent / "results" / "checkpoints.csv"
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="zen5-ckbench-") as work:
        print(f"writing under {work}", flush=True)
        for n in a.tokens:
            r = measure(eng, other, n, a.repeat, Path(work))
            rows.append(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
                             model=Path(eng.weights.metadata["path"]).name, threads=eng.threads, **r))
            print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    append_rows(out, rows)
    print(json.dumps({"checkpoint_io": rows}))


if __name__ == "__main__":
    main()
