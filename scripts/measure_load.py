"""Peak resident memory and time of loading a model, in a fresh process (issue 21, lean loading).

    python scripts/measure_load.py MODEL [--ctx N] [--tokens N] [--json]

Prints the interpreter's baseline RSS (zen5, numpy, gguf imported), then the peak RSS during the
load (VmHWM, reset after the baseline via /proc/self/clear_refs) and the RSS after it, both less
the baseline, against the bytes the kernels read (the packed arena: `Engine.info()["weight_bytes"]`
where the engine reports it, else computed here from the tensor shapes).
"""
from __future__ import annotations

import argparse
import json
import time


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def packed_bytes(t, tied: bool) -> int:
    """The arena's bytes for one matrix (model.cpp own_weights), 0 for what stays in the file."""
    if len(t.shape) != 2 or (t.name == "token_embd.weight" and not tied):
        return 0
    rows, cols = t.shape
    if t.ggml_type in (2, 3, 8):  # Q4_0, Q4_1, Q8_0: groups of 16 rows x blocks of 32 columns
        per = {2: 256 + 32, 3: 256 + 64, 8: 512 + 32}[t.ggml_type]
        n = -(-rows // 16) * (cols // 32) * per
    else:
        steps = (cols + 1) // 2 if t.ggml_type == 30 else cols
        n = -(-rows // 64) * steps * 4 * (32 if t.ggml_type == 1 else 64)
    return -(-n // 64) * 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import gguf  # noqa: F401  (the loader's imports, in the baseline)
    import numpy  # noqa: F401
    import tokenizers  # noqa: F401

    import zen5
    from zen5.engine import Engine
    from zen5.loader import load_weights
    from zen5.registry import resolve_model
    path = resolve_model(a.model)
    base = status()["VmRSS"]
    reset_peak()
    t0 = time.perf_counter()
    w = load_weights(path)
    peak_weights = status()["VmHWM"] - base  # the Python loader (header, tokenizer, F32 norms)
    eng = Engine(w, n_ctx=a.ctx, threads=a.threads)
    t1 = time.perf_counter()
    s = status()
    info = eng.info()
    kernel = info.get("weight_bytes") or sum(packed_bytes(t, w.config.tied_output) for t in w.tensors.values())
    t2 = time.perf_counter()
    eng.append(list(range(3, 3 + a.tokens)))
    t3 = time.perf_counter()
    s2 = status()
    out = dict(model=path, version=zen5.__version__, ctx=a.ctx, baseline=base, kernel_bytes=kernel,
               load_s=round(t1 - t0, 3), first_eval_s=round(t3 - t2, 3),
               peak_load=s["VmHWM"] - base, peak_loader=peak_weights, after_load=s["VmRSS"] - base,
               after_eval=s2["VmRSS"] - base, peak_eval=s2["VmHWM"] - base,
               kv_bytes_reserved=info.get("kv_bytes_reserved"), kv_bytes_resident=eng.info().get("kv_bytes_resident"))
    out["peak_ratio"] = round(out["peak_load"] / kernel, 3)
    out["after_ratio"] = round(out["after_load"] / kernel, 3)
    if a.json:
        print(json.dumps(out))
        return
    mb = 1 << 20
    print(f"{path}\n  kernel bytes {kernel / mb:.1f} MiB, baseline RSS {base / mb:.1f} MiB, load {out['load_s']} s")
    print(f"  peak during load {out['peak_load'] / mb:.1f} MiB ({out['peak_ratio']}x; the Python loader's part "
          f"{out['peak_loader'] / mb:.1f} MiB), after load "
          f"{out['after_load'] / mb:.1f} MiB ({out['after_ratio']}x)")
    print(f"  after {a.tokens} tokens {out['after_eval'] / mb:.1f} MiB (peak {out['peak_eval'] / mb:.1f} MiB), "
          f"first eval {out['first_eval_s']} s; kv reserved {out['kv_bytes_reserved']}, "
          f"resident {out['kv_bytes_resident']}")


if __name__ == "__main__":
    main()
