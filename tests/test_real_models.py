"""bench/real_models.py (random-weight GGUFs at real widths) and the `bench --model-size` mode
(bench/real_bench.py) at a small shape: valid files zen5 runs without NaN, the same bytes for the
same seed, the cache reused; the CLI flags; the end-to-end rows; the README section."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from modules import load_file  # noqa: E402

real_models = load_file(ROOT / "bench" / "real_models.py", "real_models")
harness = load_file(ROOT / "bench" / "harness.py", "bench_harness_real_under_test")
report = load_file(ROOT / "bench" / "report.py", "bench_report_real_under_test")
real_bench = load_file(ROOT / "bench" / "real_bench.py", "real_bench")

SMALL = real_models.Shape("small", hidden=128, layers=2, ffn=256, heads=2, kv_heads=1, head_dim=64, vocab=320,
                          tied=False, pre="llama-bpe", ctx=512)


def test_real_shapes_are_the_models_they_stand_for():
    s, e = real_models.SHAPES["1.7b"], real_models.SHAPES["8b"]
    assert (s.hidden, s.layers, s.ffn, s.heads, s.kv_heads, s.head_dim, s.vocab, s.tied) == \
        (2048, 24, 8192, 32, 32, 64, 49152, True)
    assert (e.hidden, e.layers, e.ffn, e.heads, e.kv_heads, e.head_dim, e.vocab, e.tied) == \
        (4096, 32, 14336, 32, 8, 128, 128256, False)
    assert 1.70e9 < s.n_params() < 1.72e9 and 8.02e9 < e.n_params() < 8.04e9
    # Q4_0 is 18 bytes per 32 values: SmolLM2-1.7B's 0.96 GB
    q4 = sum(real_models.tensor_bytes(d, "Q4_0" if len(d) == 2 else "F32") for _, d in s.tensors())
    assert 0.95e9 < q4 < 0.97e9


@pytest.mark.parametrize("qtype", real_models.TYPES)
def test_small_shape_is_a_valid_gguf_that_zen5_runs(tmp_path, qtype):
    from zen5.engine import Engine
    from zen5.loader import load_weights

    path = real_models.ensure(SMALL, qtype, tmp_path)
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "llama"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == SMALL.vocab
    assert r.fields["llama.attention.head_count_kv"].contents() == 1
    assert real_models.SPEED_NOTE in r.fields["general.description"].contents()
    names = {t.name: t for t in r.tensors}
    assert [t.name for t in r.tensors] == [n for n, _ in SMALL.tensors()]
    assert list(names["output.weight"].shape) == [SMALL.hidden, SMALL.vocab]
    assert list(names["blk.1.ffn_down.weight"].shape) == [SMALL.ffn, SMALL.hidden]
    for t in r.tensors:
        assert t.tensor_type.name == ("F32" if len(t.shape) == 1 else qtype)
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(x).all()
        if len(t.shape) == 2:  # about 0.6 / sqrt(cols): sane activations through every layer
            assert 0.2 < float(x.std()) * np.sqrt(t.shape[0]) < 1.5
    eng = Engine(load_weights(str(path)), threads=1, n_ctx=64)
    tokens = eng.tokenizer.encode("hello world, the thin line")
    eng.native_ctx.eval(tokens)
    for _ in range(4):
        logits = np.asarray(eng.native_ctx.logits())
        assert logits.shape == (SMALL.vocab,) and np.isfinite(logits).all() and logits.std() > 0
        eng.native_ctx.eval([int(np.argmax(logits))])


def test_same_seed_same_bytes_and_the_cache_is_reused(tmp_path):
    a = real_models.ensure(SMALL, "Q4_1", tmp_path / "a", seed=3)
    b = real_models.ensure(SMALL, "Q4_1", tmp_path / "b", seed=3)
    c = real_models.ensure(SMALL, "Q4_1", tmp_path / "c", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    marker = json.loads(a.with_name(a.name + ".json").read_text())
    assert marker["bytes"] == a.stat().st_size and marker["seed"] == 3 and marker["type"] == "Q4_1"
    stamp = a.stat().st_mtime_ns
    assert real_models.ensure(SMALL, "Q4_1", tmp_path / "a", seed=3) == a and a.stat().st_mtime_ns == stamp
    with a.open("r+b") as fh:  # truncated (an interrupted copy): written again
        fh.truncate(1000)
    again = real_models.ensure(SMALL, "Q4_1", tmp_path / "a", seed=3)
    assert again.read_bytes() == b.read_bytes()
    # another shape, another file beside it; the real shapes get plain names
    other = real_models.ensure(replace(SMALL, layers=1), "Q4_1", tmp_path / "a", seed=3)
    assert other != a and other.exists()
    assert real_models.file_name(real_models.SHAPES["8b"], "BF16") == "llama-8b-random.BF16.gguf"
    assert not list((tmp_path / "a").glob("*.tmp*"))


def test_matmul_bytes_count_the_head_once_and_skip_an_untied_embedding(tmp_path):
    untied = real_models.ensure(SMALL, "Q8_0", tmp_path)
    tied = real_models.ensure(replace(SMALL, tied=True), "Q8_0", tmp_path)
    mats = [d for n, d in SMALL.tensors() if len(d) == 2 and n != "token_embd.weight"]
    want = sum(real_models.tensor_bytes(d, "Q8_0") for d in mats), sum(int(np.prod(d)) for d in mats)
    assert real_bench.matmul_stats(str(untied)) == want
    assert real_bench.matmul_stats(str(tied)) == want  # the tied embedding is the head, counted once


def _parse(*argv):
    ap = __import__("argparse").ArgumentParser()
    harness.add_arguments(ap)
    return harness.config_from_args(ap.parse_args(list(argv)))


def test_bench_cli_takes_model_size_and_types():
    cfg = _parse("--model-size", "8b")
    assert (cfg.model_size, cfg.types, cfg.prompts, cfg.gen, cfg.repeat, cfg.workload) == \
        ("8b", (), (512,), 128, real_bench.REAL_REPEAT, "full")
    cfg = _parse("--model-size", "1.7b", "--types", "Q4_0,BF16", "--models-dir", "/x")
    assert (cfg.types, cfg.models_dir, cfg.workload) == (("Q4_0", "BF16"), "/x", "custom")
    assert _parse("--model-size", "1.7b", "--repeat", "5").repeat == 5
    assert _parse().model_size == "" and _parse().prompts == (128, 512, 2048)
    with pytest.raises(ValueError):
        _parse("--model-size", "1.7b", "--types", "Q5_K")
    with pytest.raises(SystemExit):
        _parse("--model-size", "70b")


def test_model_size_run_end_to_end_writes_real_rows(tmp_path):
    """The smoke shape through the whole mode (ref tier: no roofline, no peers): load rows with the
    memory read by the child, speed rows, the JSON headline with the speed note."""
    out, models = tmp_path / "out", tmp_path / "models"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "harness.py"), "--model-size", "tiny", "--isa", "ref",
                           "--types", "Q4_0,BF16", "--threads", "1", "--prompts", "64", "--gen", "4", "--repeat", "1",
                           "--models-dir", str(models), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    head = json.loads(proc.stdout.strip().splitlines()[-1])
    assert head["model_size"] == "tiny" and "does not depend on the weights' values" in head["weights"]
    assert head["failed"] == {} and "does not depend" in proc.stdout
    assert set(head["results"]) == {f"{q}/1t/{t}" for q in ("Q4_0", "BF16") for t in ("load", "pp64", "tg4")}
    with (out / head["results_file"]).open(newline="") as fh:
        r = csv.DictReader(fh)
        assert tuple(r.fieldnames) == real_bench.REAL_COLUMNS
        rows = list(r)
    assert {(x["engine"], x["quant"], x["test"]) for x in rows} == \
        {("zen5", q, t) for q in ("Q4_0", "BF16") for t in ("load_first", "load", "pp64", "tg4")}
    for q in ("Q4_0", "BF16"):  # the first load packs and writes the weight cache, the second maps it
        assert head["results"][f"{q}/1t/load"]["first_load_s"] > 0
    for x in rows:
        assert x["model_size"] == "tiny" and x["weights"] == "random" and x["workload"] == "custom"
        if x["test"] == "load_first":
            assert "writes the cache" in x["note"]
            assert re.search(r"moves the arena onto huge pages, done [0-9.]+ s after it", x["note"]), x["note"]
            assert re.search(r"arena alone: [0-9.]+ s at the [0-9.]+ GB/s a fresh-memory probe", x["note"]), x["note"]
        if x["test"] == "load":
            assert "from the weight cache, on huge pages after" in x["note"]
        if x["test"].startswith("load"):
            assert float(x["load_s_median"]) > 0 and int(x["rss_after_load_bytes"]) > 0
            assert int(x["rss_peak_load_bytes"]) >= int(x["rss_after_load_bytes"]) and int(x["kv_bytes"]) > 0
        else:
            assert float(x["tps_median"]) > 0 and int(x["bytes_per_token"]) > 0
    assert sorted(p.name for p in models.glob("*.gguf")) == ["llama-tiny-random.BF16.gguf",
                                                              "llama-tiny-random.Q4_0.gguf"]


def _real_rows(run_id: str, size: str, quant: str, zen_tg: float, workload="full") -> list[dict]:
    base = {c: "" for c in real_bench.REAL_COLUMNS}
    base.update(run_id=run_id, date=run_id, commit="abc1234", cpu="Test_CPU", workload=workload, isa="avx512",
                model_size=size, model=f"llama-{size}-random.{quant}.gguf", quant=quant, file_bytes=960_000_000,
                weights="random", threads=2, steal_pct=0.5, load1_start=0.3)
    peer = dict(engine="llama.cpp-native", build="native (AVX-512)")
    return [dict(base, engine="zen5", build="matmul=int8", test="tg128", n_tokens=128, repeats=3,
                 tps_median=zen_tg, bytes_per_token=900_000_000, achieved=zen_tg * 0.9, unit="GB/s",
                 roof=30.0, frac_roof=round(zen_tg * 0.9 / 30, 3)),
            dict(base, **peer, test="tg128", n_tokens=128, repeats=3, tps_median=10.0, bytes_per_token=900_000_000),
            dict(base, engine="zen5", build="matmul=int8", test="pp512", n_tokens=512, repeats=3, tps_median=60.0,
                 roof=300.0, frac_roof=0.4),
            dict(base, **peer, test="pp512", n_tokens=512, repeats=3, tps_median=40.0),
            dict(base, engine="zen5", test="load", repeats=3, load_s_median=4.5, rss_peak_load_bytes=2_100_000_000,
                 rss_after_load_bytes=1_050_000_000, kv_bytes=80_000_000),
            dict(base, engine="zen5", test="load_first", repeats=3, load_s_median=9.5,
                 rss_peak_load_bytes=2_200_000_000, rss_after_load_bytes=1_060_000_000, kv_bytes=80_000_000),
            dict(base, **peer, test="load", repeats=3, load_s_median=3.0, rss_peak_load_bytes=1_000_000_000,
                 rss_after_load_bytes=990_000_000)]


def test_report_renders_real_model_rows_beside_the_135m_ones(tmp_path):
    import test_bench

    test_bench._fake_results(tmp_path, "2026-01-02T00:00:00", 300.0)
    only_135m = report.render(tmp_path)
    path = tmp_path / "Test_CPU-real.csv"
    rows = (_real_rows("2026-02-01T00:00:00", "1.7b", "Q4_0", 12.0)
            + _real_rows("2026-02-02T00:00:00", "1.7b", "Q4_0", 15.0)   # the latest run of (1.7b, Q4_0) wins
            + _real_rows("2026-02-01T00:00:00", "1.7b", "BF16", 3.0)    # kept: BF16's latest is the older run
            + _real_rows("2026-02-03T00:00:00", "8b", "Q8_0", 2.0, workload="custom")
            + _real_rows("2026-02-04T00:00:00", "tiny", "Q4_0", 99.0)   # the smoke shape never renders
            + _real_rows("2026-02-04T00:00:00", "8b", "Q4_1", 99.0, workload="quick")
            # a later run at 1 thread only (--threads 1): it replaces the 1-thread rows, not the 2-thread ones
            + [dict(r, threads=1) for r in _real_rows("2026-02-05T00:00:00", "1.7b", "Q4_0", 21.0, workload="custom")])
    rows.append(dict(rows[0], run_id="2026-02-03T00:00:00", model_size="8b", quant="Q8_0", engine="zen5",
                     test="failed", threads=1, note="zen5 child failed (signal 9, killed: out of memory?)"))
    for r in rows:  # the first loads' fresh-memory probe, as real_bench notes it (from 2026-12-04 on)
        if r["test"] == "load_first" and r["model_size"] == "8b" and r["quant"] == "Q8_0":
            r["note"] = ("...; first touching the 8.50 GB arena alone: 4.25 s at the 2.00 GB/s a fresh-memory probe "
                         "(2 threads, as many as packed the arena) measured in the same process after the load")
        if r["test"] == "tg128" and r["engine"] == "zen5" and r["quant"] == "Q8_0":  # probed around each decode
            r.update(frac_roof=0.85, note="roof: the DRAM read probed right before and after each decode (means "
                                          "20.1, 22.4, 21.0 GB/s); over the run's highest probe (26.0 GB/s): 69.2%")
    harness.append_csv(path, real_bench.REAL_COLUMNS, rows)
    text = report.render(tmp_path)
    assert text.startswith(only_135m + "\n\n### Real model sizes\n")
    real = text[len(only_135m):]
    assert "**random weights**" in real and "speed does not depend on the weights' values" in real
    assert "| model | weights | threads | test | zen5 | llama.cpp native (AVX-512) | zen5 of roof |" in real
    assert "| 1.7B | Q4_0 | 2 | tg128 | **15.0** | 10.0 (1.50x) | 45% |" in real
    assert "| 1.7B | Q4_0 | 1 | tg128 | **21.0** | 10.0 (2.10x) | 63% |" in real
    assert "| 1.7B | Q4_0 | 2 | pp512 | **60.0** | 40.0 (1.50x) | 40% |" in real
    # each run names the roofs its rows were measured against (they move from run to run on a VM)
    assert "load average 0.3 at the start; roofs at 2 threads: DRAM read 30 GB/s, int8 peak 300 GOP/s)" in real
    assert "| 1.7B | BF16 | 2 | tg128 | 3.0 | **10.0 (0.30x)** | 9% |" in real
    assert "| 8B | Q8_0 | 2 | tg128 | 2.0 | **10.0 (0.20x)** | 85% (69%) |" in real
    assert "12.0" not in real and "99.0" not in real and "tiny" not in real.lower()
    assert real.index("| 1.7B | Q4_0 |") < real.index("| 1.7B | BF16 |") < real.index("| 8B | Q8_0 |")
    first = "| 1.7B | Q4_0 | 0.96 GB | 0.90 GB | zen5 first load | 2 | 9.50 s | 2.20 GB | 1.06 GB | 0.08 GB |"
    cached = "| 1.7B | Q4_0 | 0.96 GB | 0.90 GB | zen5 | 2 | 4.50 s | 2.10 GB | 1.05 GB | 0.08 GB |"
    assert first in real and cached in real and real.index(first) < real.index(cached)
    assert ("| 1.7B | Q4_0 | 0.96 GB | 0.90 GB | llama.cpp native (AVX-512) | 2 | 3.00 s | 1.00 GB | 0.99 GB | - |"
            in real)
    assert ("4 KiB pages in runs from 2026-12-07 on, huge pages before): 8B Q8_0 2t 4.25 s (2.00 GB/s, 2 thr.)."
            in real)
    assert "Not measured: zen5 8B Q8_0 1t: zen5 child failed (signal 9, killed: out of memory?)." in real
    # a results directory with only real-size runs still renders
    for f in tmp_path.glob("Test_CPU-bench.csv"):
        f.unlink()
    assert report.render(tmp_path).startswith("### Real model sizes\n")


def test_the_roofs_are_the_best_of_probes_at_the_start_and_the_end(tmp_path, monkeypatch):
    """A run's DRAM roof per thread count is the higher of a probe before the repetitions and one
    after them (roofline.best_of): one probe in a slow window (25 GB/s where the VM gives 37) made
    an 8B decode read as 118% of its roof."""
    import roofline

    probes = iter([{"read_dram_gbps": 25.0, "int8_gops": 330.0}, {"read_dram_gbps": 37.0, "int8_gops": 300.0}])
    monkeypatch.setattr(roofline, "measure", lambda threads, tier: next(probes))
    cfg = _parse("--model-size", "tiny", "--threads", "1", "--peers", "", "--models-dir", str(tmp_path / "models"),
                 "--out", str(tmp_path / "out"))
    run = real_bench.RealRun(cfg, log=lambda m: None)
    run.tier = "avx2"  # whatever this CPU has: the probes are faked
    seen = {}
    monkeypatch.setattr(real_bench.real_models, "ensure", lambda shape, q, models_dir, log: tmp_path / f"{q}.gguf")
    monkeypatch.setattr(run, "_repetitions", lambda cfg, n_ctx, cache_dir: None)
    monkeypatch.setattr(run, "_write", lambda: seen.update(run.roofs) or {})
    run.execute()
    assert seen == {1: {"read_dram_gbps": 37.0, "int8_gops": 330.0}}


def test_the_dram_roof_is_probed_again_after_every_block(tmp_path, monkeypatch):
    """Between the repetitions' blocks (every type and thread count) the DRAM read is probed again
    and the roof is the highest read of the run: probes at the start and the end only (15.6 / 29.0
    GB/s) left a 1.7B Q8_0 decode at 2 threads (29.6 GB/s) above its roof."""
    import roofline

    starts = iter([{"read_dram_gbps": 25.0, "int8_gops": 330.0}, {"read_dram_gbps": 28.0, "int8_gops": 300.0}])
    between = iter([30.0, 41.0, 33.0, 35.0])
    monkeypatch.setattr(roofline, "measure", lambda threads, tier: next(starts))
    monkeypatch.setattr(roofline, "dram_read", lambda threads, tier: next(between))

    class Engine:
        name = "zen5"

        def __init__(self, *args):
            pass

        def block(self, path, threads, tests, probe_tier=""):
            return {"build": "b", "isa": "avx2", "secs": {"tg128": 1.0}, "load_s": 0.1, "rss_peak": 1,
                    "rss_after": 1, "kv_bytes": 0}

    monkeypatch.setattr(real_bench, "Zen5Block", Engine)
    cfg = _parse("--model-size", "tiny", "--threads", "1", "--peers", "", "--types", "Q4_0,Q8_0", "--repeat", "2",
                 "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path / "out"))
    run = real_bench.RealRun(cfg, log=lambda m: None)
    run.tier = "avx2"  # whatever this CPU has: the probes are faked
    for q in ("Q4_0", "Q8_0"):
        (tmp_path / f"{q}.gguf").write_bytes(b"x")
    monkeypatch.setattr(real_bench.real_models, "ensure", lambda shape, q, models_dir, log: tmp_path / f"{q}.gguf")
    seen = {}
    monkeypatch.setattr(run, "_write", lambda: seen.update(run.roofs) or {})
    run.execute()
    assert run.dram_probes == {1: [30.0, 41.0, 33.0, 35.0]}  # 2 repetitions x 2 types
    assert seen == {1: {"read_dram_gbps": 41.0, "int8_gops": 330.0}}


def test_each_decode_is_divided_by_the_dram_probes_around_it(tmp_path, monkeypatch):
    """A tg row's fraction of the DRAM roof is the median over repetitions of each decode's GB/s
    over the mean of the probes right before and after it (as the DeepSeek V4 mode): this VM's
    bandwidth moved by 1.7x within seconds, so the run's highest probe, taken minutes away,
    understated what decode reached. The run's highest probe still gives the note's figure."""
    import roofline

    roofs = {"read_dram_gbps": 40.0, "read_llc_gbps": 60.0, "int8_gops": 300.0}
    monkeypatch.setattr(roofline, "measure", lambda threads, tier: dict(roofs))
    monkeypatch.setattr(roofline, "dram_read", lambda threads, tier: 40.0)
    given = iter([(2.0, 20.0), (1.0, 40.0), (1.6, 25.0)])  # (seconds for tg128, the probes' mean)
    asked = []

    class Engine:
        name = "zen5"

        def __init__(self, *args):
            pass

        def block(self, path, threads, tests, probe_tier=""):
            asked.append(probe_tier)
            secs, roof = next(given)
            return {"build": "b", "isa": "avx2", "secs": {"tg128": secs}, "tg_roofs": {"tg128": roof},
                    "load_s": 0.1, "rss_peak": 1, "rss_after": 1, "kv_bytes": 0}

    monkeypatch.setattr(real_bench, "Zen5Block", Engine)
    monkeypatch.setattr(real_bench, "matmul_stats", lambda path: (10**9, 10**9))  # 1 GB read per token
    cfg = _parse("--model-size", "tiny", "--threads", "1", "--peers", "", "--types", "Q4_0", "--repeat", "3",
                 "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path / "out"))
    run = real_bench.RealRun(cfg, log=lambda m: None)
    run.tier = "avx2"  # whatever this CPU has: the probes are faked
    (tmp_path / "Q4_0.gguf").write_bytes(b"x")
    monkeypatch.setattr(real_bench.real_models, "ensure", lambda shape, q, models_dir, log: tmp_path / "Q4_0.gguf")
    rows = {}
    monkeypatch.setattr(run, "_write", lambda: rows.update({r["test"]: r for r in run.rows()}) or {})
    run.execute()
    assert asked == ["avx2"] * 3  # the engine was asked to probe around its decode
    tg = rows["tg128"]
    # 64 / 2.0 = 32 GB/s over 20 (160%), 128 over 40 (320%), 80 over 25 (320%): median 320%
    assert tg["frac_roof"] == 3.2 and tg["roof"] == 25.0
    assert tg["tps_median"] == 80.0 and "over the run's highest probe (40.0 GB/s): 200.0%" in tg["note"]


def test_the_cached_load_finds_the_cache_file_in_the_page_cache(tmp_path, monkeypatch):
    """zen5's cached load runs after the cache file, which the first load wrote, has been read
    through once, as the peer's GGUF is warm: under memory pressure the write left part of an 8B
    Q8_0 cache out of the page cache (a cached load of 1.13 s where later ones took 0.59-0.67)."""
    block = real_bench.Zen5Block("avx512", 64, str(tmp_path))
    events = []

    def child(path, threads, tests, probe_tier=""):
        if not tests:
            (tmp_path / "m.arena").write_bytes(bytes(range(256)) * 4096)
            events.append("first load")
            return {"cache": "written"}
        events.append("cached load")
        return {"cache": "hit"}

    read = real_bench.read_through

    def read_through(f):
        events.append(("read", Path(f).name))
        read(f)

    monkeypatch.setattr(block, "child", child)
    monkeypatch.setattr(real_bench, "read_through", read_through)
    res = block.block("m.gguf", 1, ["tg128"])
    assert events == ["first load", ("read", "m.arena"), "cached load"]
    assert res["first"] == {"cache": "written"} and res["cache"] == "hit"


def test_every_engine_loads_the_gguf_from_the_page_cache(tmp_path, monkeypatch):
    """Before each engine's block the GGUF is read through, untimed: the blocks before may have
    evicted it (an 8B Q8_0 zen5 first load that found it on disk took 33.8 s against an 8.6 s
    fresh-memory floor, while llama.cpp right after it found it cached)."""
    events = []

    class Engine:
        def __init__(self, name):
            self.name = name

        def block(self, path, threads, tests, probe_tier=""):
            events.append((self.name, Path(path).name))
            return {"build": "b", "isa": "avx2", "secs": {"tg128": 1.0}, "load_s": 0.1, "rss_peak": 1,
                    "rss_after": 1, "kv_bytes": 0}

    cfg = _parse("--model-size", "tiny", "--threads", "1", "--peers", "", "--types", "Q4_0", "--repeat", "1",
                 "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path / "out"))
    run = real_bench.RealRun(cfg, log=lambda m: None)
    run.files = {"Q4_0": str(tmp_path / "Q4_0.gguf")}
    monkeypatch.setattr(real_bench, "read_through", lambda f: events.append(("read", Path(f).name)))
    monkeypatch.setattr(run, "_probe_dram", lambda threads: None)
    run._block([Engine("zen5"), Engine("llama")], 1, "Q4_0", 1, 1, ["tg128"])  # repetition 1: the peer first
    assert events == [("read", "Q4_0.gguf"), ("llama", "Q4_0.gguf"), ("read", "Q4_0.gguf"), ("zen5", "Q4_0.gguf")]
    assert not run.failed
