"""`python -m zen5 bench --model-size 1.7b|8b`: zen5 against llama.cpp at real model sizes (issue 21).

The models are Llama-architecture GGUFs at real widths with random weights (bench/real_models.py,
cached outside the repository): speed does not depend on the weights' values, and the run says so.
Per type (default: Q4_0, Q4_1, Q8_0 and BF16; --types restricts) and thread count (1 and 2), each
repetition runs every engine once in a rotating order (the kernel / peers modes' interleaving),
each engine's block being:
  zen5       two fresh child processes (this file, --worker), each loading the file and evaluating
             one token: "load" is open (load_weights) to the first token's logits, Python start-up
             and imports excluded; the child then reads its own /proc/self/status: VmHWM (peak
             resident memory, during load and the first token) and VmRSS (resident after it); the
             KV cache it allocated (n_ctx x kv_bytes_per_token, n_ctx sized for the tests) is
             reported apart. The first child finds no weight cache (zen5/weight_cache.py; the
             run's own directory, emptied before each block): it packs the weights and writes the
             cache in the background (done after the first token; how long after, in the row's
             note), the "load_first" row; it then times first touching 1 GiB of fresh memory with
             as many threads as packed the arena (fresh_memory_gbps: what the arena's pages cost
             a first load, in the row's note). The
             second maps that cache, the "load" row (what every load after the first costs),
             after the cache file has been read through once, untimed, so that like the peer's
             GGUF it is in the page cache (on a machine with little more memory than twice the
             file, the first child's arena plus the file and the cache being written evicted part
             of the cache: an 8B Q8_0 cached load at 2 threads then took 1.13 s where every later
             one took 0.59-0.67 s),
             waits until the arena has moved onto huge pages (the time is in the row's note), runs
             the warm-up (pp64, tg8, not recorded) and the tests (pp512, tg128, the runner of
             workload.py). Each child exits, so no engine holds memory while another runs and one
             that fails (e.g. out of memory) costs only its own rows.
  llama.cpp  the peer build of the tier (peers.py): a load probe, `llama-bench -p 0 -n 1,16 -r 1
             --no-warmup -o jsonl`: "load" is the wall time from starting the process to its
             first result line (model load, context, one decoded token: open to first token,
             process start included: a static binary, milliseconds), and /proc/<pid>/status read
             at that moment gives VmHWM and VmRSS (the process is then busy with the 16-token
             test, so it has not begun to free anything; it is killed there). llama-bench has no
             load-time figure of its own and llama-cli is not built (build_peers.sh builds only
             llama-bench). Then the tests through llama-bench as in the peers mode, same file.
Both engines read their files from the page cache: the GGUF is read through, untimed, before
each engine's block (from commit c427490 on; before, it was assumed warm after the first block).

Decode bytes per token: the bytes the matmuls read per decoded token, the sum of the matrices'
bytes in the file (the output head once; an untied token_embd is a row lookup and not counted).
A tg row's achieved GB/s = tok/s x that, over the DRAM read bandwidth (these models do not fit
in the last-level cache, so DRAM is the roof) at the same thread count: from 2026-12-07T13:09 on,
probed (roofline.dram_read) right before and right after each repetition's decode (zen5: inside
its child, around tg128; llama.cpp: around a llama-bench process of its own for tg128, after
the pp tests' one, its warm-up the tg8 only), each repetition's GB/s over the mean of its two
probes, frac_roof the median of those fractions and "roof" the median of the means, as the
DeepSeek V4 mode does: this VM's bandwidth moved by 1.7x within seconds, so a probe minutes
away misstates the roof a decode had; the row's note gives the fraction of the run's highest
probe too. Before, and where a repetition has no probes: the highest probe of the run (at the
start, after every block of the engines' runs of a type and thread count (from 2026-12-05T23:40
on), and at the end; roofline.py, "read_dram_gbps"). A pp row's achieved GOP/s = tok/s x 2 x
matmul parameters, over the tier's int8 peak (BF16: the fp32 FMA peak), as in the kernel mode.

Output: `<stem>-real.csv` in --out (appended; columns REAL_COLUMNS; stem as the harness's), one
row per (engine, type, threads, test) with test pp512 / tg128, plus a "load" row per (engine,
type, threads) (load_s median/min/max over the repetitions, peak resident bytes during load (max)
and resident bytes after (median), the KV cache bytes) and a "failed" row for a block that did not
finish (the note says why). report.py renders them as "Real model sizes" in the README.
"""
from __future__ import annotations

import datetime
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import real_models  # noqa: E402
import roofline  # noqa: E402
from workload import WARMUP, fixed_text, n_tokens, time_test, wait_promoted  # noqa: E402

REAL_REPEAT = 3  # the default repetitions of this mode (a 8B block takes minutes)
REAL_COLUMNS = ("run_id", "date", "commit", "cpu", "workload", "engine", "build", "isa", "model_size", "model",
                "quant", "file_bytes", "weights", "threads", "test", "n_tokens", "repeats", "tps_median", "tps_min",
                "tps_max", "bytes_per_token", "achieved", "unit", "roof", "frac_roof", "load_s_median", "load_s_min",
                "load_s_max", "rss_peak_load_bytes", "rss_after_load_bytes", "kv_bytes", "steal_pct", "load1_start",
                "note")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmHWM / VmRSS (and the other Vm* lines) of /proc/<pid>/status, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Vm") and line.endswith("kB"):
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def fresh_memory_gbps(threads: int, n: int = 1 << 30) -> float:
    """GB/s of first touching n bytes of fresh anonymous memory on 4 KiB pages (as the arena is
    packed, model.cpp), by `threads` threads (the kernel zeroes each page; under a hypervisor that
    backs guest memory lazily the host allocates it too): what a first load pays for every byte of
    its arena, whatever the packing costs. numpy's strided store releases the GIL, so the threads
    fault in parallel."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    mm = mmap.mmap(-1, n)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    a = np.frombuffer(mm, np.uint8)
    part = -(-n // threads // (2 << 20)) * (2 << 20)  # a 2 MiB-aligned part per thread

    def touch(i: int) -> None:
        a[i * part:(i + 1) * part:4096] = 1

    with ThreadPoolExecutor(threads) as ex:
        t = time.perf_counter()
        list(ex.map(touch, range(threads)))
        dt = time.perf_counter() - t
    return n / dt / 1e9  # the mapping goes with its last view, a


def read_through(path: Path, chunk: int = 16 << 20) -> None:
    """Read a file once, discarding the bytes: it is then in the page cache (what memory allows)."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def matmul_stats(path: str) -> tuple[int, int]:
    """(bytes, parameters) of the matrices one decoded token multiplies by: every 2-D tensor once,
    but not token_embd when an output head exists (then it is only a row lookup)."""
    from zen5.loader.gguf import read_header

    tensors = read_header(path).tensors  # zen5's own walk: gguf.GGUFReader takes ~10 s on a 128k vocabulary
    lookup = "token_embd.weight" if "output.weight" in tensors else None
    mats = [t for t in tensors.values() if len(t.shape) == 2 and t.name != lookup]
    return sum(t.nbytes for t in mats), sum(t.shape[0] * t.shape[1] for t in mats)


def bracketed(threads: int, tier: str, run):
    """run() between two DRAM read probes (module doc): (its result, the mean of the probes)."""
    before = roofline.dram_read(threads, tier)
    out = run()
    return out, (before + roofline.dram_read(threads, tier)) / 2


# ---------------------------------------------------------------- zen5: one block in a child process
def worker(spec: dict) -> dict:
    """The child's work: load, one token (timed, memory read), then the warm-up and the tests."""
    import numpy as np

    from zen5.engine import Engine
    from zen5.loader import load_weights

    base = proc_status()
    t0 = time.perf_counter()
    weights = load_weights(spec["path"])
    t1 = time.perf_counter()
    eng = Engine(weights, threads=spec["threads"], n_ctx=spec["n_ctx"], isa=spec["isa"] or None,
                 weight_cache=spec.get("weight_cache"))
    t2 = time.perf_counter()
    eng.native_ctx.eval([0])
    logits = np.asarray(eng.native_ctx.logits())
    t3 = time.perf_counter()
    st = proc_status()
    finite = bool(np.isfinite(logits).all())
    eng.native_ctx.rewind(0)
    out = dict(load_s=t3 - t0, weights_s=t1 - t0, engine_s=t2 - t1, first_token_s=t3 - t2,
               rss_base=base.get("VmRSS", 0), rss_peak=st.get("VmHWM", 0), rss_after=st.get("VmRSS", 0),
               kv_bytes=int(eng.native_ctx.kv_bytes_per_token) * eng.n_ctx, finite=finite,
               build=f"matmul={eng.matmul}", isa=eng.isa, secs={}, cache=eng.weight_cache["status"])
    if out["cache"] == "writing":  # the first load: the cache file is written in the background
        eng.native.finish_weight_cache()
        out.update(cache_write_s=time.perf_counter() - t3, cache=eng.weight_cache["status"])
    wait_promoted(eng)  # the arena's move onto huge pages (packed or mapped), before any timing or probe
    out["promote_s"] = time.perf_counter() - t3
    if not spec["tests"]:  # the first load's child
        from zen5.engine import default_threads  # the threads that packed the arena (load_threads)

        load_threads = max(spec["threads"], default_threads())
        out.update(arena_bytes=int(eng.native.weight_bytes), load_threads=load_threads,
                   fresh_gbps=fresh_memory_gbps(load_threads))
    if spec["tests"]:
        tokens = eng.tokenizer.encode(fixed_text())
        eos = sorted(eng.tokenizer.eos_ids)
        need = max(n_tokens(t) for t in list(WARMUP) + spec["tests"] if t.startswith("pp"))
        if len(tokens) < need:
            raise RuntimeError(f"the fixed text has {len(tokens)} tokens, the tests need {need}")
        probe = spec.get("probe_tier")
        for test in list(WARMUP) + list(spec["tests"]):
            if probe and test in spec["tests"] and test.startswith("tg"):  # the roof of its own moment
                out["secs"][test], out.setdefault("tg_roofs", {})[test] = bracketed(
                    spec["threads"], probe, lambda: time_test(eng.native_ctx, tokens, test, eos))
            else:
                out["secs"][test] = time_test(eng.native_ctx, tokens, test, eos)
        out["secs"] = {t: out["secs"][t] for t in spec["tests"]}
    return out


class Zen5Block:
    name = "zen5"

    def __init__(self, isa: str, n_ctx: int, cache_dir: str):
        self.isa, self.n_ctx, self.cache_dir = isa, n_ctx, cache_dir

    def block(self, path: str, threads: int, tests: list[str], probe_tier: str = "") -> dict:
        """The first load (no cache: packs, writes it), then a load from the cache and the tests."""
        for f in Path(self.cache_dir).iterdir():
            f.unlink()
        first = self.child(path, threads, [])
        for f in Path(self.cache_dir).iterdir():  # into the page cache, as the peer's file is (module doc)
            read_through(f)
        res = self.child(path, threads, tests, probe_tier)
        if first["cache"] != "written" or res["cache"] != "hit":
            raise RuntimeError(f"weight cache: first load {first['cache']!r}, second {res['cache']!r}")
        res["first"] = first
        return res

    def child(self, path: str, threads: int, tests: list[str], probe_tier: str = "") -> dict:
        spec = dict(path=path, threads=threads, tests=tests, isa=self.isa, n_ctx=self.n_ctx,
                    weight_cache=self.cache_dir, probe_tier=probe_tier)
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                              capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            raise RuntimeError(f"zen5 child failed ({why}{', killed: out of memory?' if proc.returncode == -9 else ''})"
                               f": {proc.stderr.strip()[-600:]}")
        res = json.loads(lines[-1])
        if not res["finite"]:
            raise RuntimeError("zen5 produced NaN/inf logits")
        return res


# ---------------------------------------------------------------- llama.cpp: load probe + llama-bench
class LlamaBlock:
    def __init__(self, bench):  # a peers.LlamaBench
        self.bench, self.name = bench, bench.name

    def probe(self, path: str, threads: int, timeout: float = 1800) -> dict:
        """Open to first token and resident memory of `llama-bench -p 0 -n 1,16` (module doc)."""
        cmd = [str(self.bench.exe), "-m", path, "-t", str(threads), "-r", "1", "--no-warmup", "-o", "jsonl",
               "-p", "0", "-n", "1,16"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            deadline = t0 + timeout
            line, st = "", {}
            while time.perf_counter() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    line = proc.stdout.readline()
                    t1 = time.perf_counter()
                    if not line or '"n_gen"' in line:
                        break
            if line:
                try:
                    st = proc_status(proc.pid)
                except OSError:
                    st = {}
        finally:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = status
        if not line:
            raise RuntimeError(f"{self.name} load probe gave no result: {' '.join(cmd)}")
        peak = st.get("VmHWM") or usage.ru_maxrss * 1024
        return dict(load_s=t1 - t0, rss_peak=peak, rss_after=st.get("VmRSS", 0), kv_bytes="",
                    first_token_s=json.loads(line)["avg_ns"] / 1e9)

    def block(self, path: str, threads: int, tests: list[str], probe_tier: str = "") -> dict:
        res = self.probe(path, threads)
        pp, tg = [t for t in tests if not t.startswith("tg")], [t for t in tests if t.startswith("tg")]
        res["secs"] = self.bench.run("", threads, [], pp, model=path) if pp else {}
        for test in tg:  # its own llama-bench process, so that DRAM probes bracket it (module doc)
            def run(test=test):
                return self.bench.run("", threads, [], [test], model=path,
                                      warmup=tuple(w for w in WARMUP if w.startswith("tg")))[test]
            if probe_tier:
                res["secs"][test], res.setdefault("tg_roofs", {})[test] = bracketed(threads, probe_tier, run)
            else:
                res["secs"][test] = run()
        res["build"], res["isa"] = self.bench.describe("", threads)
        return res


# ---------------------------------------------------------------- the run
class RealRun:
    def __init__(self, cfg, log=print):
        from harness import Run  # the harness's machine / tier / peers resolution

        self.cfg, self.log = cfg, log
        base = Run(cfg, log)
        self.cpu, self.commit, self.tier, self.best, self.stem = base.cpu, base.commit, base.tier, base.best, base.stem
        from peers import LLAMA_PEERS

        dropped = [p for p in base.peers if p not in LLAMA_PEERS]
        if dropped and cfg.peers is not None:
            log(f"real model sizes: only llama.cpp peers run here; {', '.join(dropped)} left out")
        self.peers = tuple(p for p in base.peers if p in LLAMA_PEERS)
        self.shape = real_models.SHAPES[cfg.model_size]
        self.types = tuple(cfg.types or real_models.TYPES)
        self.suffix = "-quick" if cfg.workload == "quick" else ""
        self.out = Path(cfg.out)
        self.samples: dict[tuple, list[float]] = {}   # (engine, quant, threads, test) -> seconds
        self.loads: dict[tuple, list[dict]] = {}      # (engine, quant, threads) -> probe results
        self.describe: dict[tuple, tuple[str, str]] = {}
        self.failed: dict[tuple, str] = {}            # (engine, quant, threads) -> why
        self.roofs: dict[int, dict] = {}
        self.dram_probes: dict[int, list[float]] = {}  # threads -> the probes between blocks
        self.tg_roofs: dict[tuple, list[float]] = {}   # as samples: each decode's bracketing probes' mean
        self.files: dict[str, str] = {}

    def tests(self) -> list[str]:
        return [f"pp{n}" for n in self.cfg.prompts] + [f"tg{self.cfg.gen}"]

    def execute(self) -> dict:
        import harness

        cfg = self.cfg
        self.log(f"real model sizes: {self.shape.name} ({self.shape.n_params() / 1e9:.2f} G parameters), "
                 f"{', '.join(self.types)}; {real_models.SPEED_NOTE}")
        for q in self.types:  # write / find the files before timing anything
            self.files[q] = str(real_models.ensure(self.shape, q, cfg.models_dir or None, log=self.log))
        self.load1_start = harness.load1()
        if cfg.wait_quiet > 0:
            self.load1_start = harness.wait_until_quiet(cfg.wait_quiet, cfg.quiet_load, self.log)
        self.run_id = datetime.datetime.now().isoformat(timespec="seconds")
        steal0 = harness.cpu_ticks()
        if self.tier != "ref":
            for t in cfg.threads:
                with harness.pinned(t):
                    self.roofs[t] = roofline.measure(t, self.tier)
                self.log(f"roofline {t}t: DRAM read {self.roofs[t]['read_dram_gbps']:.1f} GB/s")
        n_ctx = max(max(cfg.prompts), cfg.gen + 1, 64 + 1)
        cache_dir = tempfile.mkdtemp(prefix="zen5-bench-arena-")  # removed at the end: arenas are GBs
        try:
            self._repetitions(cfg, n_ctx, cache_dir)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
        if self.tier != "ref":
            # probed again after the work, the higher of each figure kept (roofline.best_of, as the
            # other modes): a start probe of 25.1 GB/s at 2 threads, where the same VM read 36.8
            # an hour earlier, put an 8B decode at 118% of its "roof"
            for t in cfg.threads:
                with harness.pinned(t):
                    self.roofs[t] = roofline.best_of(self.roofs[t], roofline.measure(t, self.tier))
                probes = self.dram_probes.get(t, [])
                self.log(f"roofline {t}t, best of the probes before, after and between the blocks "
                         f"({', '.join(f'{g:.1f}' for g in probes) or 'none between'}): DRAM read "
                         f"{self.roofs[t]['read_dram_gbps']:.1f} GB/s")
        steal1 = harness.cpu_ticks()
        self.steal_pct = 100.0 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
        return self._write()

    def _repetitions(self, cfg, n_ctx: int, cache_dir: str) -> None:
        import harness
        from peers import LlamaBench

        engines = [Zen5Block(self.tier, n_ctx, cache_dir)] + [LlamaBlock(LlamaBench(p)) for p in self.peers]
        self.log(f"zen5 ISA tier {self.tier} (best here: {self.best}); peers: {', '.join(self.peers) or 'none'}")
        tests = self.tests()
        for rep in range(cfg.repeat):
            t_rep = time.time()
            for q in self.types:
                size = os.path.getsize(self.files[q])
                for threads in cfg.threads:
                    with harness.pinned(threads):  # every engine's 1-thread block, and its probe, on one CPU
                        self._block(engines, rep, q, threads, size, tests)
            self.log(f"repetition {rep + 1}/{cfg.repeat} done in {time.time() - t_rep:.0f} s "
                     f"(load {harness.load1():.2f})")

    def _block(self, engines: list, rep: int, q: str, threads: int, size: int, tests: list[str]) -> None:
        """Each engine once on type q at `threads` (in an order rotated per repetition), then a
        DRAM probe."""
        k = rep % len(engines)
        for eng in engines[k:] + engines[:k]:
            key = (eng.name, q, threads)
            if key in self.failed:
                continue
            if size > 0.9 * mem_available():
                self.failed[key] = (f"the {size / 1e9:.1f} GB file does not fit in the "
                                    f"{mem_available() / 1e9:.1f} GB of available memory")
                self.log(f"{eng.name} {q} {threads}t: skipped: {self.failed[key]}")
                continue
            try:
                # every engine loads the GGUF from the page cache: on a machine with little more
                # memory than twice an 8B Q8_0 file the blocks before evict it, and a zen5 first
                # load that found it on disk took 33.8 s (its arena's fresh memory: 8.6 s) while
                # llama.cpp right after it loaded the now cached file in 9.6 s (2026-12-06)
                read_through(Path(self.files[q]))
                res = eng.block(self.files[q], threads, tests, self.tier if threads in self.roofs else "")
            except Exception as e:  # one engine's failure costs only its own rows
                self.failed[key] = str(e).replace("\n", " ")[:300]
                self.log(f"{eng.name} {q} {threads}t failed: {self.failed[key]}")
                continue
            self.describe.setdefault(key, (res["build"], res["isa"]))
            self.loads.setdefault(key, []).append(res)
            for test, dt in res["secs"].items():
                self.samples.setdefault(key + (test,), []).append(dt)
                if test in res.get("tg_roofs", {}):
                    self.tg_roofs.setdefault(key + (test,), []).append(res["tg_roofs"][test])
            if "first" in res:
                f = res["first"]
                self.log(f"{eng.name} {q} {threads}t: first load {f['load_s']:.2f} s, peak RSS "
                         f"{f['rss_peak'] / 1e9:.2f} GB; cached load, arena on huge pages after "
                         f"{res['promote_s']:.2f} s more")
            self.log(f"{eng.name} {q} {threads}t: load {res['load_s']:.2f} s, peak RSS "
                     f"{res['rss_peak'] / 1e9:.2f} GB, after {res['rss_after'] / 1e9:.2f} GB; "
                     + ", ".join(f"{t} {n_tokens(t) / s:.1f} tok/s" for t, s in res["secs"].items()))
        self._probe_dram(threads)

    def _probe_dram(self, threads: int) -> None:
        """The DRAM read roof probed again right after every block of decodes: this VM's memory
        bandwidth moves within minutes, and probes only at the start and the end of a run (both
        15.6 / 29.0 GB/s at 1 / 2 threads, in a run whose 1.7B Q8_0 decode read 29.6 GB/s at 2)
        put decode above its "roof". The roof is the highest read of the run (roofline.best_of)."""
        if threads not in self.roofs:
            return
        gbps = roofline.dram_read(threads, self.tier)
        self.dram_probes.setdefault(threads, []).append(gbps)
        self.roofs[threads]["read_dram_gbps"] = max(self.roofs[threads]["read_dram_gbps"], gbps)

    # ------------------------------------------------------------ results
    def rows(self) -> list[dict]:
        date = datetime.datetime.now().isoformat(timespec="seconds")
        stats = {q: matmul_stats(p) for q, p in self.files.items()}
        blank = {c: "" for c in REAL_COLUMNS}

        def base(engine, q, threads, test):
            build, isa = self.describe.get((engine, q, threads), ("", ""))
            return dict(blank, run_id=self.run_id, date=date, commit=self.commit, cpu=self.cpu,
                        workload=self.cfg.workload, engine=engine, build=build, isa=isa,
                        model_size=self.shape.name, model=Path(self.files[q]).name, quant=q,
                        file_bytes=os.path.getsize(self.files[q]), weights="random", threads=threads, test=test,
                        steal_pct=round(self.steal_pct, 2), load1_start=self.load1_start)

        out = []
        for (engine, q, threads, test), secs in self.samples.items():
            tps = sorted(n_tokens(test) / s for s in secs)
            med = statistics.median(tps)
            row = dict(base(engine, q, threads, test), n_tokens=n_tokens(test), repeats=len(tps),
                       tps_median=round(med, 2), tps_min=round(tps[0], 2), tps_max=round(tps[-1], 2),
                       bytes_per_token=stats[q][0])
            if threads in self.roofs:
                roof = self.roofs[threads]
                ach, unit, frac, _ = roofline.fractions(test, med, roof, stats[q][0], 2.0 * stats[q][1], q)
                bracketed = self.tg_roofs.get((engine, q, threads, test), [])
                if test.startswith("tg") and len(bracketed) == len(secs):
                    # each decode over the DRAM read probed right before and after it, the
                    # median of those fractions; over the run's highest probe in the note
                    peak = statistics.median(bracketed)
                    frac = statistics.median(n_tokens(test) / s * stats[q][0] / 1e9 / g
                                             for s, g in zip(secs, bracketed))
                    row["note"] = (f"roof: the DRAM read probed right before and after each decode (means "
                                   f"{', '.join(f'{g:.1f}' for g in bracketed)} GB/s); over the run's highest "
                                   f"probe ({roof['read_dram_gbps']:.1f} GB/s): {ach / roof['read_dram_gbps']:.1%}")
                elif test.startswith("tg"):  # these models stream from DRAM: the DRAM read roof
                    peak, frac = roof["read_dram_gbps"], ach / roof["read_dram_gbps"]
                else:
                    peak = roof["fma_fp32_gflops"] if q in roofline.FLOAT_QUANTS else roofline.int8_peak(roof)
                row.update(achieved=round(ach, 2), unit=unit, roof=round(peak, 1), frac_roof=round(frac, 3))
            out.append(row)
        def load_row(engine, q, threads, test, res, note):
            load = sorted(r["load_s"] for r in res)
            return dict(base(engine, q, threads, test), repeats=len(res),
                        load_s_median=round(statistics.median(load), 3), load_s_min=round(load[0], 3),
                        load_s_max=round(load[-1], 3), rss_peak_load_bytes=max(r["rss_peak"] for r in res),
                        rss_after_load_bytes=int(statistics.median(r["rss_after"] for r in res)),
                        kv_bytes=res[0]["kv_bytes"], note=note)

        for (engine, q, threads), res in self.loads.items():
            note = _split(res)
            if "first" in res[0]:  # zen5: the cached load, and the first one (packs, writes the cache)
                note += (f"; from the weight cache, on huge pages after "
                         f"{statistics.median(r['promote_s'] for r in res):.2f} s more")
                first = [r["first"] for r in res]
                writes = [r.get("cache_write_s", 0.0) for r in first]
                fresh = statistics.median(r.get("fresh_gbps", 0.0) for r in first)
                floor = (f"; first touching the {first[0]['arena_bytes'] / 1e9:.2f} GB arena alone: "
                         f"{first[0]['arena_bytes'] / 1e9 / fresh:.2f} s at the {fresh:.2f} GB/s a fresh-memory "
                         f"probe ({first[0]['load_threads']} threads, as many as packed the arena) measured in "
                         "the same process after the load" if fresh and first[0].get("arena_bytes") else "")
                moved = statistics.median(r.get("promote_s", 0.0) for r in first)
                out.append(load_row(engine, q, threads, "load_first", first,
                                    _split(first) + "; no weight cache: packs the weights (on 4 KiB pages), then "
                                    "writes the cache in the background, done "
                                    f"{statistics.median(writes):.2f} s after the first token, and moves the arena "
                                    f"onto huge pages, done {moved:.2f} s after it" + floor))
            out.append(load_row(engine, q, threads, "load", res, note))
        for (engine, q, threads), why in self.failed.items():
            out.append(dict(base(engine, q, threads, "failed"), note=why))
        return out

    def headline(self, rows: list[dict]) -> dict:
        by = {(r["engine"], r["quant"], int(r["threads"]), r["test"]): r for r in rows}
        results = {}
        for (engine, q, threads, test), r in sorted(by.items(), key=lambda kv: str(kv[0])):
            if engine != "zen5" or test in ("failed", "load_first"):
                continue
            entry = {}
            for peer in self.peers:
                p = by.get((peer, q, threads, test))
                if p and test == "load":
                    entry[peer] = {"load_s": p["load_s_median"], "rss_peak": p["rss_peak_load_bytes"],
                                   "rss_after": p["rss_after_load_bytes"]}
                elif p:
                    entry[peer] = round(r["tps_median"] / p["tps_median"], 3)
            if test == "load":
                first = by.get((engine, q, threads, "load_first"))
                extra = {"first_load_s": first["load_s_median"], "first_rss_peak": first["rss_peak_load_bytes"]} \
                    if first else {}
                results[f"{q}/{threads}t/load"] = {"load_s": r["load_s_median"], "rss_peak": r["rss_peak_load_bytes"],
                                                   "rss_after": r["rss_after_load_bytes"], "kv_bytes": r["kv_bytes"],
                                                   **extra, "vs": entry}
            else:
                results[f"{q}/{threads}t/{test}"] = {"zen5_tps": r["tps_median"], "frac_roof": r["frac_roof"],
                                                     "vs": entry}
        return {"run_id": self.run_id, "workload": self.cfg.workload, "cpu": self.cpu, "commit": self.commit,
                "isa": self.tier, "model_size": self.shape.name, "weights": real_models.SPEED_NOTE,
                "results_file": f"{self.stem}-real{self.suffix}.csv", "load1_start": self.load1_start,
                "steal_pct": round(self.steal_pct, 2), "results": results,
                "failed": {f"{e}/{q}/{t}t": why for (e, q, t), why in self.failed.items()}}

    def _write(self) -> dict:
        import harness

        rows = self.rows()
        self.out.mkdir(parents=True, exist_ok=True)
        if rows:
            harness.append_csv(self.out / f"{self.stem}-real{self.suffix}.csv", REAL_COLUMNS, rows)
        print_table(rows, self.log)
        return self.headline(rows)


def _split(res: list[dict]) -> str:
    """zen5's load in parts (medians): load_weights (file, tokenizer), Engine (native model, KV
    cache), the first token; empty for a peer."""
    if "weights_s" not in res[0]:
        return ""
    med = {k: statistics.median(r[k] for r in res) for k in ("weights_s", "engine_s", "first_token_s")}
    return (f"load_weights {med['weights_s']:.2f} s, Engine {med['engine_s']:.2f} s, "
            f"first token {med['first_token_s']:.2f} s")


def _gb(x) -> str:
    return f"{float(x) / 1e9:.2f} GB" if x not in ("", None) else "-"


def print_table(rows: list[dict], log) -> None:
    by = {(r["engine"], r["quant"], int(r["threads"]), r["test"]): r for r in rows}
    peers = sorted({r["engine"] for r in rows if r["engine"] != "zen5"})
    log("")
    log(f"{'type':5} {'thr':>3} {'test':6} {'zen5':>10} " + " ".join(f"{p:>26}" for p in peers) + "   zen5 roof")
    for (engine, q, threads, test), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        if engine != "zen5" or test in ("load", "load_first", "failed"):
            continue
        cells = []
        for p in peers:
            o = by.get((p, q, threads, test))
            cells.append(f"{o['tps_median']:>17.2f} ({r['tps_median'] / o['tps_median']:4.2f}x)" if o
                         else f"{'-':>26}")
        roof = f"{100 * r['frac_roof']:5.1f}%" if r["frac_roof"] != "" else "    -"
        log(f"{q:5} {threads:>3} {test:6} {r['tps_median']:>10.2f} " + " ".join(cells) + f"   {roof}")
    log("tok/s medians; (Nx) = zen5 / peer; roof: decode GB/s (tok/s x matrix bytes per token) over the DRAM "
        "read roof, prefill GOP/s over the tier's int8 peak (BF16: fp32 FMA)")
    log(f"{'type':5} {'thr':>3} {'engine':17} {'load s':>8} {'peak RSS':>10} {'RSS after':>10} {'KV cache':>10} "
        f"{'file':>9}")
    for (engine, q, threads, test), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0],
                                                                             kv[0][3] == "load")):
        if test.startswith("load"):
            name = engine + (" first" if test == "load_first" else "")
            log(f"{q:5} {threads:>3} {name:17} {r['load_s_median']:>8.2f} {_gb(r['rss_peak_load_bytes']):>10} "
                f"{_gb(r['rss_after_load_bytes']):>10} {_gb(r['kv_bytes']):>10} {_gb(r['file_bytes']):>9}")
        elif test == "failed":
            log(f"{q:5} {threads:>3} {engine:17} failed: {r['note']}")
    log(f"Models: {real_models.SPEED_NOTE} (bench/real_models.py).")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    sys.exit("usage: python -m zen5 bench --model-size 1.7b|8b (this file's --worker is the zen5 child)")
