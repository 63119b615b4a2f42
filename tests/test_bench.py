"""The benchmark harness (bench/): the --quick smoke run end to end, the README report, and the
GGUF conversion that makes the Q8_0 / BF16 benchmark files. The numbers themselves are not
checked (this machine's speed is not a test); their shape and the files' layout are."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from modules import load_file  # noqa: E402

harness = load_file(ROOT / "bench" / "harness.py", "bench_harness_under_test")
report = load_file(ROOT / "bench" / "report.py", "bench_report_under_test")
convert_gguf = load_file(ROOT / "scripts" / "convert_gguf.py", "convert_gguf_under_test")

FRONTIER_COLUMNS = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kv_bytes"]


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(newline="") as fh:
        r = csv.DictReader(fh)
        return list(r.fieldnames), list(r)


@pytest.mark.model
def test_quick_run_writes_csv_frontier_plot_and_json(tmp_path, smollm2_path):
    # bench/harness.py of this checkout (what `python -m zen5 bench` loads from the checkout the
    # installed package lives in, which need not be this one)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "harness.py"), "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON headline
    assert head["workload"] == "quick" and head["commit"] and head["cpu"]
    assert set(head["results"]) == {"Q4_1/1t/pp128", "Q4_1/1t/tg128", "Q4_1/2t/pp128", "Q4_1/2t/tg128"}
    assert all(v["zen5_tps"] > 0 and v["vs"] == {} for v in head["results"].values())
    assert head["frontier"]["first_ctx"] == 128 and head["frontier"]["last_ctx"] == 256
    assert head["frontier"]["kv_type"] == "f16" and head["frontier_kv_q8_0"]["last_ctx"] == 256
    assert head["frontier_lookup"]["kv_type"] == "f16" and head["frontier_lookup"]["prompt_lookup"]
    assert "guesses kept" in proc.stderr + proc.stdout

    cpu = head["cpu"]
    header, rows = _rows(tmp_path / f"{cpu}-bench-quick.csv")
    assert header == list(harness.COLUMNS)
    assert len(rows) == 4
    for r in rows:
        assert (r["engine"], r["quant"], r["workload"], r["repeats"]) == ("zen5", "Q4_1", "quick", "1")
        assert float(r["tps_min"]) <= float(r["tps_median"]) <= float(r["tps_max"])
        assert r["isa"] and r["commit"] == head["commit"] and float(r["steal_pct"]) >= 0
    assert {(r["threads"], r["test"]) for r in rows} == {(t, x) for t in "12" for x in ("pp128", "tg128")}

    header, fr = _rows(tmp_path / f"{cpu}-frontier-quick.csv")
    assert header == FRONTIER_COLUMNS
    assert [int(r["ctx_tokens"]) for r in fr] == [128, 256]
    assert [int(r["prefill_tokens"]) for r in fr] == [128, 128]
    kv = [int(r["kv_bytes"]) for r in fr]
    assert kv[0] > 0 and kv[1] == 2 * kv[0]
    # the q8_0 cache walked alongside: 68 bytes per 64 cached values instead of fp16's 128
    _, fr8 = _rows(tmp_path / f"{cpu}-frontier-quick-kv-q8_0.csv")
    assert [int(r["ctx_tokens"]) for r in fr8] == [128, 256]
    assert int(fr8[0]["kv_bytes"]) * 128 == kv[0] * 68
    # the f16 decode again with prompt lookup: its own decode figures, the engine's prefill
    header, frl = _rows(tmp_path / f"{cpu}-frontier-quick-lookup.csv")
    assert header == FRONTIER_COLUMNS and [r["prefill_tps"] for r in frl] == [r["prefill_tps"] for r in fr]
    assert all(float(r["gen_tps"]) > 0 for r in frl)
    assert (tmp_path / f"{cpu}-frontier-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(f"{cpu}-bench.csv"))  # a quick run never touches the real results


def _fake_results(d: Path, run_id: str, zen_tps: float, cpu: str = "Test_CPU") -> None:
    base = dict(run_id=run_id, date=run_id, commit="abc1234", cpu=cpu, workload="full",
                build="b", isa="avx512", model="m.gguf", n_tokens=512, repeats=5, tps_min=1,
                tps_max=1, achieved=1, unit="GOP/s", frac_alt=0.1, steal_ticks=0, steal_pct=0.5,
                load1_start=0.4)
    rows = []
    for engine, quant, tps in (("zen5", "Q4_1", zen_tps), ("llama.cpp-avx512", "Q4_1", 100.0),
                               ("torch-bf16", "Q4_1", 400.0), ("zen5", "Q8_0", zen_tps / 2)):
        rows.append(dict(base, engine=engine, quant=quant, threads=2, test="pp512", tps_median=tps,
                         frac_peak=0.25 if engine == "zen5" else 0.05))
    # decode streams 100 MB of weights per token: 30 GB/s at 300 tok/s
    rows.append(dict(base, engine="zen5", quant="Q4_1", threads=2, test="tg128", n_tokens=128, tps_median=300.0,
                     achieved=30.0, unit="GB/s", frac_peak=0.5))
    harness.append_csv(d / f"{cpu}-bench.csv", harness.COLUMNS, rows)
    harness.append_csv(d / f"{cpu}-roofline.csv",
                       ("run_id", "threads", "read_llc_gbps", "read_dram_gbps", "vnni_int8_gops", "fma_fp32_gflops"),
                       [dict(run_id=run_id, threads=2, read_llc_gbps=59.3, read_dram_gbps=33.4,
                             vnni_int8_gops=1769, fma_fp32_gflops=442)])


def test_report_renders_latest_full_run_between_markers(tmp_path):
    _fake_results(tmp_path, "2026-01-01T00:00:00", 200.0)
    _fake_results(tmp_path, "2026-01-02T00:00:00", 300.0)  # the latest run wins
    with (tmp_path / "Test_CPU-frontier.csv").open("w") as fh:
        fh.write(",".join(FRONTIER_COLUMNS) + "\n512,512,900.0,32,250.0,1\n8192,512,600.0,32,80.0,234000000\n")
    with (tmp_path / "Test_CPU-frontier-kv-q8_0.csv").open("w") as fh:
        fh.write(",".join(FRONTIER_COLUMNS) + "\n512,512,900.0,32,240.0,1\n8192,512,600.0,32,120.0,134000000\n")
    with (tmp_path / "Test_CPU-frontier-lookup.csv").open("w") as fh:
        fh.write(",".join(FRONTIER_COLUMNS) + "\n512,512,900.0,32,500.0,1\n8192,512,600.0,32,200.0,234000000\n")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Performance\n<!-- bench:start -->\nSTALE TABLE\n<!-- bench:end -->\n\n## Next\nkeep\n")
    report.update_readme(tmp_path, readme)
    text = readme.read_text()
    assert "STALE TABLE" not in text and text.startswith("# x\n\n## Performance\n") and text.endswith("## Next\nkeep\n")
    assert "| Q4_1 | 2 | pp512 | 300 | 100 (3.00x) | **400 (0.75x)** | 25% |" in text  # the row's fastest in bold
    assert "| Q8_0 | 2 | pp512 | 150 | - | **400 (0.38x)** | 25% |" in text  # torch rows serve every quant
    assert "2026-01-02T00:00:00" in text and "32% of decode at 512" in text
    # 100 MB of weights + 234 MB of K/V per token at the 33.4 GB/s DRAM roof: 100 tok/s
    assert "bounds decode there at 100 tok/s (40% of decode at the first frontier), and zen5 reaches 80%" in text
    # the 234 MB of K/V alone at 33.4 GB/s: 143 tok/s, 57% of 250
    assert ("reaches 80% of that bound; the K/V reads alone, with the weights free, would bound it at "
            "143 tok/s (57%).") in text
    assert "int8 VNNI 1,769 GOP/s" in text
    # the q8_0 walk: 120 tok/s = 1.50x the f16 cache's 80 and 48% of its 250 at 512; 100 + 134 MB
    # per token at 33.4 GB/s bound it at 143 tok/s (57% of 250), reached to 84%
    assert ("With the q8_0 KV cache (`--kv-type q8_0`, walked in the same run, frontier by frontier with the "
            "default; `bench/results/Test_CPU-frontier-kv-q8_0.csv`): decode at 8192 120 tok/s, 1.50x the default "
            "cache there and 48% of the default's decode at 512.") in text
    assert "bounds decode there at 143 tok/s (57% of decode at the first frontier), and zen5 reaches 84%" in text
    assert "with the weights free, would bound it at 249 tok/s (100%)." in text  # 33.4 GB/s / 134 MB
    assert "produce the same tokens at 500 tok/s at 512 (2.00x) and 200 at 8192 (2.50x)" in text
    report.update_readme(tmp_path, readme)
    assert readme.read_text() == text  # idempotent


def test_report_gives_each_cpu_its_latest_full_run_newest_first(tmp_path):
    """An AVX-512 machine's run and an AVX2-only machine's run both stay in the README, each with
    its own latest run and roofs; the newer machine's table comes first."""
    _fake_results(tmp_path, "2026-01-01T00:00:00", 200.0, cpu="Intel_Xeon")
    _fake_results(tmp_path, "2026-01-03T00:00:00", 150.0, cpu="AMD_EPYC_Zen3")
    _fake_results(tmp_path, "2026-01-04T00:00:00", 160.0, cpu="AMD_EPYC_Zen3")  # Zen 3's latest wins
    text = report.render(tmp_path)
    zen3 = text.index("from `bench/results/AMD_EPYC_Zen3-bench.csv`: run 2026-01-04T00:00:00")
    xeon = text.index("from `bench/results/Intel_Xeon-bench.csv`: run 2026-01-01T00:00:00")
    assert zen3 < xeon and "run 2026-01-03" not in text
    assert "| Q4_1 | 2 | pp512 | 160 |" in text[zen3:xeon] and "| Q4_1 | 2 | pp512 | 200 |" in text[xeon:]


def test_prefill_roof_is_the_peak_of_the_unit_the_weights_use():
    """Quantized weights multiply on int8 VNNI, F32/F16/BF16 on fp32 FMAs: frac_peak divides a
    prefill by that unit's peak (and frac_alt by the other); decode is bandwidth either way."""
    import roofline
    roof = {"read_llc_gbps": 50.0, "read_dram_gbps": 25.0, "vnni_int8_gops": 1600.0, "fma_fp32_gflops": 400.0}
    assert roofline.fractions("pp512", 1000, roof, 10**8, 2.0e8, "Q4_1") == (200.0, "GOP/s", 0.125, 0.5)
    assert roofline.fractions("pp512", 1000, roof, 10**8, 2.0e8, "BF16") == (200.0, "GOP/s", 0.5, 0.125)
    for quant in ("Q8_0", "BF16"):
        assert roofline.fractions("tg128", 100, roof, 10**8, 2.0e8, quant) == (10.0, "GB/s", 0.2, 0.4)


def test_report_without_markers_or_runs_fails_loudly(tmp_path):
    (tmp_path / "README.md").write_text("no markers\n")
    with pytest.raises(FileNotFoundError):
        report.render(tmp_path)
    _fake_results(tmp_path, "2026-01-01T00:00:00", 1.0)
    with pytest.raises(ValueError):
        report.update_readme(tmp_path, tmp_path / "README.md")


def test_convert_gguf_q8_0_and_bf16_keep_metadata_and_values(tmp_path):
    import tiny_gguf

    src = Path(tiny_gguf.write_gguf(tmp_path / "tiny.Q4_1.gguf", matrix_type=Q.Q4_1,
                                    types={"token_embd.weight": Q.Q8_0}))
    r0 = gguf.GGUFReader(str(src))
    orig = {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) for t in r0.tensors}
    for qtype, ggml_type, file_type in (("Q8_0", Q.Q8_0, 7), ("BF16", Q.BF16, 32)):
        dst = convert_gguf.output_path(src, qtype, tmp_path / "out")
        assert dst.name == f"tiny.{qtype}.gguf"
        dst.parent.mkdir(exist_ok=True)
        convert_gguf.convert(src, dst, qtype)
        r = gguf.GGUFReader(str(dst))
        assert r.fields["general.file_type"].contents() == file_type
        assert r.fields["tokenizer.ggml.tokens"].contents() == r0.fields["tokenizer.ggml.tokens"].contents()
        assert r.fields["llama.rope.freq_base"].contents() == r0.fields["llama.rope.freq_base"].contents()
        for t in r.tensors:
            before = [u for u in r0.tensors if u.name == t.name][0]
            assert list(t.shape) == list(before.shape)
            if len(t.shape) == 1:
                assert t.tensor_type == before.tensor_type  # norms copied as they are
                continue
            assert t.tensor_type == ggml_type
            x, y = orig[t.name], gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            assert np.abs(x - y).max() <= 0.01 * np.abs(x).max()
    # idempotent through the CLI: an existing output is left alone
    out = tmp_path / "out"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_gguf.py"), "--model", str(src),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out / "tiny.Q8_0.gguf"), str(out / "tiny.BF16.gguf")]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


@pytest.mark.model
def test_kv_quality_scores_every_cache_against_the_exact_one(tmp_path):
    """bench/kv_quality.py: four (matmul, KV cache) configurations read the same text in lockstep;
    the exact one scores KL 0 and top-1 100% against itself, the quantized ones a small, nonzero
    KL (they do quantize), and the rows land in the CSV."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kv_quality.py"), "--tokens", "300",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["matmul"], r["kv_type"]) for r in rows] == [("f32", "f32"), ("int8", "f16"), ("int8", "q8_0"),
                                                           ("f32", "q8_0")]
    exact, *others = rows
    assert exact["kl_vs_exact"] == 0 and exact["top1_vs_exact"] == 1
    for r in others:
        assert 0 < r["kl_vs_exact"] < 0.05 and r["top1_vs_exact"] > 0.9
        assert abs(r["ppl"] / exact["ppl"] - 1) < 0.05
    _, written = _rows(tmp_path / "kv_quality.csv")
    assert len(written) == 4 and float(written[3]["kl_vs_exact"]) == rows[3]["kl_vs_exact"]


# ---------------------------------------------------------------- ISA tiers and the peers per CPU
import peers  # noqa: E402
import results_log  # noqa: E402

ZEN3 = ("fpu sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 sha_ni vaes "
        "vpclmulqdq")
ZEN4 = ZEN3 + (" avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vbmi2"
               " avx512_vnni avx512_bitalg avx512_vpopcntdq")
XEON_AMX = ZEN4 + " avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"
ALDER_LAKE = ZEN3 + " avx_vnni"
CPUS = {"zen3": ZEN3, "zen4": ZEN4, "xeon_amx": XEON_AMX, "alder_lake": ALDER_LAKE}


@pytest.mark.parametrize("cpu, best, builds, llama, best_peers, avx2_peers, vnni_peers", [
    ("zen3", "avx2", ["native"], {"llama.cpp-native": ("native", "avx2", "avx2")},
     ("llama.cpp-native", "torch-fp32", "torch-bf16"), None, None),
    ("zen4", "avx512", ["native", "avx2"], {"llama.cpp-native": ("native", "avx512", "avx512"),
                                            "llama.cpp-avx2": ("avx2", "avx2", "avx2")},
     ("llama.cpp-native", "torch-fp32", "torch-bf16"), ("llama.cpp-avx2",), ("llama.cpp-avx2",)),
    ("xeon_amx", "amx", ["native", "avx512", "avx2", "avx2vnni"],
     {"llama.cpp-amx": ("native", "avx512+amx", "amx"), "llama.cpp-avx512": ("avx512", "avx512", "avx512"),
      "llama.cpp-avx2": ("avx2", "avx2", "avx2"), "llama.cpp-avx2vnni": ("avx2vnni", "avx2vnni", "avx2vnni")},
     ("llama.cpp-avx512", "llama.cpp-amx", "torch-fp32", "torch-bf16"), ("llama.cpp-avx2",),
     ("llama.cpp-avx2vnni", "llama.cpp-avx2")),
    ("alder_lake", "avx2vnni", ["native", "avx2"], {"llama.cpp-native": ("native", "avx2vnni", "avx2vnni"),
                                                     "llama.cpp-avx2": ("avx2", "avx2", "avx2")},
     ("llama.cpp-native", "llama.cpp-avx2", "torch-fp32", "torch-bf16"), ("llama.cpp-avx2",), None),
])
def test_peer_builds_and_names_follow_the_cpu_flags(cpu, best, builds, llama, best_peers, avx2_peers, vnni_peers):
    """native always (AMX on the Xeon, AVX-512 on Zen 4, AVX2 on Zen 3, AVX2 + AVX-VNNI on Alder
    Lake); avx512 only beside AMX; avx2 where native has more; avx2vnni beside an AVX-512 native
    on a CPU with AVX-VNNI; each named for what it runs; a tier's run gets the builds of its ISA
    (the AVX-VNNI tier's also the plain AVX2 build), and PyTorch only for the best tier."""
    flags = peers.cpu_flags(CPUS[cpu])
    assert peers.planned_builds(flags) == builds
    got = peers.llama_peers(flags)
    assert {n: (p.build, p.isa, p.tier) for n, p in got.items()} == llama
    assert set(got) <= set(peers.LLAMA_PEERS)
    assert peers.default_peers(best, best, flags) == best_peers
    if avx2_peers:
        assert peers.default_peers("avx2", best, flags) == avx2_peers  # no torch: it cannot be held to AVX2
    if vnni_peers:
        assert peers.default_peers("avx2vnni", best, flags) == vnni_peers
    assert peers.default_peers("ref", best, flags) == ()
    # the build script makes the same choice (its --plan, with the flags in ZEN5_CPU_FLAGS)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "build_peers.sh"), "--plan"], capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, ZEN5_CPU_FLAGS=CPUS[cpu]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == builds


def test_llama_peer_not_built_for_this_cpu_or_missing_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="not built on this CPU"):
        peers.LlamaBench("llama.cpp-amx", root=tmp_path, flags=peers.cpu_flags(ZEN4))
    with pytest.raises(FileNotFoundError, match="build_peers.sh"):
        peers.LlamaBench("llama.cpp-avx2", root=tmp_path, flags=peers.cpu_flags(ZEN4))
    exe = tmp_path / "build-avx2" / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    lb = peers.LlamaBench("llama.cpp-avx2", root=tmp_path, flags=peers.cpu_flags(XEON_AMX))
    assert lb.describe("Q4_1", 1) == ("avx2 (no AVX-512/VNNI)", "avx2")


def test_tier_choice_and_result_file_names():
    tiers = [("ref", ""), ("avx2", ""), ("avx2vnni", "CPU lacks AVX-VNNI"), ("avx512", "")]
    assert harness.resolve_tier("", tiers) == ("avx512", "avx512")
    assert harness.resolve_tier("avx2", tiers) == ("avx2", "avx512")
    with pytest.raises(RuntimeError, match="AVX-VNNI"):
        harness.resolve_tier("avx2vnni", tiers)
    with pytest.raises(ValueError):
        harness.resolve_tier("sse2", tiers)
    assert harness.result_stem("AMD_EPYC_Zen4", "avx512", "avx512") == "AMD_EPYC_Zen4"
    assert harness.result_stem("AMD_EPYC_Zen4", "avx2", "avx512") == "AMD_EPYC_Zen4-avx2"
    assert harness.result_stem("AMD_EPYC_Zen3", "avx2", "avx2") == "AMD_EPYC_Zen3"
    with pytest.raises(ValueError):
        harness.BenchConfig(isa="sse2")
    # --isa is no change of workload: an AVX2 run of the full workload is "full"
    ap = __import__("argparse").ArgumentParser()
    harness.add_arguments(ap)
    assert harness.config_from_args(ap.parse_args(["--isa", "avx2"])).workload == "full"
    assert harness.config_from_args(ap.parse_args(["--isa", "avx2", "--repeat", "3"])).workload == "custom"
    # the split the report uses: tier files apart, CPU names with dashes kept whole
    assert report.split_stem(Path("AMD_EPYC_Zen4-avx2-bench.csv")) == ("AMD_EPYC_Zen4", "avx2")
    assert report.split_stem(Path("Intel_Xeon_Processor-bench.csv")) == ("Intel_Xeon_Processor", "")
    assert report.split_stem(Path("AMD_Ryzen_9_7950X_16-Core_Processor-bench.csv"))[1] == ""


def _cpuinfo(vendor: str, family: int, model: int, name: str, flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: {name}\nflags\t\t: {flags}\n\nprocessor\t: 1\nvendor_id\t: {vendor}\n")


def test_cpu_names_tell_amd_generations_and_intel_apart():
    zen3 = results_log.cpu_name(_cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC", ZEN3))
    zen4 = results_log.cpu_name(_cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC", ZEN4))
    xeon = results_log.cpu_name(_cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Processor", XEON_AMX))
    assert (zen3, zen4, xeon) == ("AMD_EPYC_Zen3", "AMD_EPYC_Zen4", "Intel_Xeon_Processor")
    assert results_log.cpu_name(_cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC 9654 96-Core Processor", ZEN4)) \
        == "AMD_EPYC_9654_96-Core_Processor"  # a real model number needs no suffix
    assert results_log.cpu_name(_cpuinfo("AuthenticAMD", 99, 3, "AMD EPYC", ZEN4)) == "AMD_EPYC_f99m3"


def test_roofs_measured_twice_keep_the_higher_of_each_figure():
    """The harness probes the roofs at a run's start and end; a slow window in one probe must not
    lower the roof the run is divided by (fractions would read high), figure by figure."""
    import roofline
    start = {"tier": "avx2", "threads": 1, "read_llc_gbps": 18.5, "read_dram_gbps": 13.7, "int8_gops": 208.1,
             "fma_fp32_gflops": 100.4, "int8_insn": "vpmaddubsw+vpaddw ymm"}
    end = dict(start, read_llc_gbps=20.3, int8_gops=302.0, fma_fp32_gflops=95.4)
    best = roofline.best_of(start, end)
    assert best == dict(start, read_llc_gbps=20.3, int8_gops=302.0)
    assert roofline.fractions("pp512", 1000, best, 10**8, 2.0e8, "Q4_1")[2] == pytest.approx(200.0 / 302.0)


def test_prefill_roof_uses_the_tier_int8_peak():
    import roofline
    roof = {"read_llc_gbps": 50.0, "read_dram_gbps": 25.0, "int8_gops": 400.0, "maddubs_i32_gops": 250.0,
            "fma_fp32_gflops": 100.0, "tier": "avx2"}
    assert roofline.fractions("pp512", 1000, roof, 10**8, 2.0e8, "Q4_1") == (200.0, "GOP/s", 0.5, 2.0)
    assert roofline.fractions("pp512", 1000, roof, 10**8, 2.0e8, "BF16") == (200.0, "GOP/s", 2.0, 0.5)
    with pytest.raises(ValueError):
        roofline._binary("ref")


def test_report_names_the_amx_tile_peak():
    roof = {"threads": "1", "read_llc_gbps": "35.5", "read_dram_gbps": "18.9", "vnni_int8_gops": "995.3",
            "amx_int8_gops": "6715.2", "fma_fp32_gflops": "249.5", "int8_gops": "6715.2",
            "int8_insn": "tdpbssd (AMX tiles)", "fma_insn": "vfmadd231ps zmm"}
    assert report._int8_name(roof) == "int8 AMX (tdpbssd on full tiles)"
    assert report._roof_text(roof) == ("1 thread(s): read 35.5 GB/s in LLC, 18.9 GB/s from DRAM, int8 AMX tdpbssd "
                                       "(the roof above) 6,715 GOP/s, int8 VNNI 995 GOP/s, fp32 FMA 250 GFLOP/s")
    old = dict(roof, amx_int8_gops="", int8_gops="995.3", int8_insn="vpdpbusd zmm")  # amx runs before the probe
    assert report._int8_name(old) == "int8 VNNI" and "int8 VNNI 995 GOP/s" in report._roof_text(old)


def test_the_amx_roof_is_the_tile_units_peak():
    """Measured, where this CPU runs the amx tier: the int8 roof is TDPBSSD's on full tiles (8x
    vpdpbusd zmm's MACs per cycle on Sapphire Rapids: well above it, whatever the VM's noise),
    the vpdpbusd peak beside it, and the other roofs those of AVX-512."""
    from zen5 import _native
    if not dict(_native.isa_tiers()).get("amx") == "":
        pytest.skip("this CPU / OS does not run the amx tier")
    import roofline
    roof = roofline.measure(1, "amx")
    assert roof["tier"] == "amx" and roof["int8_insn"].startswith("tdpbssd")
    assert roof["int8_gops"] == roof["amx_int8_gops"] > 3 * roof["vnni_int8_gops"] > 0
    assert roof["fma_insn"] == "vfmadd231ps zmm" and roof["read_dram_gbps"] > 0


def test_append_csv_widens_an_older_header(tmp_path):
    path = tmp_path / "x-roofline.csv"
    harness.append_csv(path, ("run_id", "threads", "vnni_int8_gops"), [dict(run_id="a", threads=1, vnni_int8_gops=9)])
    harness.append_csv(path, ("run_id", "threads", "vnni_int8_gops", "tier"),
                       [dict(run_id="b", threads=1, vnni_int8_gops=8, tier="avx512")])
    header, rows = _rows(path)
    assert header == ["run_id", "threads", "vnni_int8_gops", "tier"]
    assert [(r["run_id"], r["tier"]) for r in rows] == [("a", ""), ("b", "avx512")]
    with pytest.raises(RuntimeError):
        harness.append_csv(path, ("run_id", "other"), [dict(run_id="c", other=1)])


def _fake_tier_results(d: Path, run_id: str) -> None:
    base = dict(run_id=run_id, date=run_id, commit="def5678", cpu="AMD_EPYC_Zen4", workload="custom",
                model="m.gguf", n_tokens=512, repeats=3, tps_min=1, tps_max=1, achieved=1, unit="GOP/s",
                frac_alt=0.1, steal_ticks=0, steal_pct=0.2, load1_start=1.7)
    rows = [dict(base, engine="zen5", build="matmul=int8", isa="avx2", quant="Q4_1", threads=1, test="pp512",
                 tps_median=500.0, frac_peak=0.3),
            dict(base, engine="llama.cpp-avx2", build="avx2 (no AVX-512/VNNI)", isa="avx2", quant="Q4_1", threads=1,
                 test="pp512", tps_median=125.0, frac_peak=0.07),
            dict(base, engine="zen5", build="matmul=int8", isa="avx2", quant="Q4_1", threads=1, test="tg128",
                 n_tokens=128, tps_median=90.0, unit="GB/s", frac_peak=0.4),
            dict(base, engine="llama.cpp-avx2", build="avx2 (no AVX-512/VNNI)", isa="avx2", quant="Q4_1", threads=1,
                 test="tg128", n_tokens=128, tps_median=100.0, unit="GB/s", frac_peak=0.45)]
    harness.append_csv(d / "AMD_EPYC_Zen4-avx2-bench.csv", harness.COLUMNS, rows)
    harness.append_csv(d / "AMD_EPYC_Zen4-avx2-roofline.csv",
                       ("run_id", "threads", "read_llc_gbps", "read_dram_gbps", "maddubs_i16_gops", "maddubs_i32_gops",
                        "fma_fp32_gflops", "int8_gops", "int8_insn", "fma_insn", "tier"),
                       [dict(run_id=run_id, threads=1, read_llc_gbps=28.4, read_dram_gbps=18.2, maddubs_i16_gops=374.4,
                             maddubs_i32_gops=229.4, fma_fp32_gflops=118.1, int8_gops=374.4,
                             int8_insn="vpmaddubsw+vpaddw ymm", fma_insn="vfmadd231ps ymm", tier="avx2")])


def test_report_renders_a_forced_tier_table_beside_the_best_tier(tmp_path):
    _fake_results(tmp_path, "2026-01-02T00:00:00", 300.0)
    only_best = report.render(tmp_path)
    _fake_tier_results(tmp_path, "2026-01-03T00:00:00")
    text = report.render(tmp_path)
    assert text.startswith(only_best + "\n\n")  # the best tier's section is unchanged, first
    tier = text[len(only_best):]
    assert ("zen5's AVX2 tier, forced (`python -m zen5 bench --isa avx2`; "
            "`bench/results/AMD_EPYC_Zen4-avx2-bench.csv`)") in tier
    assert "AMD EPYC Zen4, custom workload (pp512, tg128), 3 repetitions" in tier
    assert "1-minute load average 1.7 at the start" in tier and "over the int8 vpmaddubsw+vpaddw peak" in tier
    assert "| weights | threads | test | zen5 | llama.cpp AVX2 | zen5 of roof |" in tier
    assert "torch" not in tier.lower() and "AVX-512 |" not in tier
    assert "| Q4_1 | 1 | pp512 | **500** | 125 (4.00x) | 30% |" in tier
    assert "| Q4_1 | 1 | tg128 | 90.0 | **100 (0.90x)** | 40% |" in tier
    assert ("AVX2 roofs measured in the same run: 1 thread(s): read 28.4 GB/s in LLC, 18.2 GB/s from DRAM, int8 "
            "vpmaddubsw+vpaddw (int16 sums, the Q4 inner loop; the roof above) 374 GOP/s, vpmaddubsw+vpmaddwd+vpaddd "
            "(to int32) 229 GOP/s, fp32 FMA (ymm) 118 GFLOP/s.") in tier
    assert "Noisy rows" not in tier
    # a forced-tier file alone still renders (a machine whose only recorded run is a forced tier)
    for f in tmp_path.glob("Test_CPU-*"):
        f.unlink()
    assert report.render(tmp_path) == tier.lstrip("\n")


def test_report_calls_out_noisy_rows_of_a_tier_run(tmp_path):
    _fake_tier_results(tmp_path, "2026-01-03T00:00:00")
    path = tmp_path / "AMD_EPYC_Zen4-avx2-bench.csv"
    header, rows = _rows(path)
    rows[3].update(tps_min="4.0", tps_max="110.0")  # llama.cpp tg128: one repetition starved
    path.unlink()
    harness.append_csv(path, header, rows)
    text = report.render(tmp_path)
    assert ("Noisy rows: in 1 of 4 results the fastest repetition was more than 2x the slowest "
            "(llama.cpp AVX2 Q4_1 1t tg128: 4.0-110). The machine was shared (1-minute load average 1.7") in text


def test_one_thread_blocks_run_pinned_to_one_cpu():
    """harness.pinned: 1-thread work runs on the lowest-numbered CPU this process may use (child
    processes inherit it: a fresh 1-thread process otherwise measured whichever vCPU it landed on),
    other thread counts keep the whole set, and the set comes back afterwards, also after an error."""
    allowed = os.sched_getaffinity(0)
    inherited = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with harness.pinned(1):
        inside = os.sched_getaffinity(0)
        child = subprocess.run(inherited, capture_output=True, text=True, check=True).stdout.strip()
    assert os.sched_getaffinity(0) == allowed
    if len(allowed) > 1:
        assert inside == {min(allowed)} and child == f"[{min(allowed)}]"
    else:
        assert inside == allowed
    with harness.pinned(2):
        assert os.sched_getaffinity(0) == allowed
    with pytest.raises(RuntimeError), harness.pinned(1):
        raise RuntimeError("a failed block")
    assert os.sched_getaffinity(0) == allowed
