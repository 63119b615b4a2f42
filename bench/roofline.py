"""The hardware roofs the benchmark divides by: memory bandwidth and compute peaks, measured once.

`measure(threads, tier)` compiles bench/roofline.c for one zen5 ISA tier (with only that tier's
flags, never -march=native; once per source version and tier, cached under ~/.cache/zen5/bench/)
and runs it (the harness at the start and at the end of a run, keeping the higher of each figure:
`best_of`): best-of-several read and triad bandwidth with the tier's vector width and a working
set inside the last-level cache share this VM gets (48 MiB: larger than the L2s, smaller than the
L3 a guest here sees) and one far beyond it (1 GiB, so from DRAM), and the int8 and fp32 FMA peaks
of the instructions the tier's kernels use:
  amx       int8: tdpbssd on full 16 x 64-byte tiles (AMX), the unit its prefill products run
            on ("amx_int8_gops"; vpdpbusd zmm beside it); fp32: vfmadd231ps zmm
  avx512    int8: vpdpbusd zmm (VNNI);            fp32: vfmadd231ps zmm
  avx2vnni  int8: vpdpbusd ymm (AVX-VNNI, VEX);   fp32: vfmadd231ps ymm
  avx2      int8: vpmaddubsw+vpaddw ymm, the int16-accumulating inner loop of zen5's Q4 kernels
            ("maddubs_i16_gops", the roof the fractions use); also vpmaddubsw+vpmaddwd+vpaddd,
            the full int8 -> int32 dot product ("maddubs_i32_gops", recorded, not divided by);
            fp32: vfmadd231ps ymm
Every tier's row has "tier", "int8_gops" (the int8 roof), "int8_insn", "fma_fp32_gflops" and
"fma_insn"; amx / avx512 / avx2vnni rows also "vnni_int8_gops" (older results have only that
one). Rows of the amx tier recorded before 2026-12-05 14:00 UTC have no "amx_int8_gops": their
int8 roof was the vpdpbusd one, and their prefill fractions of it could pass 100%.
The C helper exists because numpy cannot issue wide loads with enough independent accumulators
to reach the roof, nor VNNI at all.

What is compared with what (see `fractions`):
  decode  achieved GB/s = tok/s x weight bytes read per token (every weight tensor once; the tied
          embedding counts once, as the output head), vs. the in-cache read bandwidth (the
          roof, "frac_peak") and vs. DRAM read bandwidth ("frac_alt");
  prefill achieved GOP/s = tok/s x 2 x parameters (the matmul work, head included, attention
          excluded: the convention of ../shared/specs/cpu-performance-notes.md), vs. the peak of
          the unit the weights' matmuls run on ("frac_peak": the tier's int8 peak for quantized
          weights, fp32 FMA for F32/F16/BF16) and vs. the other peak ("frac_alt").
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


# Each tier's compile flags: that tier's instructions only. The amx tier is the avx512 table with
# the int8 prefill's products on AMX tiles (csrc/kernels/kernels_amx.cpp): its roofs are the
# AVX-512 ones except the int8 peak, which is TDPBSSD's on full tiles (the vpdpbusd one is kept
# beside it as vnni_int8_gops).
AVX512_FLAGS = ("-DROOF_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vnni")
TIER_FLAGS = {"avx512": AVX512_FLAGS,
              "amx": AVX512_FLAGS + ("-DROOF_AMX", "-mamx-tile", "-mamx-int8"),
              "avx2vnni": ("-DROOF_AVX2VNNI", "-mavx2", "-mfma", "-mavxvnni"),
              "avx2": ("-DROOF_AVX2", "-mavx2", "-mfma")}


def _binary(tier: str = "avx512") -> Path:
    if tier not in TIER_FLAGS:
        raise ValueError(f"roofline: no roofs for tier {tier!r} (measured: {', '.join(TIER_FLAGS)})")
    src = HERE / "roofline.c"
    flags = ("-O3",) + TIER_FLAGS[tier] + ("-fopenmp",)
    digest = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    out_dir = Path(os.environ.get("ZEN5_BENCH_CACHE") or Path.home() / ".cache" / "zen5" / "bench")
    exe = out_dir / f"roofline-{tier}-{digest}"
    if not exe.exists():
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if not cc:
            raise RuntimeError("roofline: no C compiler (gcc) found")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        subprocess.run([cc, *flags, str(src), "-o", str(tmp)], check=True)
        os.replace(tmp, exe)
    return exe


def _run(threads: int, tier: str, llc_bytes: int) -> dict:
    env = dict(os.environ, OMP_PROC_BIND="spread", OMP_WAIT_POLICY="passive")
    out = subprocess.run([str(_binary(tier)), str(threads), str(llc_bytes), str(DRAM_BYTES)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def dram_read(threads: int, tier: str = "avx512") -> float:
    """The DRAM read roof alone (GB/s), about a second: a probe between timed repetitions."""
    return float(_run(threads, tier, 0)["read_dram_gbps"])


def measure(threads: int, tier: str = "avx512") -> dict:
    """Roofs of `tier` at `threads` threads: tier, read_llc_gbps, read_dram_gbps, triad_*,
    int8_gops (+ the tier's own int8 figures), fma_fp32_gflops, int8_insn, fma_insn."""
    return _run(threads, tier, LLC_BYTES)


def best_of(a: dict, b: dict) -> dict:
    """Two measurements of the same roofs (a run's start and end) as one: every figure the higher
    of the two. On a VM whose cores are shared, a probe taken in a slow window (measured here: an
    AVX2 int8 peak of 208 GOP/s at one thread where another probe 25 minutes earlier gave 302)
    would overstate every fraction the run divides by it; the best the machine showed is the roof."""
    return {k: max(v, b[k]) if isinstance(v, (int, float)) else v for k, v in a.items()}


def int8_peak(roof: dict) -> float:
    """The int8 roof of a roofline row: int8_gops, or vnni_int8_gops in rows older than tiers."""
    return float(roof.get("int8_gops") or roof["vnni_int8_gops"])


FLOAT_QUANTS = ("F32", "F16", "BF16")  # weights whose matmuls run on fp32 FMAs


def fractions(test: str, tps: float, roof: dict, bytes_per_token: int, ops_per_token: float,
              quant: str = "Q4_1") -> tuple[float, str, float, float]:
    """(achieved, unit, frac_peak, frac_alt) for one result; see the module doc."""
    if test.startswith("tg"):
        gbps = tps * bytes_per_token / 1e9
        return gbps, "GB/s", gbps / roof["read_llc_gbps"], gbps / roof["read_dram_gbps"]
    gops = tps * ops_per_token / 1e9
    int8, fma = gops / int8_peak(roof), gops / roof["fma_fp32_gflops"]
    return (gops, "GOP/s", fma, int8) if quant in FLOAT_QUANTS else (gops, "GOP/s", int8, fma)
