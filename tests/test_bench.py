"""The benchmark harness (bench/): the --quick smoke run end to end, the README report, and the
GGUF conversion that makes the Q8_0 / BF16 benchmark files. The numbers themselves are not
checked (this machine's speed is not a test); their shape and the files' layout are."""
from __future__ import annotations

import csv
import importlib.util
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


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


harness = _load(ROOT / "bench" / "harness.py", "bench_harness_under_test")
report = _load(ROOT / "bench" / "report.py", "bench_report_under_test")
convert_gguf = _load(ROOT / "scripts" / "convert_gguf.py", "convert_gguf_under_test")

FRONTIER_COLUMNS = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kv_bytes"]


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(newline="") as fh:
        r = csv.DictReader(fh)
        return list(r.fieldnames), list(r)


@pytest.mark.model
def test_quick_run_writes_csv_frontier_plot_and_json(tmp_path, smollm2_path):
    proc = subprocess.run([sys.executable, "-m", "zen5", "bench", "--quick", "--out", str(tmp_path)],
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


def _fake_results(d: Path, run_id: str, zen_tps: float) -> None:
    base = dict(run_id=run_id, date=run_id, commit="abc1234", cpu="Test_CPU", workload="full",
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
    harness.append_csv(d / "Test_CPU-bench.csv", harness.COLUMNS, rows)
    harness.append_csv(d / "Test_CPU-roofline.csv",
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
    assert "reaches 80% of that bound; the K/V reads alone, with the weights free, would bound it at 143 tok/s (57%)." in text
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
