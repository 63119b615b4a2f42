"""Render the README's Performance section from bench/results (numbers are never typed by hand).

Reads each CPU's latest full run (workload "full", highest run_id) from
`bench/results/<cpu>-bench.csv`, newest first (an AVX-512 and an AVX2-only machine each get a
table), the roofs measured in that run from `<cpu>-roofline.csv`, and the frontier walk from
`<cpu>-frontier.csv` (plus `<cpu>-frontier-kv-<type>.csv`, the other KV cache types of the
same walk); then one more table per run of a forced lower ISA tier, `<cpu>-<tier>-bench.csv`
(`python -m zen5 bench --isa avx2`: its latest full or custom run, with its own roofs and
peers), and replaces everything between `<!-- bench:start -->` and
`<!-- bench:end -->` in README.md. Last, "Real model sizes" from `<stem>-real.csv` (`python -m
zen5 bench --model-size 1.7b|8b`, bench/real_bench.py): per file, model size and weight type the
latest full or custom run (the sizes and types may come from separate runs), a speed table and a
load / memory table. Then DeepSeek V4 Flash's projection, `<stem>-dsv4-projection.md` as written
by `python -m zen5 bench --deepseek-v4` (bench/dsv4_bench.py). `python -m zen5 bench` calls it after a full run into
bench/results; run it by hand after editing this file:
    python bench/report.py [--results DIR] [--readme README.md] [--print]
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
PEERS = (("llama.cpp-native", "llama.cpp native"), ("llama.cpp-avx512", "llama.cpp AVX-512"),
         ("llama.cpp-amx", "llama.cpp AMX"), ("llama.cpp-avx2vnni", "llama.cpp AVX2 + AVX-VNNI"),
         ("llama.cpp-avx2", "llama.cpp AVX2"),
         ("torch-fp32", "PyTorch fp32"), ("torch-bf16", "PyTorch bf16"))
QUANT_ORDER = {"Q4_0": -1, "Q4_1": 0, "Q8_0": 1, "BF16": 2}
SIZE_ORDER = {"1.7b": 0, "8b": 1}
SIZE_NAMES = {"1.7b": "1.7B (SmolLM2-1.7B shape)", "8b": "8B (Llama-3-8B shape)"}
TIERS = ("ref", "avx2", "avx2vnni", "avx512", "amx")  # zen5's ISA tiers (bench/peers.py)
NOISY = 2.0  # a forced-tier row whose max / min tok/s exceeds this is called out as noisy
ISA_NAMES = {"amx": "AMX (AVX-512 + AMX int8 prefill)", "avx512": "AVX-512",
             "avx2": "AVX2", "avx2vnni": "AVX2 + AVX-VNNI", "ref": "reference (scalar)"}


def split_stem(path: Path) -> tuple[str, str]:
    """(cpu, tier) of a `<cpu>-bench.csv` ("" tier: the CPU's best) or `<cpu>-<tier>-bench.csv`."""
    stem = path.name[:-len("-bench.csv")]
    cpu, _, tier = stem.rpartition("-")
    return (cpu, tier) if cpu and tier in TIERS else (stem, "")


def _read(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def latest_runs(results: Path) -> list[tuple[Path, list[dict]]]:
    """Per CPU (`<cpu>-bench.csv`, its best tier; not the forced-tier files) its latest full run,
    the newest first: an AVX-512 machine's table and an AVX2-only machine's stand side by side."""
    runs = []
    for path in sorted(results.glob("*-bench.csv")):
        if split_stem(path)[1]:
            continue
        rows = [r for r in _read(path) if r["workload"] == "full"]
        if rows:
            run_id = max(r["run_id"] for r in rows)
            runs.append((run_id, path, [r for r in rows if r["run_id"] == run_id]))
    if not runs:
        raise FileNotFoundError(f"no full benchmark run in {results}/*-bench.csv: run `python -m zen5 bench`")
    return [(path, rows) for _, path, rows in sorted(runs, key=lambda t: t[0], reverse=True)]


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def tier_runs(results: Path) -> list[tuple[Path, list[dict]]]:
    """Per `<cpu>-<tier>-bench.csv` (a forced lower tier), its latest full or custom run."""
    out = []
    for path in sorted(results.glob("*-bench.csv")):
        if not split_stem(path)[1]:
            continue
        rows = [r for r in _read(path) if r["workload"] in ("full", "custom")]
        if rows:
            run_id = max(r["run_id"] for r in rows)
            out.append((path, [r for r in rows if r["run_id"] == run_id]))
    return out


def _peers(rows: list[dict]) -> list[tuple[str, str]]:
    """(engine, column label) of the peers in a run; the native build's label says its ISA."""
    out = []
    for key, label in PEERS:
        mine = [r for r in rows if r["engine"] == key]
        if mine:
            if key == "llama.cpp-native":
                label += f" ({ISA_NAMES.get(mine[0]['isa'], mine[0]['isa'])})"
            out.append((key, label))
    return out


def _table(rows: list[dict], peers: list[tuple[str, str]]) -> list[str]:
    by = {(r["engine"], r["quant"], r["threads"], r["test"]): r for r in rows}
    zen = sorted((r for r in rows if r["engine"] == "zen5"),
                 key=lambda r: (QUANT_ORDER.get(r["quant"], 9), int(r["threads"]), r["test"][:2] == "tg",
                                int(r["n_tokens"])))
    out = ["| weights | threads | test | zen5 | " + " | ".join(label for _, label in peers) + " | zen5 of roof |",
           "|---|---:|---|---:|" + "---:|" * len(peers) + "---:|"]
    for r in zen:
        z = float(r["tps_median"])
        found = [by.get((key, "Q4_1" if key.startswith("torch") else r["quant"], r["threads"], r["test"]))
                 for key, _ in peers]
        best = max([z] + [float(p["tps_median"]) for p in found if p])
        bold = lambda v, text: f"**{text}**" if v == best else text  # noqa: E731  the row's fastest
        cells = [bold(float(p["tps_median"]), f"{_fmt(float(p['tps_median']))} ({z / float(p['tps_median']):.2f}x)")
                 if p else "-" for p in found]
        roof = f"{100 * float(r['frac_peak']):.0f}%" if r["frac_peak"] else "-"
        out.append(f"| {r['quant']} | {r['threads']} | {r['test']} | {bold(z, _fmt(z))} | " + " | ".join(cells)
                   + f" | {roof} |")
    return out


def _int8_name(roof: dict | None) -> str:
    """How the prose names a roofline row's int8 peak: "int8 VNNI" (vpdpbusd, and rows from
    before the tiers), or the AVX2 sequence."""
    insn = (roof or {}).get("int8_insn") or "vpdpbusd"
    if insn.startswith("tdpbssd"):
        return "int8 AMX (tdpbssd on full tiles)"
    return "int8 VNNI" if insn.startswith("vpdpbusd") else f"int8 {insn.split()[0]}"


def _roof_text(r: dict) -> str:
    text = (f"{r['threads']} thread(s): read {float(r['read_llc_gbps']):.1f} GB/s in LLC, "
            f"{float(r['read_dram_gbps']):.1f} GB/s from DRAM, ")
    if r.get("maddubs_i16_gops"):
        text += (f"int8 vpmaddubsw+vpaddw (int16 sums, the Q4 inner loop; the roof above) "
                 f"{float(r['maddubs_i16_gops']):,.0f} GOP/s, vpmaddubsw+vpmaddwd+vpaddd (to int32) "
                 f"{float(r['maddubs_i32_gops']):,.0f} GOP/s, ")
    elif r.get("amx_int8_gops"):
        text += (f"int8 AMX tdpbssd (the roof above) {float(r['amx_int8_gops']):,.0f} GOP/s, int8 VNNI "
                 f"{float(r['vnni_int8_gops']):,.0f} GOP/s, ")
    else:
        text += f"int8 VNNI {float(r.get('vnni_int8_gops') or r['int8_gops']):,.0f} GOP/s, "
    fma = f" ({r['fma_insn'].split()[-1]})" if r.get("fma_insn", "").endswith("ymm") else ""
    return text + f"fp32 FMA{fma} {float(r['fma_fp32_gflops']):,.0f} GFLOP/s"


def _roofs(results: Path, stem: str, run_id: str) -> list[dict]:
    roof_path = results / f"{stem}-roofline.csv"
    return [r for r in _read(roof_path) if r["run_id"] == run_id] if roof_path.exists() else []


def _dsv4_order(path: Path) -> tuple[str, str]:
    """Per CPU, the best tier's projection first, then the forced tiers'."""
    return split_stem(Path(path.name.replace("-dsv4-projection.md", "-bench.csv")))


def render_dsv4(path: Path) -> str:
    """A `<stem>-dsv4-projection.md` (written by `python -m zen5 bench --deepseek-v4`), its title
    a subsection here."""
    text = path.read_text().strip()
    # the tier it ran on, from the run's rows in the CSV beside it (a forced one's file is
    # `<cpu>-<tier>-dsv4-projection.md`, beside the best tier's)
    stem = path.name[:-len("-projection.md")]
    _, forced = split_stem(Path(stem[:-len("-dsv4")] + "-bench.csv"))
    run = re.match(r"# .*\(run (\S+),", text)
    csv_path = path.with_name(stem + ".csv")
    isa = next((r["isa"] for r in (_read(csv_path) if run and csv_path.exists() else [])
                if r["run_id"] == run[1] and r["engine"] == "zen5"), "")
    if isa:
        title, _, rest = text.partition("\n")
        text = (f"{title[:-1]}, {ISA_NAMES.get(isa, isa)} tier"
                + (f", forced: `--isa {forced}`" if forced else "") + f")\n{rest}")
    return "### " + text[2:] if text.startswith("# ") else text


def render(results: Path) -> str:
    tiers = tier_runs(results)
    real = [render_real(p, r) for p, r in real_runs(results)]
    real += [render_dsv4(p) for p in sorted(results.glob("*-dsv4-projection.md"), key=_dsv4_order)]
    try:
        best = [render_best(results, p, r) for p, r in latest_runs(results)]
    except FileNotFoundError:
        if not tiers and not real:
            raise
        best = []
    return "\n\n".join(best + [render_tier(results, p, r) for p, r in tiers] + real)


# ---------------------------------------------------------------- real model sizes
def real_runs(results: Path) -> list[tuple[Path, list[dict]]]:
    """Per `<stem>-real.csv`: for each (model size, weight type, threads) the rows of its latest
    full or custom run (the smoke shape "tiny" and quick runs never render): a run restricted to
    some thread counts (`--threads 2`) replaces only those rows."""
    out = []
    for path in sorted(results.glob("*-real.csv")):
        rows = [r for r in _read(path) if r["workload"] in ("full", "custom") and r["model_size"] in SIZE_ORDER]
        latest: dict[tuple, str] = {}
        for r in rows:
            k = (r["model_size"], r["quant"], r["threads"])
            latest[k] = max(latest.get(k, ""), r["run_id"])
        keep = [r for r in rows if r["run_id"] == latest[(r["model_size"], r["quant"], r["threads"])]]
        if keep:
            out.append((path, keep))
    return out


def _real_key(r: dict) -> tuple:
    return (SIZE_ORDER.get(r["model_size"], 9), QUANT_ORDER.get(r["quant"], 9), int(r["threads"]),
            r["test"][:2] == "tg", int(r["n_tokens"] or 0))


def _gb(x: str) -> str:
    return f"{float(x) / 1e9:.2f} GB" if x else "-"


def _run_roofs(rows: list[dict], run_id: str) -> str:
    """A run's roofs as its rows used them, per thread count: the DRAM read bandwidth (decode rows)
    and the int8 peak (quantized prefill rows). They move from run to run on a shared VM, and a
    row's "of roof" moves with them."""
    mine = [r for r in rows if r["run_id"] == run_id and r["engine"] == "zen5" and r["roof"]]
    dram = {r["threads"]: float(r["roof"]) for r in mine if r["test"].startswith("tg")}
    int8 = {r["threads"]: float(r["roof"]) for r in mine if r["test"].startswith("pp") and r["quant"] != "BF16"}
    th = sorted(set(dram) | set(int8), key=int)
    parts = [f"{what} {'/'.join(f'{d[t]:.0f}' if t in d else '-' for t in th)} {unit}"
             for what, d, unit in (("DRAM read", dram, "GB/s"), ("int8 peak", int8, "GOP/s")) if d]
    return f"; roofs at {'/'.join(th)} threads: {', '.join(parts)}" if parts else ""


def render_real(path: Path, rows: list[dict]) -> str:
    stem = path.name[:-len("-real.csv")]
    cpu, tier = split_stem(Path(f"{stem}-bench.csv"))
    peers = _peers(rows)
    label = dict(peers, zen5="zen5")
    speed = [r for r in rows if r["test"] not in ("load", "load_first", "failed")]
    by = {(r["engine"], r["model_size"], r["quant"], r["threads"], r["test"]): r for r in rows}
    runs = sorted({(r["run_id"], r["commit"], r["isa"], r["load1_start"]) for r in rows if r["engine"] == "zen5"})
    isas = {isa for _, _, isa, _ in runs}
    reps = sorted({r["repeats"] for r in speed})
    steal = statistics.mean(float(r["steal_pct"]) for r in rows)
    out = ["### Real model sizes", "",
           f"Generated from `bench/results/{path.name}` (`python -m zen5 bench --model-size 1.7b|8b`, "
           f"bench/real_bench.py): Llama-architecture GGUFs at real widths with **random weights** "
           f"(bench/real_models.py; speed does not depend on the weights' values), zen5 against "
           f"{', '.join(lbl for _, lbl in peers) or 'no peer'} on the same file, interleaved; {cpu.replace('_', ' ')}, "
           + (f"zen5's {ISA_NAMES.get(tier or (runs[0][2] if runs else ''), tier)} tier; " if len(isas) < 2 else
              "zen5's tier per run (a row comes from the latest run of its model, weights and threads); ")
           + "; ".join(f"run {rid} (commit `{c}`, " + (f"{ISA_NAMES.get(isa, isa)} tier, " if len(isas) > 1 else "")
                       + f"1-minute load average {ld} at the start{_run_roofs(rows, rid)})" for rid, c, isa, ld in runs)
           + f"; {'/'.join(reps)} repetitions (medians, tokens/s), steal {steal:.1f}% of CPU time. "
           f"*roof*: decode GB/s (tok/s x the matrices' bytes, read once per token) over the DRAM read "
           f"bandwidth at the same thread count: where the cell has a second figure (runs from "
           f"2026-12-07T13:09 on), probed right before and right after each decode, each repetition "
           f"over the mean of its two probes, the median of those fractions, and in brackets the "
           f"fraction of the run's highest probe; otherwise the highest of the run's probes (at the "
           f"start and the end, and from 2026-12-05T23:02 on after every block of a type and thread "
           f"count too); prefill GOP/s (2 x matmul "
           f"parameters per token) over the tier's int8 peak (BF16: the fp32 FMA peak).", ""]
    out += ["| model | weights | threads | test | zen5 | " + " | ".join(lbl for _, lbl in peers) + " | zen5 of roof |",
            "|---|---|---:|---|---:|" + "---:|" * len(peers) + "---:|"]
    for r in sorted((r for r in speed if r["engine"] == "zen5"), key=_real_key):
        z = float(r["tps_median"])
        found = [by.get((k, r["model_size"], r["quant"], r["threads"], r["test"])) for k, _ in peers]
        best = max([z] + [float(p["tps_median"]) for p in found if p])
        bold = lambda v, text: f"**{text}**" if v == best else text  # noqa: E731  the row's fastest
        cells = [bold(float(p["tps_median"]), f"{_fmt(float(p['tps_median']))} ({z / float(p['tps_median']):.2f}x)")
                 if p else "-" for p in found]
        roof = f"{100 * float(r['frac_roof']):.0f}%" if r["frac_roof"] else "-"
        highest = re.search(r"over the run's highest probe \([0-9.]+ GB/s\): ([0-9.]+)%", r.get("note") or "")
        if highest and r["frac_roof"]:  # a decode divided by the probes around it (real_bench.py)
            roof += f" ({float(highest.group(1)):.0f}%)"
        tier_of = f" ({r['isa']})" if len(isas) > 1 else ""  # rows from runs on different tiers
        out.append(f"| {r['model_size'].upper()} | {r['quant']} | {r['threads']} | {r['test']} | "
                   f"{bold(z, _fmt(z))}{tier_of} | "
                   + " | ".join(cells) + f" | {roof} |")
    out += ["", "Load (open to first token; zen5: `load_weights` to the first token's logits in a fresh process; "
                "llama.cpp: starting `llama-bench -p 0 -n 1` to its first result) and resident memory "
                "(/proc/<pid>/status: VmHWM, the peak during load and the first token; VmRSS after it), "
                "medians (peak: the max) over the repetitions; zen5's KV cache (sized for the tests) apart. "
                "*reads/token*: the matrix bytes one decoded token reads. zen5 *first load*: no weight cache yet, "
                "so it packs the weights; the cache file is written afterwards, in the background "
                "(zen5/weight_cache.py; runs recorded before 2026-12-03 wrote it before the first token); "
                "zen5: every later load, "
                "which maps the cache (from 2026-12-05T19:50 on, after the cache file was read through once, "
                "untimed, so that it is in the page cache as the peer's GGUF is).", "",
            "| model | weights | file | reads/token | engine | threads | load | peak RSS (load) | RSS after load "
            "| KV cache |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    tg = {(r["model_size"], r["quant"]): r["bytes_per_token"] for r in speed if r["bytes_per_token"]}
    order = {"zen5": 0, **{k: i + 1 for i, (k, _) in enumerate(peers)}}
    loads = sorted((r for r in rows if r["test"] in ("load", "load_first")),
                   key=lambda r: _real_key(r) + (order.get(r["engine"], 9), r["test"] == "load"))
    for r in loads:
        engine = label.get(r["engine"], r["engine"]) + (" first load" if r["test"] == "load_first" else "")
        out.append(f"| {r['model_size'].upper()} | {r['quant']} | {_gb(r['file_bytes'])} | "
                   f"{_gb(tg.get((r['model_size'], r['quant']), ''))} | {engine} | "
                   f"{r['threads']} | {float(r['load_s_median']):.2f} s | {_gb(r['rss_peak_load_bytes'])} | "
                   f"{_gb(r['rss_after_load_bytes'])} | {_gb(r['kv_bytes'])} |")
    floors = [(r, re.search(r"arena alone: ([0-9.]+) s at the ([0-9.]+) GB/s", r["note"] or ""))
              for r in loads if r["test"] == "load_first"]
    floors = [(r, m) for r, m in floors if m]
    if floors:  # runs recorded from 2026-12-04 on: what the arena's fresh pages cost a first load
        threads = [re.search(r"probe \((\d+) threads", r["note"]) for r, _ in floors]  # before: one thread
        out += ["", "zen5 first load: first touching the fresh arena alone, at the rate a 1 GiB fresh-memory "
                    "probe measured in the same process after the load (the kernel zeroes each page; a "
                    "hypervisor that backs guest memory lazily allocates it too; the probe's threads in "
                    "brackets; the probe touches the pages the arena is packed on: 4 KiB pages in runs from "
                    "2026-12-07 on, huge pages before): " + "; ".join(
                        f"{r['model_size'].upper()} {r['quant']} {r['threads']}t {m[1]} s "
                        f"({m[2]} GB/s, {t[1] if t else 1} thr.)" for (r, m), t in zip(floors, threads)) + "."]
    failed = [r for r in rows if r["test"] == "failed"]
    if failed:
        out += ["", "Not measured: " + "; ".join(
            f"{label.get(r['engine'], r['engine'])} {r['model_size'].upper()} {r['quant']} {r['threads']}t: {r['note']}"
            for r in sorted(failed, key=_real_key)) + "."]
    return "\n".join(out)


def render_tier(results: Path, path: Path, rows: list[dict]) -> str:
    """A forced-tier run: its table and its roofs (and its frontier walk, if it made one)."""
    cpu, tier = split_stem(path)
    stem = path.name[:-len("-bench.csv")]
    r0 = rows[0]
    peers = _peers(rows)
    roofs = _roofs(results, stem, r0["run_id"])
    steal = statistics.mean(float(r["steal_pct"]) for r in rows)
    tests = sorted({r["test"] for r in rows}, key=lambda t: (t[:2] == "tg", int(t[2:])))
    peer_text = ", ".join(label for _, label in peers) or "no peers"
    out = [f"zen5's {ISA_NAMES.get(tier, tier)} tier, forced (`python -m zen5 bench --isa {tier}`; "
           f"`bench/results/{path.name}`): run {r0['run_id']}, commit `{r0['commit']}`, "
           f"{cpu.replace('_', ' ')}, {r0['workload']} workload ({', '.join(tests)}), {r0['repeats']} repetitions "
           f"(medians, tokens/s), against {peer_text} interleaved in the same run; steal {steal:.1f}% of CPU "
           f"time, 1-minute load average {r0['load1_start']} at the start. *roof*: of this tier's roofs "
           f"(`bench/roofline.c` built for {tier} only): decode GB/s over the in-cache read bandwidth, prefill "
           f"GOP/s over the {_int8_name(roofs[0] if roofs else None)} peak (BF16: over the fp32 FMA peak).",
           ""] + _table(rows, peers)
    noisy = [r for r in rows if float(r["tps_min"]) > 0 and float(r["tps_max"]) / float(r["tps_min"]) > NOISY]
    if noisy:
        label = dict(peers, zen5="zen5")
        out += ["", f"Noisy rows: in {len(noisy)} of {len(rows)} results the fastest repetition was more than "
                    f"{NOISY:g}x the slowest (" + "; ".join(
                        f"{label.get(r['engine'], r['engine'])} {r['quant']} {r['threads']}t {r['test']}: "
                        f"{_fmt(float(r['tps_min']))}-{_fmt(float(r['tps_max']))}" for r in noisy)
                + f"). The machine was shared (1-minute load average {r0['load1_start']} at the start), so "
                  f"those medians measure the contention for the cores as much as the kernels."]
    if roofs:
        out += ["", f"{ISA_NAMES.get(tier, tier)} roofs measured in the same run: "
                + "; ".join(_roof_text(r) for r in roofs) + "."]
    fr_path = results / f"{stem}-frontier.csv"
    if fr_path.exists():
        fr = _read(fr_path)
        a, b = fr[0], fr[-1]
        out += ["", f"Frontier walk of this tier (Q4_1; `bench/results/{fr_path.name}`): decode at {b['ctx_tokens']} "
                    f"tokens of context {_fmt(float(b['gen_tps']))} tok/s, "
                    f"{100 * float(b['gen_tps']) / float(a['gen_tps']):.0f}% of decode at {a['ctx_tokens']} "
                    f"({_fmt(float(a['gen_tps']))} tok/s)."]
    return "\n".join(out)


def render_best(results: Path, path: Path, rows: list[dict]) -> str:
    cpu = path.name[:-len("-bench.csv")]
    r0 = rows[0]
    by = {(r["engine"], r["quant"], r["threads"], r["test"]): r for r in rows}
    peers = _peers(rows)
    steal = statistics.mean(float(r["steal_pct"]) for r in rows)
    roofs = _roofs(results, cpu, r0["run_id"])
    out = [f"Generated by `bench/report.py` from `bench/results/{path.name}`: run {r0['run_id']}, commit "
           f"`{r0['commit']}`, {cpu.replace('_', ' ')}, {r0['repeats']} repetitions (medians, tokens/s), "
           f"peers interleaved with zen5 in the same run; steal {steal:.1f}% of CPU time, 1-minute load "
           f"average {r0['load1_start']} at the start. In brackets: zen5 / peer; the row's fastest in bold. "
           f"PyTorch runs the Q4_1 file's weights dequantized, so its figures repeat on every row. "
           f"*roof*: decode GB/s over "
           f"the in-cache read bandwidth, prefill GOP/s (2 x params per token) over the "
           f"{_int8_name(roofs[0] if roofs else None)} "
           f"peak (BF16: over the fp32 FMA peak, the unit its matmuls use).",
           ""] + _table(rows, peers)
    if roofs:
        out += ["", "Roofs measured in the same run (`bench/roofline.c`): " + "; ".join(
            _roof_text(r) for r in roofs) + "."]
    fr_path = results / f"{cpu}-frontier.csv"
    if fr_path.exists():
        fr = _read(fr_path)
        a, b = fr[0], fr[-1]
        out += ["", f"Frontier walk (Q4_1, zen5; `bench/results/{fr_path.name}`): decode at {b['ctx_tokens']} "
                    f"tokens of context {_fmt(float(b['gen_tps']))} tok/s, "
                    f"{100 * float(b['gen_tps']) / float(a['gen_tps']):.0f}% of decode at {a['ctx_tokens']} "
                    f"({_fmt(float(a['gen_tps']))} tok/s); prefill of the interval ending at {b['ctx_tokens']} "
                    f"{_fmt(float(b['prefill_tps']))} tok/s vs {_fmt(float(a['prefill_tps']))} at {a['ctx_tokens']}."
                    + _frontier_bound(b, float(a["gen_tps"]), by.get(("zen5", "Q4_1", "2", "tg128")),
                                      next((r for r in roofs if r["threads"] == "2"), None))
                    + "".join(_frontier_kv(p, a, b, by, roofs)
                              for p in sorted(results.glob(f"{cpu}-frontier-kv-*.csv")))
                    + _frontier_lookup(results / f"{cpu}-frontier-lookup.csv", a, b),
                "", f"![frontier](bench/results/{fr_path.with_suffix('.png').name})"]
    return "\n".join(out)


def _frontier_bound(last: dict, decode_first: float, tg: dict | None, roof: dict | None) -> str:
    """What memory allows at the last frontier: a decoded token reads the weights (bytes per
    token from the run's tg128 row: achieved GB/s / tok/s) and every cached K/V byte, together
    more than the LLC share, so the 2-thread DRAM read roof of the same run bounds decode (the
    walk runs at 2 threads: harness.Config.frontier_threads). The K/V bytes alone give a second,
    looser bound: what decode could reach if the weights stayed in the cache for free, which is
    the most any exact kernel (one that reads every cached K/V byte) could do there."""
    if tg is None or roof is None or tg["unit"] != "GB/s":
        return ""
    weights, kv = float(tg["achieved"]) * 1e9 / float(tg["tps_median"]), float(last["kv_bytes"])
    dram = float(roof["read_dram_gbps"]) * 1e9
    cap, kv_cap, gen = dram / (weights + kv), dram / kv, float(last["gen_tps"])
    return (f" At {last['ctx_tokens']} a decoded token reads {weights / 1e6:.1f} MB of weights and {kv / 1e6:.0f} MB "
            f"of K/V: the run's DRAM read roof ({dram / 1e9:.1f} GB/s, 2 threads) bounds decode there at "
            f"{_fmt(cap)} tok/s ({100 * cap / decode_first:.0f}% of decode at the first frontier), and zen5 "
            f"reaches {100 * gen / cap:.0f}% of that bound; the K/V reads alone, with the weights free, would "
            f"bound it at {_fmt(kv_cap)} tok/s ({100 * kv_cap / decode_first:.0f}%).")


def _frontier_kv(path: Path, first: dict, last: dict, by: dict, roofs: list[dict]) -> str:
    """The same walk with another KV cache type, against the default cache's first and last rows."""
    kv = path.stem.split("-kv-", 1)[1]
    rows = _read(path)
    b = rows[-1]
    gen, first_gen = float(b["gen_tps"]), float(first["gen_tps"])
    return (f" With the {kv} KV cache (`--kv-type {kv}`, walked in the same run, frontier by frontier with the "
            f"default; `bench/results/{path.name}`): decode at {b['ctx_tokens']} {_fmt(gen)} tok/s, "
            f"{gen / float(last['gen_tps']):.2f}x the default cache there and {100 * gen / first_gen:.0f}% of the "
            f"default's decode at {first['ctx_tokens']}."
            + _frontier_bound(b, first_gen, by.get(("zen5", "Q4_1", "2", "tg128")),
                              next((r for r in roofs if r["threads"] == "2"), None)))


def _frontier_lookup(path: Path, first: dict, last: dict) -> str:
    """The default cache's decode timed again with prompt lookup (the same tokens)."""
    if not path.exists():
        return ""
    rows = _read(path)
    a, b = rows[0], rows[-1]
    return (f" The same decodes with prompt lookup (lookup.py, on by default; `bench/results/{path.name}`) "
            f"produce the same tokens at {_fmt(float(a['gen_tps']))} tok/s at {a['ctx_tokens']} "
            f"({float(a['gen_tps']) / float(first['gen_tps']):.2f}x) and {_fmt(float(b['gen_tps']))} at "
            f"{b['ctx_tokens']} ({float(b['gen_tps']) / float(last['gen_tps']):.2f}x): the fixed text repeats its "
            f"sentences and the model copies them, so this measures what lookup gives when a reply copies its "
            f"context (edits, tool arguments), not decode in general.")


def update_readme(results: Path | None = None, readme: Path | None = None) -> Path:
    results = results or ROOT / "bench" / "results"
    readme = readme or ROOT / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{render(results)}\n{END}{tail}")
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--print", action="store_true", help="print the section instead of writing README")
    a = ap.parse_args(argv)
    if a.print:
        print(render(a.results))
    else:
        print(update_readme(a.results, a.readme))
    return 0


if __name__ == "__main__":
    sys.exit(main())
