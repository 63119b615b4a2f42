"""The hardware roofs the benchmark divides by: memory bandwidth and compute peaks, measured once.

`measure(threads)` compiles bench/roofline.c (once per source version, cached under
~/.cache/zen5/bench/) and runs it: best-of-several read and triad bandwidth with a working set
inside the last-level cache share this VM gets (48 MiB: larger than the 2 x 4 MiB of L2, smaller
than the ~90-100 MiB of L3 a guest here sees) and one far beyond it (1 GiB, so from DRAM), and the
int8 VNNI (vpdpbusd) and fp32 FMA peaks. The C helper exists because numpy cannot issue AVX-512
loads with enough independent accumulators to reach the roof, nor VNNI at all.

What is compared with what (see `fractions`):
  decode  achieved GB/s = tok/s x weight bytes read per token (every weight tensor once; the tied
          embedding counts once, as the output head), vs. the in-cache read bandwidth (the
          roof, "frac_peak") and vs. DRAM read bandwidth ("frac_alt");
  prefill achieved GOP/s = tok/s x 2 x parameters (the matmul work, head included, attention
          excluded: the convention of ../shared/specs/cpu-performance-notes.md), vs. the peak of
          the unit the weights' matmuls run on ("frac_peak": int8 VNNI for quantized weights, fp32
          FMA for F32/F16/BF16) and vs. the other peak ("frac_alt").
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLC_BYTES = 48 << 20
DRAM_BYTES = 1 << 30


def _binary() -> Path:
    src = HERE / "roofline.c"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    out_dir = Path(os.environ.get("ZEN5_BENCH_CACHE") or Path.home() / ".cache" / "zen5" / "bench")
    exe = out_dir / f"roofline-{digest}"
    if not exe.exists():
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if not cc:
            raise RuntimeError("roofline: no C compiler (gcc) found")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        subprocess.run([cc, "-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp",
                        str(src), "-o", str(tmp)], check=True)
        os.replace(tmp, exe)
    return exe


def measure(threads: int) -> dict:
    """Roofs at `threads` threads: read_llc_gbps, read_dram_gbps, triad_*, vnni_int8_gops,
    fma_fp32_gflops."""
    env = dict(os.environ, OMP_PROC_BIND="spread", OMP_WAIT_POLICY="passive")
    out = subprocess.run([str(_binary()), str(threads), str(LLC_BYTES), str(DRAM_BYTES)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


FLOAT_QUANTS = ("F32", "F16", "BF16")  # weights whose matmuls run on fp32 FMAs


def fractions(test: str, tps: float, roof: dict, bytes_per_token: int, ops_per_token: float,
              quant: str = "Q4_1") -> tuple[float, str, float, float]:
    """(achieved, unit, frac_peak, frac_alt) for one result; see the module doc."""
    if test.startswith("tg"):
        gbps = tps * bytes_per_token / 1e9
        return gbps, "GB/s", gbps / roof["read_llc_gbps"], gbps / roof["read_dram_gbps"]
    gops = tps * ops_per_token / 1e9
    vnni, fma = gops / roof["vnni_int8_gops"], gops / roof["fma_fp32_gflops"]
    return (gops, "GOP/s", fma, vnni) if quant in FLOAT_QUANTS else (gops, "GOP/s", vnni, fma)
