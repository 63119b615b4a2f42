"""`python -m zen5 bench`: zen5 against its peers and the hardware roofs, one fixed workload.

The harness lives in bench/ (not in the installed package: it drives peer builds, C helpers
and writes bench/results, all of which need the repository); `python -m zen5 bench` loads this
file from the checkout. Run it from a clone after `bash scripts/setup.sh` and, for the peers,
`bash bench/build_peers.sh` (llama.cpp from the llama-cpp-python sdist, built outside the repo).

ISA tier: zen5 runs the tier given with --isa (ref, avx2, avx2vnni, avx512; default the best
this CPU supports), and the peers are the llama.cpp builds of the same instruction set
(peers.default_peers: --isa avx2 on an AVX-512 CPU is measured against `llama.cpp-avx2`,
--isa avx2vnni against `llama.cpp-avx2vnni` and `llama.cpp-avx2`), plus
PyTorch only for the best tier (it picks its own kernels; it cannot be held to AVX2).

Workload (fixed; see workload.py for the test definitions and the text):
  roofline  read / triad bandwidth in and beyond the LLC, the tier's int8 peak (vpdpbusd;
            amx: TDPBSSD on tiles; AVX2: vpmaddubsw) and fp32 FMA peak, at each thread count, at the start and at the
            end of the run, the higher of each figure kept (roofline.py).
  kernel    SmolLM2-135M-Instruct in Q4_1 (shipped), Q8_0 and BF16 (scripts/convert_gguf.py):
            pp128, pp512, pp2048 and tg128, at 1 and 2 threads.
  peers     the same tests through llama-bench (the builds of bench/build_peers.sh that match the
            tier: on the AMX Xeon the AVX-512 build without AMX and the native AMX build) on
            the same GGUF files, and PyTorch eager fp32 / bf16 on the Q4_1 file's weights
            dequantized (dense speed does not depend on the source quant, so it runs once and
            every quant's ratio uses it).
  frontier  Q4_1 at 2 threads: the text walked to 512, 1024, ... 8192 tokens (frontier.py), with
            the f16 KV cache (the default) and the q8_0 one, interleaved frontier by frontier;
            the f16 engine's decode is timed a second time with prompt lookup (lookup.py).
  --model-size 1.7b|8b   instead of the modes above: real model sizes (real_bench.py, issue 21):
            zen5 against the tier's llama.cpp builds on Llama GGUFs at SmolLM2-1.7B's or
            Llama-3-8B's widths with random weights (real_models.py, cached in
            ~/.cache/zen5/bench-models; speed does not depend on the weights' values, and the run
            says so), in Q4_0, Q4_1, Q8_0 and BF16 (--types restricts): pp512 and tg128 at 1 and 2
            threads, 3 repetitions unless --repeat; per engine the load time (open to first token)
            and the peak resident memory during load and after (zen5 in a fresh child process per
            block, llama.cpp through a `llama-bench -p 0 -n 1,16` probe); decode as bytes per token
            (the matrices' bytes) over the DRAM read roof measured in the same run.
Every repetition runs each engine once per (quant, threads), engines in a rotating order, so
zen5 and the peers share each time window (this VM drifts 5-20% between runs minutes apart).
Each engine block starts with a warm-up (pp64, tg8) that is never recorded. Default 5
repetitions; rows report the median, min and max tokens/s.

Outputs (in --out, default bench/results; a --quick run adds "-quick" to every name; <cpu> is
results_log.cpu_name(), and a run of a tier below the CPU's best is <cpu>-<tier>, e.g.
AMD_EPYC_Zen4-avx2-bench.csv, so it is kept beside the best tier's files):
  <cpu>-bench.csv     appended, one row per (engine, quant, threads, test), with the roofline
                      fractions (frac_peak: decode GB/s over in-LLC read bandwidth, prefill GOP/s
                      over the tier's int8 peak, or the fp32 FMA peak for F32/F16/BF16 weights;
                      frac_alt: over DRAM bandwidth / the other compute peak),
                      commit, steal time and the 1-minute load average at the start;
  <cpu>-roofline.csv  appended, the roofs measured in this run (with the tier they are for);
  <cpu>-frontier.csv / .png  the latest frontier walk (columns as frontier.COLUMNS) with the
                      default f16 cache; <cpu>-frontier-kv-<type>.csv the other cache types' (the
                      plot shows every type); <cpu>-frontier-lookup.csv the f16 decode with
                      prompt lookup (same tokens; a dashed curve in the plot);
  <cpu>-real.csv      (--model-size) appended, one row per (engine, type, threads, test) with
                      test pp512 / tg128 / load / failed (columns real_bench.REAL_COLUMNS);
  stdout              a table with zen5/peer ratios, then one JSON line with the headline.
A full run into bench/results also regenerates the README's Performance section (report.py).

One command for the recorded run: python -m zen5 bench --wait-quiet 20
Smoke run (1 repeat, pp128 + tg128, Q4_1, no peers, a 2-point frontier): python -m zen5 bench --quick
The AVX2 tier on an AVX-512 CPU: python -m zen5 bench --isa avx2 (needs the llama.cpp-avx2 build)
DeepSeek V4 Flash's real-width layers, projected: python -m zen5 bench --deepseek-v4 --wait-quiet 20
  (a smoke run: --deepseek-v4 --quick --out /tmp/x, 16 experts instead of 256)
Real model sizes: python -m zen5 bench --model-size 1.7b --wait-quiet 20 (then --model-size 8b);
  a smoke run of that code: python -m zen5 bench --model-size tiny --prompts 64 --gen 16 --repeat 1 --out /tmp/x
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import frontier as frontier_mod  # noqa: E402
import roofline  # noqa: E402
from peers import ALL_PEERS, LLAMA_PEERS, TIERS, TORCH_DTYPES, LlamaBench, TorchWorker, cpu_flags, default_peers  # noqa: E402
from real_models import SHAPES  # noqa: E402
from real_models import TYPES as REAL_TYPES  # noqa: E402
from results_log import commit, cpu_name  # noqa: E402
from workload import QUANTS, ROOT, Zen5Runner, fixed_text, model_path, n_tokens, weight_stats  # noqa: E402

MODES = ("roofline", "kernel", "peers", "frontier")
COLUMNS = ("run_id", "date", "commit", "cpu", "workload", "engine", "build", "isa", "model", "quant",
           "threads", "test", "n_tokens", "repeats", "tps_median", "tps_min", "tps_max", "achieved",
           "unit", "frac_peak", "frac_alt", "steal_ticks", "steal_pct", "load1_start")


@dataclass(frozen=True)
class BenchConfig:
    """The workload; the CLI takes its defaults from here (and from `quick()` with --quick)."""
    modes: tuple[str, ...] = MODES
    quants: tuple[str, ...] = QUANTS
    threads: tuple[int, ...] = (1, 2)
    prompts: tuple[int, ...] = (128, 512, 2048)
    gen: int = 128
    repeat: int = 5
    peers: tuple[str, ...] | None = None  # None: peers.default_peers for the tier and this CPU
    isa: str = ""                  # zen5's ISA tier; "": the best this CPU supports
    frontier_step: int = 512
    frontier_max: int = 0          # 0: the model's training context (8192 for SmolLM2)
    frontier_gen: int = 32
    frontier_threads: int = 2
    frontier_repeat: int = 3
    frontier_kv: tuple[str, ...] = ("f16", "q8_0")  # KV cache types walked; the first names the main CSV
    frontier_lookup: bool = True   # also time the first cache type's decode with prompt lookup
    out: str = str(ROOT / "bench" / "results")
    wait_quiet: float = 0.0        # minutes to wait for the 1-minute load average to drop
    quiet_load: float = 1.0
    workload: str = "full"
    model_size: str = ""           # "1.7b" / "8b": the real-model-size mode (real_bench.py) instead of the modes
    types: tuple[str, ...] = ()    # that mode's weight types; (): real_models.TYPES
    models_dir: str = ""           # where real_models.py caches its files; "": ~/.cache/zen5/bench-models
    deepseek_v4: bool = False      # the DeepSeek V4 real-width layers mode (dsv4_bench.py) instead of the modes
    depths: tuple[int, ...] = (0, 2048, 8192)  # that mode's context depths

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES] + [q for q in self.quants if q not in QUANTS] \
            + [p for p in self.peers or () if p not in ALL_PEERS] \
            + ([self.isa] if self.isa and self.isa not in TIERS else []) \
            + [k for k in self.frontier_kv if k not in ("f16", "f32", "q8_0")]
        bad += [self.model_size] if self.model_size and self.model_size not in SHAPES else []
        bad += [t for t in self.types if t not in REAL_TYPES]
        if bad or not self.frontier_kv:
            raise ValueError(f"unknown mode / quant / peer / ISA tier / KV type / model size / type: "
                             f"{', '.join(bad) or 'no KV type'}")
        if self.repeat < 1 or self.gen < 1 or min(self.threads) < 1 or min(self.prompts) < 1 \
                or min(self.depths) < 0 or any(d % 128 for d in self.depths):
            raise ValueError("repeat, gen, threads and prompts must be >= 1, depths multiples of 128")
        if self.frontier_step < 1 or self.frontier_gen < 1 or self.frontier_repeat < 1:
            raise ValueError("frontier step, gen and repeat must be >= 1")

    @classmethod
    def quick(cls) -> "BenchConfig":
        return cls(modes=("kernel", "frontier"), quants=("Q4_1",), prompts=(128,), repeat=1,
                   peers=(), frontier_step=128, frontier_max=256, frontier_gen=8, frontier_repeat=2,
                   workload="quick")

    @property
    def tests(self) -> list[str]:
        return [f"pp{n}" for n in self.prompts] + [f"tg{self.gen}"]


# ---------------------------------------------------------------- the machine and the checkout


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs, from the `cpu` line of /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return vals[7], sum(vals[:8])


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_until_quiet(minutes: float, threshold: float, log) -> float:
    """Poll every 30 s until two readings in a row (30 s apart) are below `threshold`, or the
    time is up; one low reading is often just a gap between someone else's jobs."""
    deadline, quiet = time.time() + minutes * 60, 0
    while True:
        now = load1()
        quiet = quiet + 1 if now < threshold else 0
        if quiet >= 2 or time.time() >= deadline:
            break
        log(f"load average {now:.2f} ({quiet}/2 quiet readings below {threshold}): waiting 30 s "
            f"(running anyway from {time.ctime(deadline)})")
        time.sleep(30)
    if quiet < 2:
        log(f"load average still {now:.2f} after {minutes:g} min: running anyway")
    return now


@contextlib.contextmanager
def pinned(threads: int):
    """1-thread work on one fixed CPU, the lowest-numbered this process may use; other thread
    counts as they are. The 2-vCPU VMs these runs are recorded on did not give both vCPUs the same
    speed: the same 1-thread 512-token prefill (1.7B Q4_0, zen5, fresh processes, alternating)
    ran at 99-111 tok/s pinned to CPU 0 and 64-92 pinned to CPU 1, so a fresh 1-thread process
    measured whichever vCPU the scheduler gave it (zen5's prefill in one recorded run: 60, 104 and
    69 tok/s), and two engines compared in one run could be on different ones. Child processes
    (engines, llama-bench, the roofline probes) inherit the affinity, so inside this block every
    1-thread measurement runs on the same CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads != 1 or len(allowed) < 2:
        yield
        return
    os.sched_setaffinity(0, {allowed[0]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, set(allowed))


def best_tier(tiers: list[tuple[str, str]]) -> str:
    """The best tier of _native.isa_tiers() (worst to best, "" missing = supported)."""
    return [name for name, missing in tiers if not missing][-1]


def resolve_tier(requested: str, tiers: list[tuple[str, str]]) -> tuple[str, str]:
    """(tier to run, the CPU's best); an unsupported request fails with what the CPU lacks."""
    known = dict(tiers)
    best = best_tier(tiers)
    tier = requested or best
    if tier not in known:
        raise ValueError(f"unknown ISA tier {tier!r}: zen5 has {', '.join(known)}")
    if known[tier]:
        raise RuntimeError(f"ISA tier {tier} does not run here: {known[tier]}")
    return tier, best


def result_stem(cpu: str, tier: str, best: str) -> str:
    """The results' file-name stem: <cpu> for the CPU's best tier, <cpu>-<tier> for a forced lower
    one (e.g. AMD_EPYC_Zen4-avx2), so both runs keep their files side by side."""
    return cpu if tier == best else f"{cpu}-{tier}"


# ---------------------------------------------------------------- one run
class Run:
    def __init__(self, cfg: BenchConfig, log=print):
        self.cfg, self.log = cfg, log
        from zen5 import _native

        self.cpu, self.commit = cpu_name(), commit()
        self.tier, self.best = resolve_tier(cfg.isa, _native.isa_tiers())
        self.stem = result_stem(self.cpu, self.tier, self.best)
        self.peers = cfg.peers if cfg.peers is not None else default_peers(self.tier, self.best, cpu_flags())
        self.suffix = "-quick" if cfg.workload == "quick" else ""
        self.out = Path(cfg.out)
        self.samples: dict[tuple, list[float]] = {}      # (engine, quant, threads, test) -> seconds
        self.steal: dict[tuple, list[int]] = {}           # (engine, quant, threads) -> [steal, total]
        self.describe: dict[tuple, tuple[str, str]] = {}  # (engine, quant, threads) -> (build, isa)
        self.roofs: dict[int, dict] = {}
        self.frontier_rows: dict[str, list[dict]] = {}  # KV cache type -> rows
        self.load_samples: list[float] = []

    def execute(self) -> dict:
        cfg = self.cfg
        self.load1_start = load1()
        if cfg.wait_quiet > 0:
            self.load1_start = wait_until_quiet(cfg.wait_quiet, cfg.quiet_load, self.log)
        self.run_id = datetime.datetime.now().isoformat(timespec="seconds")
        steal0 = cpu_ticks()
        zen5 = Zen5Runner(max_tokens=max(max(cfg.prompts), cfg.gen + 1, 64 + 1), isa=self.tier)
        self.log(f"zen5 ISA tier {self.tier} (best here: {self.best}); peers: {', '.join(self.peers) or 'none'}")
        tok = zen5.engine(cfg.quants[0], cfg.threads[0]).tokenizer
        self.tokens = tok.encode(fixed_text())
        self.eos = sorted(tok.eos_ids)
        need = max(max(cfg.prompts), self._frontiers(zen5)[-1] if "frontier" in cfg.modes else 0)
        if len(self.tokens) < need:
            raise RuntimeError(f"the fixed text has {len(self.tokens)} tokens, the workload needs {need}")
        if "roofline" in cfg.modes and self.tier == "ref":
            self.log("roofline: the ref tier has no SIMD roofs; skipped")
        elif "roofline" in cfg.modes:
            for t in cfg.threads:
                self.roofs[t] = roofline.measure(t, self.tier)
                self.log(f"roofline {t}t: {self.roofs[t]}")
        if "frontier" in cfg.modes:  # first: short, and it fails early if anything is amiss
            self._frontier(zen5)
            self._write_frontier()
        try:
            if "kernel" in cfg.modes or "peers" in cfg.modes:
                self._kernel_and_peers(zen5)
        finally:
            TorchWorker.close()
        for t, first in list(self.roofs.items()):  # again at the end: the higher of each figure
            again = roofline.measure(t, self.tier)
            self.log(f"roofline {t}t at the end: {again}")
            self.roofs[t] = roofline.best_of(first, again)
        steal1 = cpu_ticks()
        self.steal_pct = 100.0 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
        return self._write()

    def _runners(self, zen5: Zen5Runner) -> list:
        cfg = self.cfg
        runners = [zen5] if "kernel" in cfg.modes else []
        if "peers" in cfg.modes:
            for name in self.peers:
                if name in LLAMA_PEERS:
                    runners.append(LlamaBench(name))
                else:
                    runners.append(TorchWorker(name, model_path("Q4_1"),
                                               max(max(cfg.prompts), cfg.gen + 1, 65), self.eos))
        return runners

    def _kernel_and_peers(self, zen5: Zen5Runner) -> None:
        cfg = self.cfg
        runners = self._runners(zen5)
        for q in cfg.quants:
            model_path(q)  # convert before timing anything
        for rep in range(cfg.repeat):
            t_rep = time.time()
            self.load_samples.append(load1())
            for quant in cfg.quants:
                for threads in cfg.threads:
                    k = rep % len(runners)
                    for r in runners[k:] + runners[:k]:  # rotate who goes first
                        if r.name in TORCH_DTYPES and quant != "Q4_1":
                            continue
                        s0 = cpu_ticks()
                        secs = r.run(quant, threads, self.tokens, cfg.tests)
                        s1 = cpu_ticks()
                        key = (r.name, quant, threads)
                        acc = self.steal.setdefault(key, [0, 0])
                        acc[0] += s1[0] - s0[0]
                        acc[1] += s1[1] - s0[1]
                        self.describe.setdefault(key, r.describe(quant, threads))
                        for test, dt in secs.items():
                            self.samples.setdefault(key + (test,), []).append(dt)
            self.log(f"repetition {rep + 1}/{cfg.repeat} done in {time.time() - t_rep:.0f} s "
                     f"(load {load1():.2f})")

    def _frontiers(self, zen5: Zen5Runner) -> list[int]:
        cfg = self.cfg
        top = cfg.frontier_max or zen5.engine(cfg.quants[0], cfg.threads[0]).config.n_ctx_train
        return list(range(cfg.frontier_step, top + 1, cfg.frontier_step))

    def _frontier(self, zen5: Zen5Runner) -> None:
        from zen5.engine import Engine

        cfg = self.cfg
        points = self._frontiers(zen5)
        zen5.engine("Q4_1", cfg.frontier_threads)  # loads the Q4_1 weights if not yet loaded
        engines = {kv: Engine(zen5.weights["Q4_1"], threads=cfg.frontier_threads, n_ctx=points[-1] + cfg.frontier_gen,
                              kv_type=kv, isa=self.tier) for kv in cfg.frontier_kv}
        self.frontier_rows = frontier_mod.walk(engines, self.tokens, points, cfg.frontier_gen,
                                               cfg.frontier_repeat, log=self.log,
                                               lookup=cfg.frontier_kv[:1] if cfg.frontier_lookup else ())
        eng = next(iter(engines.values()))
        self.frontier_engine = f"zen5 {eng.isa} matmul={eng.matmul}, Q4_1, {cfg.frontier_threads} threads"

    # ------------------------------------------------------------ results
    def _stats(self, engine: str, quant: str) -> tuple[int, float]:
        """(weight bytes per decoded token, prefill ops per token) for an engine's weights."""
        st = weight_stats(model_path(quant))
        if engine in TORCH_DTYPES:  # dense copies of the same parameters
            return st.n_params * (4 if TORCH_DTYPES[engine] == "fp32" else 2), st.ops_per_token
        return st.bytes_per_token, st.ops_per_token

    def rows(self) -> list[dict]:
        out, date = [], datetime.datetime.now().isoformat(timespec="seconds")
        for (engine, quant, threads, test), secs in self.samples.items():
            tps = sorted(n_tokens(test) / s for s in secs)
            med = statistics.median(tps)
            build, isa = self.describe[(engine, quant, threads)]
            steal, total = self.steal[(engine, quant, threads)]
            row = dict(run_id=self.run_id, date=date, commit=self.commit, cpu=self.cpu,
                       workload=self.cfg.workload, engine=engine, build=build, isa=isa,
                       model=Path(model_path(quant)).name, quant=quant, threads=threads, test=test,
                       n_tokens=n_tokens(test), repeats=len(tps), tps_median=round(med, 1),
                       tps_min=round(tps[0], 1), tps_max=round(tps[-1], 1), achieved="", unit="",
                       frac_peak="", frac_alt="", steal_ticks=steal,
                       steal_pct=round(100.0 * steal / max(1, total), 2), load1_start=self.load1_start)
            if threads in self.roofs:
                ach, unit, fp, fa = roofline.fractions(test, med, self.roofs[threads], *self._stats(engine, quant),
                                                       quant)
                row.update(achieved=round(ach, 1), unit=unit, frac_peak=round(fp, 3), frac_alt=round(fa, 3))
            out.append(row)
        return out

    def headline(self, rows: list[dict]) -> dict:
        by = {(r["engine"], r["quant"], r["threads"], r["test"]): r for r in rows}
        results = {}
        for (engine, quant, threads, test), r in by.items():
            if engine != "zen5":
                continue
            ratios = {}
            for peer in ALL_PEERS:
                p = by.get((peer, quant if peer not in TORCH_DTYPES else "Q4_1", threads, test))
                if p:
                    ratios[peer] = round(r["tps_median"] / p["tps_median"], 3)
            results[f"{quant}/{threads}t/{test}"] = {"zen5_tps": r["tps_median"], "frac_peak": r["frac_peak"],
                                                     "vs": ratios}
        head = {"run_id": self.run_id, "workload": self.cfg.workload, "cpu": self.cpu, "commit": self.commit,
                "isa": self.tier, "best_isa": self.best, "results_stem": self.stem,
                "load1_start": self.load1_start, "load1_during": self.load_samples,
                "steal_pct": round(self.steal_pct, 2), "results": results,
                "roofline": {str(t): {k: v for k, v in roof.items() if k.endswith(("gbps", "gops", "gflops"))}
                             for t, roof in self.roofs.items()}}
        for i, (kv, rows) in enumerate(self.frontier_rows.items()):
            first, last = rows[0], rows[-1]
            lookup = kv.endswith("+lookup")
            head["frontier" if i == 0 else "frontier_lookup" if lookup else f"frontier_kv_{kv}"] = {
                "kv_type": kv.removesuffix("+lookup"), "prompt_lookup": lookup,
                "first_ctx": first["ctx_tokens"], "last_ctx": last["ctx_tokens"],
                "gen_tps_first": first["gen_tps"], "gen_tps_last": last["gen_tps"],
                "gen_last_over_first": round(last["gen_tps"] / first["gen_tps"], 3)}
        return head

    def _write_frontier(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"{self.stem}-frontier{self.suffix}"
        for i, (kv, rows) in enumerate(self.frontier_rows.items()):
            name = "" if i == 0 else "-lookup" if kv.endswith("+lookup") else f"-kv-{kv}"
            frontier_mod.write_csv(rows, Path(f"{stem}{name}.csv"))
        frontier_mod.plot(self.frontier_rows, Path(f"{stem}.png"),
                          f"{self.frontier_engine}\n{self.cpu}, run {self.run_id}, commit {self.commit}")

    def _write(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / self.stem
        rows = self.rows()
        if rows:
            append_csv(Path(f"{stem}-bench{self.suffix}.csv"), COLUMNS, rows)
        if self.roofs:
            rcols = ("run_id", "commit", "cpu") + tuple(next(iter(self.roofs.values())))
            append_csv(Path(f"{stem}-roofline{self.suffix}.csv"), rcols,
                       [dict(run_id=self.run_id, commit=self.commit, cpu=self.cpu, **roof)
                        for roof in self.roofs.values()])
        print_table(rows, self.log)
        return self.headline(rows)


def append_csv(path: Path, columns, rows: list[dict]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as fh:
            header = next(csv.reader(fh), [])
        if tuple(header) != tuple(columns):
            if not set(header) <= set(columns):
                raise RuntimeError(f"{path} has other columns than this harness writes; move it aside")
            # an older file with fewer columns (e.g. a roofline file from before the ISA tiers):
            # rewrite it with the new header, its rows empty in the new columns
            with path.open(newline="") as fh:
                old = list(csv.DictReader(fh))
            with path.open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(columns))
                w.writeheader()
                w.writerows(old)
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns))
        if new:
            w.writeheader()
        w.writerows(rows)


def print_table(rows: list[dict], log) -> None:
    by = {(r["engine"], r["quant"], r["threads"], r["test"]): r for r in rows}
    engines = [e for e in ("zen5",) + ALL_PEERS if any(k[0] == e for k in by)]
    log("")
    log(f"{'quant':5} {'thr':>3} {'test':6} " + " ".join(f"{e:>17}" for e in engines) + "   zen5 roof")
    for (engine, quant, threads, test), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        if engine != "zen5":
            continue
        cells = []
        for e in engines:
            p = by.get((e, quant if e not in TORCH_DTYPES else "Q4_1", threads, test))
            if not p:
                cells.append(f"{'-':>17}")
            elif e == "zen5":
                cells.append(f"{p['tps_median']:>17.1f}")
            else:
                cells.append(f"{p['tps_median']:>9.1f} ({r['tps_median'] / p['tps_median']:4.2f}x)")
        roof = f"{100 * r['frac_peak']:5.1f}%" if r["frac_peak"] != "" else "    -"
        log(f"{quant:5} {threads:>3} {test:6} " + " ".join(cells) + f"   {roof}")
    log("tok/s medians; (Nx) = zen5 / peer; roof = decode GB/s over in-LLC bandwidth, "
        "prefill GOP/s over the tier's int8 peak (F32/F16/BF16: the fp32 FMA peak)")


# ---------------------------------------------------------------- command line
def _csv_list(kind):
    return lambda s: tuple(kind(x.strip()) for x in s.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags for `python -m zen5 bench`; defaults (None here) come from BenchConfig."""
    d = BenchConfig()
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 repeat, pp128 + tg128, Q4_1, no peers, 2-point frontier")
    p.add_argument("--modes", type=_csv_list(str), help=f"comma list of {','.join(MODES)} (default: all)")
    p.add_argument("--quants", type=_csv_list(str), help=f"default {','.join(d.quants)}")
    p.add_argument("--threads", type=_csv_list(int), help="default 1,2")
    p.add_argument("--prompts", type=_csv_list(int), help="prefill lengths (default 128,512,2048)")
    p.add_argument("--gen", type=int, help=f"decoded tokens per tg test (default {d.gen})")
    p.add_argument("--repeat", type=int, help=f"repetitions, median reported (default {d.repeat})")
    p.add_argument("--peers", type=_csv_list(str),
                   help=f"any of {','.join(ALL_PEERS)} built here (default: the tier's llama.cpp builds, "
                        f"and PyTorch for the best tier)")
    p.add_argument("--isa", help=f"zen5's ISA tier, one of {','.join(TIERS)} (default: the best this CPU supports)")
    p.add_argument("--frontier-step", type=int, help=f"default {d.frontier_step}")
    p.add_argument("--frontier-max", type=int, help="last frontier (default: the model's context)")
    p.add_argument("--frontier-gen", type=int, help=f"greedy tokens at each frontier (default {d.frontier_gen})")
    p.add_argument("--frontier-threads", type=int, help=f"default {d.frontier_threads}")
    p.add_argument("--frontier-repeat", type=int, help=f"default {d.frontier_repeat}")
    p.add_argument("--frontier-kv", type=_csv_list(str), help=f"KV cache types (default {','.join(d.frontier_kv)})")
    p.add_argument("--model-size", choices=tuple(SHAPES),
                   help="real model sizes instead of the modes: zen5 against llama.cpp on a 1.7B- or 8B-shaped "
                        "GGUF with random weights (bench/real_models.py; tiny: a smoke run of the code only): "
                        f"pp512, tg128, load time and memory, {real_bench_repeat()} repetitions unless --repeat")
    p.add_argument("--types", type=_csv_list(str),
                   help=f"--model-size: the weight types (default {','.join(REAL_TYPES)})")
    p.add_argument("--models-dir", help="--model-size: the model cache (default ~/.cache/zen5/bench-models)")
    p.add_argument("--deepseek-v4", action="store_true",
                   help="DeepSeek V4 Flash's real-width layers instead of the modes (bench/dsv4_bench.py): decode "
                        "and 512-token prefill per layer kind at --depths, bytes and ops against this run's roofs, "
                        "and the full model projected here and on a named Zen 5 EPYC")
    p.add_argument("--depths", type=_csv_list(int), help="--deepseek-v4: context depths (default 0,2048,8192)")
    p.add_argument("--out", help="results directory (default bench/results)")
    p.add_argument("--wait-quiet", type=float, metavar="MIN",
                   help="first wait up to MIN minutes for the 1-minute load average to drop below --quiet-load")
    p.add_argument("--quiet-load", type=float, help=f"default {d.quiet_load}")
    p.add_argument("--no-readme", action="store_true",
                   help="do not regenerate the README Performance section after a full run")


def real_bench_repeat() -> int:
    from real_bench import REAL_REPEAT
    return REAL_REPEAT


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig.quick() if a.quick else BenchConfig()
    changes = {f.name: getattr(a, f.name) for f in fields(BenchConfig)
               if getattr(a, f.name, None) is not None}
    # the tier is not a change of workload: an --isa run is "full" (its own files, see result_stem);
    # nor is the model size or where its files are cached
    if changes and not a.quick and set(changes) - {"out", "wait_quiet", "quiet_load", "isa", "model_size",
                                                   "models_dir", "deepseek_v4"}:
        changes["workload"] = "custom"
    if changes.get("model_size"):  # that mode's own workload: pp512 + tg128, REAL_REPEAT repetitions
        changes.setdefault("prompts", (512,) if not a.quick else cfg.prompts)
        changes.setdefault("repeat", real_bench_repeat() if not a.quick else cfg.repeat)
    if changes.get("deepseek_v4"):  # that mode's own workload (dsv4_bench.py)
        changes.setdefault("repeat", 3 if not a.quick else 1)
        changes.setdefault("gen", 32 if not a.quick else 4)
        changes.setdefault("depths", cfg.depths if not a.quick else (0, 128))
    return replace(cfg, **changes)


def run_cli(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731  (stdout: table + JSON)
    if cfg.deepseek_v4:
        import dsv4_bench
        head = dsv4_bench.DeepSeekV4Run(cfg, log=lambda m: print(m, flush=True)).execute()
    elif cfg.model_size:
        import real_bench
        head = real_bench.RealRun(cfg, log=lambda m: print(m, flush=True)).execute()
    else:
        head = Run(cfg, log=lambda m: print(m, flush=True)).execute()
    default_out = Path(cfg.out).resolve() == (ROOT / "bench" / "results").resolve()
    if cfg.workload == "full" and default_out and not a.no_readme:
        import report
        log(f"README Performance section regenerated from {report.update_readme()}")
    print(json.dumps(head), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zen5 bench", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
