"""`python -m zen5 bench --deepseek-v4` (bench/dsv4_bench.py): its CLI, its operation count against
the spec's figure for V4 Flash, the projection's arithmetic, and one child measurement on a tiny
real-structure checkpoint (the engine's stage clocks and byte accounting through the bench code).
The timings themselves are recorded runs (bench/results/<cpu>-dsv4.csv), not tests."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from modules import load_file  # noqa: E402

harness = load_file(ROOT / "bench" / "harness.py", "bench_harness_dsv4_under_test")
dsv4_bench = load_file(ROOT / "bench" / "dsv4_bench.py", "dsv4_bench_under_test")


def _parse(*argv):
    import argparse
    p = argparse.ArgumentParser()
    harness.add_arguments(p)
    return harness.config_from_args(p.parse_args(list(argv)))


def test_cli_takes_the_deepseek_v4_mode_and_its_depths():
    cfg = _parse("--deepseek-v4")
    assert (cfg.deepseek_v4, cfg.depths, cfg.repeat, cfg.gen, cfg.workload) == (True, (0, 2048, 8192), 3, 32, "full")
    quick = _parse("--deepseek-v4", "--quick")
    assert (quick.depths, quick.repeat, quick.gen) == ((0, 128), 1, 4)
    assert _parse("--deepseek-v4", "--depths", "0,512").depths == (0, 512)
    with pytest.raises(ValueError, match="multiples of 128"):
        _parse("--deepseek-v4", "--depths", "100")


def test_v4_flash_matmul_operations_match_the_spec():
    # spec deepseek-v4-architecture.md 4.7: "~26.5 GFLOP/token for the matmuls"
    flash = dsv4_bench.flash_config()
    ratios = flash["compress_ratios"][:flash["num_hidden_layers"]]
    ops = sum(sum(dsv4_bench.matmul_ops(flash, r)) for r in ratios) + 2.0 * flash["vocab_size"] * flash["hidden_size"]
    assert ops == pytest.approx(26.5e9, rel=0.02)


def test_kv_bytes_follow_the_window_the_compressed_rows_and_the_indexer():
    cfg = dsv4_bench.flash_config()
    row = cfg["head_dim"] * 4
    assert dsv4_bench.kv_bytes(cfg, 0, 0) == row  # the token's own row
    assert dsv4_bench.kv_bytes(cfg, 0, 8191) == 128 * row  # the window only
    assert dsv4_bench.kv_bytes(cfg, 128, 8191) == 128 * row + 64 * row
    # ratio 4: every indexer row (128 floats) is scored, the top 512 compressed rows are read
    assert dsv4_bench.kv_bytes(cfg, 4, 8191) == 128 * row + 2048 * 128 * 4 + 512 * row


def test_projection_is_the_sum_of_the_stages_times_the_layer_counts():
    base = {"engine": "zen5", "threads": 1, "depth": 0, "read_dram_gbps": 20.0, "int8_gops": 400.0}
    secs = {"rest": 0.01, "attn_r0": 0.001, "ffn_r0": 0.002, "attn_r4": 0.003, "ffn_r4": 0.002, "attn_r128": 0.001,
            "ffn_r128": 0.002}
    rows = [dict(base, test="tg", stage=s, seconds_per_token=str(v), bytes_per_token=10**7) for s, v in secs.items()]
    text = dsv4_bench.projection("run", rows, [0])
    # V4 Flash: 2 window-only, 21 ratio-4 and 20 ratio-128 layers
    t = 0.01 + 2 * 0.003 + 21 * 0.005 + 20 * 0.003
    b = 10**7 * (1 + 2 * 43)
    assert f"| 1 | 0 | decode | {b / 1e9:.2f} GB | {1 / t:.2f} tok/s | {b / t / 1e9 / 20:.1%} |" in text
    assert "Assumed" in text and "EPYC 9575F" in text


def test_a_child_measures_every_stage_of_a_tiny_model(tmp_path):
    from dsv4_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny", shards=1)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    tier = "avx512" if " avx512_vnni" in flags else "avx2"
    out = dsv4_bench.child(str(ckpt), 1, [0, 128], 2, 1, "off", tier)
    n = len(out["layer_bytes"])
    assert n >= 3 and out["head_bytes"] > 0 and out["expert_bytes"] > 0
    for d in ("0", "128"):
        for test in ("tg", "pp"):
            stages = out["depths"][d][test]
            assert len(stages) == 2 * n + 1 and all(s > 0 for s in stages)
        # the DRAM roof probed around the decode repetition (a real read of 1 GiB): plausible GB/s,
        # beside that repetition's stage times
        (roof,) = out["depths"][d]["tg_roofs"]
        assert 1.0 < roof < 2000.0 and out["depths"][d]["tg_reps"] == [out["depths"][d]["tg"]]
    # the experts the depth-0 prefill read, per layer: those a fresh load routes the same tokens to
    counts = dsv4_bench.route_counts(str(ckpt), dsv4_bench.PREFILL)
    assert out["depths"]["0"]["pp_experts"] == [sum(1 for c in layer if c) for layer in counts]


def test_balancing_evens_each_layers_expert_load_through_its_router_bias(tmp_path):
    """balance_router on a tiny score-routed checkpoint: the bias tensors are rewritten in place,
    the spread of tokens per expert narrows on every layer, the rounds are recorded beside the
    checkpoint and a GGUF converted from the old values is gone."""
    import numpy as np

    from dsv4_checkpoint import make_checkpoint
    from zen5.loader.safetensors import read_safetensors_header

    ckpt = make_checkpoint(tmp_path / "tiny", shards=1, overrides={"num_hash_layers": 0})
    gguf = ckpt.with_name(ckpt.name + ".gguf")
    gguf.write_bytes(b"converted from the old bias")
    (shard,) = ckpt.glob("*.safetensors")
    before_bytes = shard.read_bytes()
    first = dsv4_bench.route_counts(str(ckpt), dsv4_bench.BALANCE_TOKENS)
    out = dsv4_bench.balance_router(ckpt, lambda msg: None, rounds=3)
    last = dsv4_bench.route_counts(str(ckpt), dsv4_bench.BALANCE_TOKENS)
    assert out["rounds"][0] == [{"experts_used": int(np.count_nonzero(c)), "max": max(c), "min": min(c)}
                                for c in first]
    for a, b in zip(first, last):
        assert sum(a) == sum(b)  # every token still goes to top_k experts
        assert max(b) - min(b) < max(a) - min(a)
    changed = np.flatnonzero(np.frombuffer(shard.read_bytes(), np.uint8) != np.frombuffer(before_bytes, np.uint8))
    biases = [offsets for name, (_, _, offsets) in read_safetensors_header(shard).items()
              if name.endswith("ffn.gate.bias")]
    assert changed.size > 0 and all(any(lo <= i < hi for lo, hi in biases) for i in changed)  # the biases only
    assert json.loads((ckpt / dsv4_bench.BALANCED).read_text()) == out and not gguf.exists()


def test_rows_give_each_stage_its_figures_and_the_peer_the_same_totals():
    class Peer:
        name, isa = "llama.cpp-native", "avx512"

    cfg = dsv4_bench.bench_config(16)
    secs = [0.001] * 6 + [0.01]
    res = {"isa": "avx512", "layer_bytes": [[100, 200, 10]] * 3, "head_bytes": 1000,
           "depths": {"0": {"tg": secs, "pp": secs}}}
    run = dsv4_bench.DeepSeekV4Run(harness.BenchConfig(deepseek_v4=True, repeat=1), log=lambda m: None)
    rows = run.rows("run", {1: res}, {1: {"read_dram_gbps": 20.0, "int8_gops": 400.0}}, cfg,
                    {1: {(0, "tg"): 0.05}}, (Peer(), None))
    zen5 = {(r["test"], r["stage"]): r for r in rows if r["engine"] == "zen5"}
    assert len(zen5) == 2 * 8  # 6 layer halves, the rest and the total, for tg and pp512
    total = zen5[("tg", "total")]
    assert float(total["seconds_per_token"]) == pytest.approx(0.016)
    assert total["read_dram_gbps"] == 20.0 and total["frac_dram_roof"] == round(
        total["bytes_per_token"] / 0.016 / 1e9 / 20.0, 3)
    assert total["bytes_per_token"] == 3 * (100 + 200 + 6 * 10) + sum(
        dsv4_bench.kv_bytes(cfg, r, 0) for r in dsv4_bench.KINDS) + 1000 + 2 * cfg["hidden_size"]
    (peer,) = [r for r in rows if r["engine"] == "llama.cpp-native"]
    assert (peer["test"], peer["bytes_per_token"]) == ("tg", total["bytes_per_token"])
    assert peer["gbps"] == round(total["bytes_per_token"] / 0.05 / 1e9, 2)


def test_a_prefills_moe_halves_read_the_experts_it_was_routed_to_and_show_their_roofline_bound():
    cfg = dsv4_bench.bench_config(16)
    secs = [0.001] * 6 + [0.01]
    hit = [16, 12, 9]
    res = {"isa": "avx512", "layer_bytes": [[100, 2 * 10**6, 2 * 10**8]] * 3, "head_bytes": 1000,
           "depths": {"0": {"tg": secs, "pp": secs, "pp_experts": hit}}}
    run = dsv4_bench.DeepSeekV4Run(harness.BenchConfig(deepseek_v4=True, repeat=1), log=lambda m: None)
    rows = run.rows("run", {1: res}, {1: {"read_dram_gbps": 20.0, "int8_gops": 4000.0}}, cfg, {}, None)
    pp = {r["stage"]: r for r in rows if r["test"] == "pp512"}
    for i, ratio in enumerate(dsv4_bench.KINDS):
        r = pp[f"ffn_r{ratio}"]
        b = (2 * 10**6 + hit[i] * 2 * 10**8) / dsv4_bench.PREFILL  # each weight the half used, once per prefill
        assert r["bytes_per_token"] == round(b) and r["frac_dram_roof"] == round(b / 0.001 / 1e9 / 20.0, 3)
        assert r["frac_int8_peak"] == round(dsv4_bench.matmul_ops(cfg, ratio)[1] / 0.001 / 1e9 / 4000.0, 3)
        assert "bytes_per_token" not in pp[f"attn_r{ratio}"]  # no bytes where they are not counted
    assert "bytes_per_token" not in pp["rest"] and "bytes_per_token" not in pp["total"]
    text = dsv4_bench.projection("run", rows, [0])
    for i, ratio in enumerate(dsv4_bench.KINDS):
        r = pp[f"ffn_r{ratio}"]
        fi, fd = r["frac_int8_peak"], r["frac_dram_roof"]
        # the bound: the lower of the peak and the DRAM roof x operations per byte, of the peak
        bound = min(4000.0, 20.0 * r["gops"] / r["gbps"]) / 4000.0
        assert min(1.0, fi / fd) == pytest.approx(bound, rel=0.02) and bound < 1.0  # bound by DRAM here
        assert (f"| 1 | 0 | ratio {ratio} | {r['gops']:.0f} | {fi:.1%} | {r['bytes_per_token'] / 1e6:.2f} MB | "
                f"{fd:.1%} | {min(1.0, fi / fd):.1%} | {max(fi, fd):.1%} |") in text
    # the prefill is projected onto the named Zen 5 (not an amx run): its own bound for the same halves
    z = dsv4_bench.ZEN5
    z_bw, z_int8 = z["dram_peak_gbps"] * z["dram_sustained"], z["cores"] * z["ghz"] * z["int8_ops_per_cycle"]
    zb = [min(1.0, z_bw * r["gops"] / r["gbps"] / z_int8) for r in (pp[f"ffn_r{k}"] for k in dsv4_bench.KINDS)]
    assert f"roofline bound is {min(zb):.0%}-{max(zb):.0%} of its int8 peak" in text and "all below that bound" in text
    slow = run.rows("run", {1: res}, {1: {"read_dram_gbps": 20.0, "int8_gops": 40.0}}, cfg, {}, None)
    assert "and 3 of the 3 exceed it" in dsv4_bench.projection("run", slow, [0])  # fractions above its bound
    res["isa"] = "amx"  # no prefill projected onto Zen 5, so no such check
    assert "named Zen 5 the same halves" not in dsv4_bench.projection("run", run.rows(
        "run", {1: res}, {1: {"read_dram_gbps": 20.0, "int8_gops": 4000.0}}, cfg, {}, None), [0])
    # an old result without the routing: no bytes, and no section
    del res["depths"]["0"]["pp_experts"]
    rows = run.rows("run", {1: res}, {1: {"read_dram_gbps": 20.0, "int8_gops": 4000.0}}, cfg, {}, None)
    assert all("bytes_per_token" not in r for r in rows if r["test"] == "pp512")
    assert "MoE halves" not in dsv4_bench.projection("run", rows, [0])


def test_decode_fractions_pair_each_repetition_with_the_roof_probed_around_it():
    cfg = dsv4_bench.bench_config(16)
    base = [0.001] * 6 + [0.01]
    reps = [[x * k for x in base] for k in (1, 2, 3)]  # the total: 0.016, 0.032, 0.048 s
    res = {"isa": "avx512", "layer_bytes": [[10**8, 2 * 10**8, 10**7]] * 3, "head_bytes": 10**9,
           "depths": {"0": {"tg": reps[1], "pp": base, "tg_reps": reps, "tg_roofs": [40.0, 10.0, 40.0]}}}
    run = dsv4_bench.DeepSeekV4Run(harness.BenchConfig(deepseek_v4=True, repeat=3), log=lambda m: None)
    rows = run.rows("run", {1: res}, {1: {"read_dram_gbps": 20.0, "int8_gops": 400.0}}, cfg, {}, None)
    total = next(r for r in rows if (r["test"], r["stage"]) == ("tg", "total"))
    b = total["bytes_per_token"] / 1e9
    # per repetition b/0.016/40, b/0.032/10, b/0.048/40: the median is the first, not the ratio of
    # the medians (b/0.032/40); the roof shown is the median probe
    assert total["frac_dram_roof"] == round(b / 0.016 / 40, 3) != round(b / 0.032 / 40, 3)
    assert total["read_dram_gbps"] == 40.0
    # the projection pairs the full model's per-repetition time with the same roofs
    text = dsv4_bench.projection("run", rows, [0], {1: res})
    count = {0: 2, 4: 21, 128: 20}
    full = [rs[-1] + sum(count[r] * (rs[2 * i] + rs[2 * i + 1]) for i, r in enumerate(dsv4_bench.KINDS))
            for rs in reps]
    rest = next(r for r in rows if (r["test"], r["stage"]) == ("tg", "rest"))["bytes_per_token"]
    layer = {r["stage"]: r["bytes_per_token"] for r in rows if r["test"] == "tg"}
    fb = rest + sum(count[r] * (layer[f"attn_r{r}"] + layer[f"ffn_r{r}"]) for r in dsv4_bench.KINDS)
    want = sorted(fb / x / 1e9 / g for x, g in zip(full, [40.0, 10.0, 40.0]))[1]
    assert f"| {1 / full[1]:.2f} tok/s | {want:.1%} |" in text


def test_the_run_measures_on_the_cpus_best_tier_unless_told(tmp_path, monkeypatch):
    """The tier the roofs are probed on and the children run: the CPU's best, or --isa's (it was
    avx512 always, so the mode died of SIGILL on an AVX2-only CPU)."""
    import roofline
    from zen5 import _native

    class Stop(Exception):
        pass

    seen = []

    def measure(threads, tier):
        seen.append(tier)
        raise Stop

    monkeypatch.setattr(dsv4_bench, "model_dir", lambda models, experts, log: tmp_path)
    monkeypatch.setattr(roofline, "measure", measure)
    for extra in ((), ("--isa", "ref")):
        cfg = _parse("--deepseek-v4", "--peers", "", "--out", str(tmp_path), *extra)
        with pytest.raises(Stop):
            dsv4_bench.DeepSeekV4Run(cfg, log=lambda m: None).execute()
    assert seen == [harness.best_tier(_native.isa_tiers()), "ref"]


def test_the_roofs_are_the_best_of_probes_before_and_after_the_work(tmp_path, monkeypatch):
    """A thread count's roofs are probed before its child runs and again after it (and the peer),
    each figure the higher of the two: one probe in a slow window of a shared VM (an int8 peak of
    190 GOP/s where others read 320) must not become the roof every prefill fraction divides by."""
    import subprocess

    import roofline

    class Stop(Exception):
        pass

    probes = iter([{"read_dram_gbps": 20.0, "int8_gops": 190.0}, {"read_dram_gbps": 18.0, "int8_gops": 320.0}])
    monkeypatch.setattr(roofline, "measure", lambda threads, tier: next(probes))
    monkeypatch.setattr(dsv4_bench, "model_dir", lambda models, experts, log: tmp_path)
    child = {"load_s": 1.0, "experts_s": 1.0, "expert_bytes": 10**9, "weight_cache": {"status": "hit"}}
    ran = []

    def run(args, **kw):
        ran.append(args)
        return subprocess.CompletedProcess(args, 0, stdout=json.dumps(child) + "\n", stderr="")

    monkeypatch.setattr(dsv4_bench.subprocess, "run", run)
    seen = {}

    def rows(self, run_id, results, roofs, cfg, peer, llama):
        seen.update(roofs)
        raise Stop

    monkeypatch.setattr(dsv4_bench.DeepSeekV4Run, "rows", rows)
    cfg = _parse("--deepseek-v4", "--peers", "", "--threads", "1", "--out", str(tmp_path))
    with pytest.raises(Stop):
        dsv4_bench.DeepSeekV4Run(cfg, log=lambda m: None).execute()
    assert len(ran) == 1 and "--child" in ran[0]
    assert seen == {1: {"read_dram_gbps": 20.0, "int8_gops": 320.0}}


def test_the_llama_peer_is_the_first_of_the_tiers_builds_that_is_there(tmp_path, monkeypatch):
    """On an AMX Xeon the AVX-512 tier's builds are llama.cpp-avx512 then llama.cpp-amx: with only
    the native (AMX) one built the run compares with it, rather than with nothing."""
    import peers
    exe = tmp_path / "build-native" / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("ZEN5_PEERS", str(tmp_path))
    monkeypatch.setenv("ZEN5_CPU_FLAGS", "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8")
    assert peers.default_peers("amx", "amx", peers.cpu_flags())[:2] == ("llama.cpp-avx512", "llama.cpp-amx")
    model = tmp_path / "dsv4"
    model.with_name("dsv4.gguf").write_bytes(b"")  # already converted
    logged = []
    run = dsv4_bench.DeepSeekV4Run(_parse("--deepseek-v4", "--out", str(tmp_path)), log=logged.append)
    bench, gguf = run.llama(model, "amx")
    assert (bench.name, bench.exe, gguf) == ("llama.cpp-amx", exe, model.with_name("dsv4.gguf"))
    assert any("llama.cpp-avx512 skipped" in m for m in logged)
    exe.unlink()  # neither built: no peer, and the run goes on without one
    assert run.llama(model, "amx") is None


def test_prefill_on_amx_tiles_is_not_projected_onto_zen5():
    """The amx tier's prefill is a fraction of the tile unit's peak, which Zen 5 lacks: its line
    says so instead of scaling that fraction by Zen 5's vpdpbusd peak; decode is projected."""
    secs = {"rest": 0.01, "attn_r0": 0.001, "ffn_r0": 0.002, "attn_r4": 0.003, "ffn_r4": 0.002, "attn_r128": 0.001,
            "ffn_r128": 0.002}

    def rows(isa):
        base = {"engine": "zen5", "isa": isa, "threads": 1, "depth": 0, "read_dram_gbps": 20.0, "int8_gops": 6000.0}
        return [dict(base, test=test, stage=s, seconds_per_token=str(v), bytes_per_token=10**7)
                for test in ("tg", "pp512") for s, v in secs.items()]

    amx, avx512 = dsv4_bench.projection("run", rows("amx"), [0]), dsv4_bench.projection("run", rows("avx512"), [0])
    pp = lambda text: next(line for line in text.splitlines() if "| prefill 512 |" in line)  # noqa: E731
    tg = lambda text: next(line for line in text.splitlines() if "| decode |" in line)  # noqa: E731
    assert pp(amx).endswith("| - (AMX here) |") and pp(avx512).endswith(" tok/s |")
    assert pp(amx).rsplit("|", 2)[0] == pp(avx512).rsplit("|", 2)[0]  # the same figures for this machine
    assert tg(amx) == tg(avx512)
    assert "Zen 5 has no AMX" in amx and "--isa avx512" in amx and "AMX" not in avx512


def test_the_report_names_each_projections_tier_best_first(tmp_path):
    """report.py renders every `<cpu>[-<tier>]-dsv4-projection.md`: its title gains the tier the
    run's rows in the CSV beside it name (and the `--isa` that forced it), the CPU's best tier's
    before a forced one's."""
    report = load_file(ROOT / "bench" / "report.py", "bench_report_dsv4_under_test")
    for stem, run, isa in (("Test_CPU-avx512", "2026-12-05T13:17:39", "avx512"),
                           ("Test_CPU", "2026-12-05T13:58:21", "amx")):
        (tmp_path / f"{stem}-dsv4-projection.md").write_text(
            f"# DeepSeek V4 Flash projected from its real-width layers (run {run}, Test_CPU)\n\nbody {isa}\n")
        with open(tmp_path / f"{stem}-dsv4.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, dsv4_bench.COLUMNS)
            w.writeheader()
            w.writerow({c: "" for c in dsv4_bench.COLUMNS} | dict(run_id="older", engine="zen5", isa="ref"))
            w.writerow({c: "" for c in dsv4_bench.COLUMNS} | dict(run_id=run, engine="zen5", isa=isa))
    text = report.render(tmp_path)
    best = ("### DeepSeek V4 Flash projected from its real-width layers (run 2026-12-05T13:58:21, Test_CPU, "
            "AMX (AVX-512 + AMX int8 prefill) tier)\n\nbody amx")
    forced = ("### DeepSeek V4 Flash projected from its real-width layers (run 2026-12-05T13:17:39, Test_CPU, "
              "AVX-512 tier, forced: `--isa avx512`)\n\nbody avx512")
    assert best in text and forced in text and text.index(best) < text.index(forced)
