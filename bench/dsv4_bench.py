"""`python -m zen5 bench --deepseek-v4`: DeepSeek V4 Flash's real-width layers, timed and projected
(issue 22).

Model: V4 Flash's real widths and formats (tests/dsv4_formats.py write_inventory: FP8 dense
projections with 128 x 128 block scales, MXFP4 routed experts, BF16 embedding / head / router,
the real 129,280-token vocabulary) with one layer of each kind: window-only (ratio 0), ratio 4
with the indexer, ratio 128. Each layer has all 256 routed experts (6 active) and the shared
one, so decode streams 6 experts that are not in any cache and a 512-token prefill routes about
12 tokens to each expert, as in the real model: the router's bias is balanced on the bench's
token stream once, after the model is written (balance_router; unbalanced, random weights sent a
prefill to about 145 of the 256 experts, up to 265 tokens to one). Random values (speed does not
depend on them), written once to ~/.cache/zen5/bench-models/dsv4-layers (about 12.6 GB).

Per thread count (a fresh process each, so nothing warm carries over), per context depth d
(the context first filled to d tokens): decode of --gen tokens, then a 512-token prefill, each
rewound afterwards (d is a multiple of 128, so the rewinds are exact truncations / block
rebuilds), --repeat times, median. The engine's stage clocks (V4Context::stage_seconds) split
the time per layer into its attention half and its FFN (MoE) half, plus the rest (embedding,
head).

Figures:
  decode  bytes per token of each stage (the matrices it reads, layer_bytes, with 6 of the 256
          experts, plus the KV rows attention reads at depth d: the 128-row window, the
          compressed rows, the indexer's rows and its top-512 picks) over the stage's time, as
          a fraction of the DRAM read roof (roofline.py) probed right before and right after
          each decode repetition: each repetition over the mean of its two probes, the median
          of those fractions. The bandwidth this shared host gives a guest moves by a factor of
          1.7 from one second to the next, so a roof measured minutes away from the timing made
          the same kernel look 25% better or worse, and above 100% of its roof;
  prefill the stage's matmul operations (2 x multiply-adds, from the config; attention scores
          and softmax not counted, so a lower bound) over its time, as a fraction of the tier's
          int8 peak (amx: the tile unit's TDPBSSD, not vpdpbusd) measured in the same run: probed
          before and after the thread count's work, the higher kept (one probe in a slow second
          read 190 GOP/s where others read 320). A prefill's MoE halves also get the bytes
          they read: the layer's FFN weights outside the routed experts plus each expert the
          prefill's tokens were routed to (ctx.last_experts), once per prefill, over its tokens;
          over the DRAM roof that gives their roofline bound (moe_prefill).
Projection (printed and written to <cpu>-dsv4-projection.md): the full V4 Flash (43 layers: 2
window-only, 21 ratio-4, 20 ratio-128 by its compress_ratios) as the sum of the measured stages,
for this machine and for a named Zen 5 EPYC, with every assumption stated.

llama.cpp (the tier's build of bench/build_peers.sh, when built): its pinned source runs DeepSeek
V4 (its deepseek4 architecture: hyper-connections, both compressors, the indexer, sinks). The same
checkpoint becomes a GGUF through its own converter (bench/dsv4_llama.py: MXFP4 experts as they
are, the FP8 projections as Q8_0, as zen5 holds them), once, beside the checkpoint; llama-bench
then times pp512 and tg --gen at the same depths and threads (`-d`), right after zen5's child of
that thread count (depths up to LLAMA_MAX_DEPTH). llama-bench gives whole-model times only, so
the ratio is of the totals.
--peers "" skips it.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (HERE, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from results_log import commit, cpu_name  # noqa: E402
from workload import wait_promoted  # noqa: E402

KINDS = (0, 4, 128)  # the bench model's layers, one of each compress ratio
PREFILL = 512
# llama-bench fills the context to -d again before every repetition of every test (at about 40
# tokens/s here on these layers), so its depths stop here; zen5's go on.
LLAMA_MAX_DEPTH = 2048
COLUMNS = ("run_id", "date", "commit", "cpu", "engine", "isa", "threads", "depth", "test", "stage", "seconds_per_token",
           "bytes_per_token", "gbps", "frac_dram_roof", "gops", "frac_int8_peak", "read_dram_gbps", "int8_gops",
           "repeats")
# The named machine of the projection and what is assumed about it (spec deepseek-v4-architecture.md 4.7).
ZEN5 = {
    "name": "AMD EPYC 9575F (Zen 5, 64 cores, one socket, 12 channels of DDR5-6400)",
    "dram_peak_gbps": 614.4,    # 12 channels x 8 bytes x 6400 MT/s
    "dram_sustained": 0.75,     # of the peak, what a read stream sustains (spec 4.7: ~450-500 GB/s)
    "cores": 64, "ghz": 3.3,    # base clock; AVX-512 all-core clocks are at or above it
    "int8_ops_per_cycle": 256,  # per core: two 512-bit vpdpbusd per cycle, 64 multiply-adds each
}


def flash_config() -> dict:
    import dsv4_formats as fmt
    return dict(fmt.V4_FLASH_CONFIG)


def bench_config(experts: int = 256) -> dict:
    cfg = flash_config()
    cfg.update(num_hidden_layers=len(KINDS), compress_ratios=list(KINDS), num_hash_layers=0, n_routed_experts=experts)
    return cfg


def model_dir(models_dir: Path, experts: int, log) -> Path:
    """The bench checkpoint, written once (into a temporary folder, renamed when complete), its
    router then balanced (balance_router; the 256-expert model only: a smoke run's is not)."""
    import dsv4_formats as fmt
    out = models_dir / ("dsv4-layers" if experts == 256 else f"dsv4-layers-e{experts}")
    if (out / "config.json").exists():
        if experts == 256 and not (out / BALANCED).exists():
            balance_router(out, log)
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"writing the DeepSeek V4 real-width bench checkpoint to {out} (random values; once)")
    t0 = time.time()
    models_dir.mkdir(parents=True, exist_ok=True)
    fmt.write_inventory(tmp, bench_config(experts), shards=4, random=True)
    tmp.rename(out)
    log(f"  {sum(f.stat().st_size for f in out.iterdir()) / 1e9:.1f} GB in {time.time() - t0:.0f} s")
    if experts == 256:
        balance_router(out, log)
    return out


# Written beside config.json once the router is balanced: the rounds' expert loads.
BALANCED = "router-balanced.json"
BALANCE_TOKENS = 1024  # the start of the child's token stream: its depth-0 prefill and the context after it


def bench_stream(vocab: int, n: int) -> list[int]:
    """The token stream every child evaluates (its first n tokens: numpy draws them in order)."""
    import numpy as np
    rng = np.random.default_rng(1)
    return [int(t) for t in rng.integers(2, vocab, n)]


def route_counts(path: str, n: int) -> list[list[int]]:
    """Per layer, how many of the stream's first n tokens each expert gets (a fresh load)."""
    import numpy as np

    from zen5.engine import Engine
    from zen5.loader.deepseek_v4 import load_deepseek_v4_dir
    eng = Engine(load_deepseek_v4_dir(path, require_tokenizer=False), threads=os.cpu_count() or 1, n_ctx=n + 8,
                 weight_cache="off")
    ctx = eng.native_ctx
    ctx.eval(bench_stream(eng.config.vocab_size, n))
    ids = np.asarray(ctx.last_experts())  # (n, layers, top_k)
    experts = json.loads((Path(path) / "config.json").read_text())["n_routed_experts"]
    return [np.bincount(ids[:, layer].ravel(), minlength=experts).tolist() for layer in range(ids.shape[1])]


def balance_router(path: Path, log, rounds: int = 6) -> dict:
    """Sets each layer's router bias (ffn.gate.bias, F32, rewritten in place) so that the bench's
    token stream spreads over the experts as V4 Flash's trained router spreads real text.

    With random weights the inputs of a layer's router are alike from token to token, so the
    same experts win: a 512-token prefill of the unbalanced bench model used about 145 of the 256
    experts, some with 190-265 tokens and 84% of the routed rows in experts of more than 16 tokens,
    where V4 Flash (trained with its aux-loss-free balancing, a per-expert bias in the selection
    only) gives each expert about 12. That made the bench's prefill read fewer weights in larger
    batches than the real model would. Here the bias is found the way training finds it: count
    each expert's tokens over the stream's first BALANCE_TOKENS, move the bias of the crowded
    down and of the idle up, in proportion to their distance from the mean, and again (each
    round a fresh process and a fresh load). The selection weights are unchanged (the bias only
    picks experts, spec 2.4). The llama.cpp GGUF converted from the old values is deleted, so it
    is converted again from these."""
    import numpy as np

    from zen5.loader.safetensors import read_safetensors_header, shard_files
    cfg = json.loads((path / "config.json").read_text())
    found = {name: (file, dtype, offsets) for file in shard_files(str(path))
             for name, (dtype, _, offsets) in read_safetensors_header(file).items()}
    where = []  # per layer: its bias's file and byte range
    for layer in range(cfg["num_hidden_layers"]):
        name = f"layers.{layer}.ffn.gate.bias"
        file, dtype, offsets = found[name]
        if dtype != "F32":
            raise ValueError(f"{name} is {dtype}, the balancing writes F32")
        where.append((file, offsets))

    def counts() -> list[list[int]]:
        proc = subprocess.run([sys.executable, __file__, "--route", str(path), str(BALANCE_TOKENS)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"routing the bench stream failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def summary(c: list[list[int]]) -> list[dict]:
        return [{"experts_used": int(np.count_nonzero(x)), "max": int(max(x)), "min": int(min(x))} for x in c]

    log(f"balancing the bench model's router on the first {BALANCE_TOKENS} tokens of its stream ({rounds} rounds)")
    history = []
    step = 0.5
    for r in range(rounds + 1):
        c = counts()
        history.append(summary(c))
        log(f"  round {r}: per layer, experts used / max tokens of one: "
            + ", ".join(f"{h['experts_used']}/{h['max']}" for h in history[-1]))
        if r == rounds:
            break
        for (file, (begin, end)), load in zip(where, c):
            load = np.asarray(load, np.float64)
            with open(file, "r+b") as fh:
                fh.seek(begin)
                bias = np.frombuffer(fh.read(end - begin), "<f4").astype(np.float64)
                bias += step * (load.mean() - load) / load.mean()
                fh.seek(begin)
                fh.write(bias.astype("<f4").tobytes())
        step *= 0.7
    out = {"tokens": BALANCE_TOKENS, "top_k": cfg["num_experts_per_tok"], "rounds": history}
    (path / BALANCED).write_text(json.dumps(out, indent=1) + "\n")
    path.with_name(path.name + ".gguf").unlink(missing_ok=True)
    return out


def matmul_ops(cfg: dict, ratio: int) -> tuple[float, float]:
    """Operations (2 x multiply-adds) of one token's matmuls: (attention half, FFN half)."""
    D, hc, hd, nh = cfg["hidden_size"], cfg["hc_mult"], cfg["head_dim"], cfg["num_attention_heads"]
    qr, G, orank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    F, E, k = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    mix = (2 + hc) * hc * hc * D
    attn = mix + D * qr + qr * nh * hd + D * hd + G * orank * (nh * hd // G) + D * G * orank
    if ratio:
        attn += 2 * (2 * hd if ratio == 4 else hd) * D
    if ratio == 4:
        attn += 2 * 2 * idim * D + ih * idim * qr + ih * D
    ffn = mix + E * D + (k + cfg.get("n_shared_experts", 1)) * 3 * D * F
    return 2.0 * attn, 2.0 * ffn


def kv_bytes(cfg: dict, ratio: int, depth: int) -> int:
    """Bytes of f32 attention state one decoded token reads at context depth `depth`."""
    hd, n = cfg["head_dim"], depth + 1
    b = min(n, cfg["sliding_window"]) * hd * 4
    if ratio == 128:
        b += n // 128 * hd * 4
    if ratio == 4:
        b += n // 4 * cfg["index_head_dim"] * 4 + min(n // 4, cfg["index_topk"]) * hd * 4
    return b


def child(path: str, threads: int, depths: list[int], gen: int, repeat: int, cache: str, tier: str = "") -> dict:
    """One thread count in this process: load, then per depth decode and prefill timings. With a
    tier, the DRAM read roof is probed (roofline.dram_read) right before and right after every
    decode repetition: "tg_roofs" (their mean, per repetition) beside "tg_reps" (that
    repetition's stage times), so each repetition is divided by the bandwidth of its own moment
    (this VM's moved between 31 and 53 GB/s at 2 threads within seconds)."""

    import numpy as np

    from zen5.engine import Engine
    from zen5.loader.deepseek_v4 import load_deepseek_v4_dir
    t0 = time.time()
    eng = Engine(load_deepseek_v4_dir(path, require_tokenizer=False), threads=threads,
                 n_ctx=max(depths) + PREFILL + gen + 128, weight_cache=cache)
    load_s = time.time() - t0
    # the routed experts are packed on first use (V4Model::prepare_experts): all of them now, timed,
    # so that every measured token runs as on a warm model
    t0 = time.time()
    eng.native.prepare_all_experts()
    experts_s = time.time() - t0
    wait_promoted(eng)
    ctx, cfg = eng.native_ctx, eng.native
    stream = bench_stream(eng.config.vocab_size, max(depths) + PREFILL + gen)
    out = {"load_s": load_s, "experts_s": experts_s, "expert_bytes": eng.native.expert_bytes_total,
           "weight_cache": eng.native.weight_cache, "isa": ctx.isa,
           "layer_bytes": [list(b) for b in cfg.layer_bytes()], "head_bytes": cfg.head_bytes, "depths": {}}
    ctx.eval(stream[:8])  # warm-up, not recorded
    ctx.rewind(0)
    probe = (lambda: roofline.dram_read(threads, tier)) if tier else None
    if probe:
        import roofline
    for d in depths:
        if ctx.n_past < d:
            ctx.eval(stream[ctx.n_past:d])
        runs: dict[str, list] = {"tg": [], "pp": []}
        roofs = []
        for _ in range(repeat):
            before = probe() if probe else 0.0
            ctx.reset_stage_seconds()
            for t in stream[d:d + gen]:
                ctx.eval([t])
            runs["tg"].append([s / gen for s in ctx.stage_seconds()])
            if probe:
                roofs.append((before + probe()) / 2)
            ctx.rewind(d)
            ctx.reset_stage_seconds()
            ctx.eval(stream[d:d + PREFILL])
            runs["pp"].append([s / PREFILL for s in ctx.stage_seconds()])
            # per layer, the routed experts the prefill's tokens went to: the experts it read
            ids = np.asarray(ctx.last_experts())  # (tokens, layers, top_k)
            hit = [int(np.unique(ids[:, layer]).size) for layer in range(ids.shape[1])]
            ctx.rewind(d)
        # per stage, the median over repetitions of its seconds per token
        out["depths"][str(d)] = {k: [statistics.median(r[i] for r in v) for i in range(len(v[0]))]
                                 for k, v in runs.items()}
        out["depths"][str(d)]["pp_experts"] = hit  # the same tokens every repetition
        if probe:
            out["depths"][str(d)].update(tg_reps=runs["tg"], tg_roofs=roofs)
    return out


class DeepSeekV4Run:
    def __init__(self, cfg, log=print):
        self.cfg, self.log = cfg, log
        self.threads, self.depths, self.gen, self.repeat = list(cfg.threads), list(cfg.depths), cfg.gen, cfg.repeat
        self.experts = 16 if cfg.workload == "quick" else 256  # a smoke run's model is smaller

    def execute(self) -> dict:
        import harness
        import roofline
        cfg, log = self.cfg, self.log
        models = Path(cfg.models_dir or Path.home() / ".cache" / "zen5" / "bench-models")
        path = model_dir(models, self.experts, log)
        if cfg.wait_quiet > 0:
            harness.wait_until_quiet(cfg.wait_quiet, cfg.quiet_load, log)
        from zen5 import _native

        # the CPU's best tier unless --isa forces one (was: avx512 always, a SIGILL on AVX2 CPUs)
        tier, best = harness.resolve_tier(cfg.isa, _native.isa_tiers())
        run_id = datetime.datetime.now().isoformat(timespec="seconds")
        cache = Path(cfg.out) / f".dsv4-cache-{os.getpid()}"
        results, roofs, peer = {}, {}, {}
        llama = self.llama(path, tier)
        try:
            for t in self.threads:
                with harness.pinned(t):  # a 1-thread child, its probes and the peer's run on one CPU
                    before = roofline.measure(t, tier)
                    log(f"roofline {t}t: DRAM read {before['read_dram_gbps']:.1f} GB/s, "
                        f"int8 {roofline.int8_peak(before):.0f} GOP/s")
                    args = [sys.executable, __file__, "--child", str(path), str(t), ",".join(map(str, self.depths)),
                            str(self.gen), str(self.repeat), str(cache), tier]
                    env = dict(os.environ, **({"ZEN5_FORCE_ISA": cfg.isa} if cfg.isa else {}))
                    proc = subprocess.run(args, capture_output=True, text=True, env=env)
                    if proc.returncode:
                        raise RuntimeError(f"the {t}-thread child failed:\n{proc.stderr[-3000:]}")
                    results[t] = json.loads(proc.stdout.strip().splitlines()[-1])
                    r = results[t]
                    log(f"{t}t: loaded in {r['load_s']:.1f} s (weight cache: {r['weight_cache']['status']}), "
                        f"then all routed experts packed ({r['expert_bytes'] / 1e9:.1f} GB) in {r['experts_s']:.1f} s")
                    if llama:
                        peer[t] = self.llama_times(llama, t)
                    # probed again after the work, the higher of each figure kept (roofline.best_of):
                    # one probe taken in a slow window of this shared VM read an int8 peak of 190
                    # GOP/s at 1 thread where others read 320, and would have overstated every
                    # prefill fraction by 1.7x (the decode fractions use the probes around each
                    # repetition instead)
                    roofs[t] = roofline.best_of(before, roofline.measure(t, tier))
                    log(f"roofline {t}t, best of the probes before and after: DRAM read "
                        f"{roofs[t]['read_dram_gbps']:.1f} GB/s, int8 {roofline.int8_peak(roofs[t]):.0f} GOP/s")
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        rows = self.rows(run_id, results, roofs, bench_config(self.experts), peer, llama)
        stem = Path(cfg.out) / harness.result_stem(cpu_name(), tier, best)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        new = not Path(f"{stem}-dsv4.csv").exists()
        with open(f"{stem}-dsv4.csv", "a", newline="") as fh:
            w = csv.DictWriter(fh, COLUMNS)
            if new:
                w.writeheader()
            w.writerows(rows)
        text = projection(run_id, rows, self.depths, results)
        Path(f"{stem}-dsv4-projection.md").write_text(text)
        log(table(rows))
        log(text)
        return {"run_id": run_id, "rows": len(rows)}

    def llama(self, path: Path, tier: str):
        """(the llama-bench peer, the GGUF of `path`), or None when it is not built or asked for."""
        import dsv4_llama
        from peers import LlamaBench, cpu_flags, default_peers
        if self.cfg.peers == ():
            return None
        names = [n for n in (self.cfg.peers or default_peers(tier, tier, cpu_flags())) if n.startswith("llama")]
        for name in names:  # the first of the tier's builds that is there
            try:
                bench = LlamaBench(name)
                break
            except (ValueError, FileNotFoundError) as e:
                self.log(f"llama.cpp peer {name} skipped: {e}")
        else:
            return None
        gguf = path.with_name(path.name + ".gguf")
        if not gguf.exists():
            self.log(f"converting {path} for llama.cpp with its own converter (once) -> {gguf}")
            tmp = gguf.with_name(gguf.name + f".tmp{os.getpid()}")
            dsv4_llama.to_gguf(path, tmp)
            tmp.rename(gguf)
        return bench, gguf

    def llama_times(self, llama, threads: int) -> dict:
        """{(depth, test): seconds per token} from llama-bench, the median of --repeat runs."""
        bench, gguf = llama
        out = {}
        for d in (d for d in self.depths if d <= LLAMA_MAX_DEPTH):
            cmd = [str(bench.exe), "-m", str(gguf), "-t", str(threads), "-r", str(self.repeat), "-o", "json",
                   "-p", str(PREFILL), "-n", str(self.gen), "-d", str(d)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"llama-bench failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
            for r in json.loads(proc.stdout):
                test = f"pp{PREFILL}" if r["n_gen"] == 0 else "tg"
                n = r["n_prompt"] if r["n_gen"] == 0 else r["n_gen"]
                out[(d, test)] = statistics.median(r["samples_ns"]) / 1e9 / n
            self.log(f"{bench.name} {threads}t depth {d}: pp{PREFILL} {1 / out[(d, f'pp{PREFILL}')]:.2f} tok/s, "
                     f"tg {1 / out[(d, 'tg')]:.2f} tok/s")
        return out

    def rows(self, run_id: str, results: dict, roofs: dict, cfg: dict, peer: dict, llama) -> list[dict]:
        """zen5's rows per stage, then llama.cpp's whole-model rows with the same bytes and ops."""
        import roofline
        k = cfg["num_experts_per_tok"]
        base = {"run_id": run_id, "date": run_id[:10], "commit": commit(), "cpu": cpu_name(), "repeats": self.repeat}
        out, peers = [], []
        for t, res in results.items():
            peak = roofline.int8_peak(roofs[t])
            lb = res["layer_bytes"]

            def row(engine, isa, d, test, stage, s, b, ops, per_rep=None):
                r = dict(base, engine=engine, isa=isa, threads=t, depth=d, test=test, stage=stage,
                         seconds_per_token=f"{s:.6g}", read_dram_gbps=round(roof, 2), int8_gops=round(peak, 1))
                if test == "tg":  # per_rep: [(seconds, roof)] of the repetitions, where probed
                    frac = statistics.median(b / x / 1e9 / g for x, g in per_rep) if per_rep else b / s / 1e9 / roof
                    return dict(r, bytes_per_token=b, gbps=round(b / s / 1e9, 2), frac_dram_roof=round(frac, 3))
                r.update(gops=round(ops / s / 1e9, 1), frac_int8_peak=round(ops / s / 1e9 / peak, 3))
                if b is not None:  # a prefill's MoE half: the weights it read, over its tokens
                    r.update(bytes_per_token=round(b), gbps=round(b / s / 1e9, 2),
                             frac_dram_roof=round(b / s / 1e9 / roof, 3))
                return r

            for d, tests in res["depths"].items():
                # decode: each repetition over the DRAM roof probed around it, the median of those
                # fractions, where the child probed (child: "tg_roofs"); else over the roof
                # measured before the child
                reps = list(zip(tests.get("tg_reps", []), tests.get("tg_roofs", [])))
                roof = statistics.median(r for _, r in reps) if reps else roofs[t]["read_dram_gbps"]
                for test, secs in tests.items():
                    if test not in ("tg", "pp"):
                        continue
                    name = "tg" if test == "tg" else f"pp{PREFILL}"
                    hit = tests.get("pp_experts")  # prefill: the routed experts its tokens went to, per layer
                    stages = []
                    for i, ratio in enumerate(KINDS):
                        if test == "tg":
                            attn_b, ffn_b = lb[i][0] + kv_bytes(cfg, ratio, int(d)), lb[i][1] + k * lb[i][2]
                        else:  # bytes only for the MoE half: each weight it uses, read once per prefill
                            attn_b, ffn_b = None, (lb[i][1] + hit[i] * lb[i][2]) / PREFILL if hit else None
                        ops = matmul_ops(cfg, ratio)
                        stages += [(f"attn_r{ratio}", secs[2 * i], attn_b, ops[0]),
                                   (f"ffn_r{ratio}", secs[2 * i + 1], ffn_b, ops[1])]
                    # the head runs once per eval: for the last token of a prefill only
                    head_b = res["head_bytes"] + 2 * cfg["hidden_size"] if test == "tg" else None
                    stages.append(("rest", secs[-1], head_b,
                                   2.0 * cfg["vocab_size"] * cfg["hidden_size"] / (1 if test == "tg" else PREFILL)))
                    total = ("total", sum(x[1] for x in stages),
                             sum(x[2] for x in stages) if test == "tg" else None, sum(x[3] for x in stages))
                    # a stage's seconds in each repetition (stage order: the child's), and the total's
                    per_rep = [[(rs[j], g) for rs, g in reps] for j in range(len(stages))] + [
                        [(sum(rs), g) for rs, g in reps]] if test == "tg" else [None] * (len(stages) + 1)
                    out += [row("zen5", res["isa"], int(d), name, *st, per_rep=pr)
                            for st, pr in zip(stages + [total], per_rep)]
                    if (int(d), name) in peer.get(t, {}):
                        bench = llama[0]
                        peers.append(row(bench.name, bench.isa, int(d), name, "total", peer[t][(int(d), name)],
                                         *total[2:]))
        return out + peers


def table(rows: list[dict]) -> str:
    lines = [f"{'engine':16} {'thr':>3} {'depth':>6} {'test':6} {'stage':9} {'ms/token':>9} {'GB/s':>7} {'roof':>6} "
             f"{'GOP/s':>7} {'int8 peak':>9}"]
    for r in rows:
        roof = f"{100 * r['frac_dram_roof']:5.1f}%" if r.get("frac_dram_roof") is not None else "     -"
        peak = f"{100 * r['frac_int8_peak']:8.1f}%" if r.get("frac_int8_peak") is not None else "        -"
        lines.append(f"{r['engine']:16} {r['threads']:>3} {r['depth']:>6} {r['test']:6} {r['stage']:9} "
                     f"{1e3 * float(r['seconds_per_token']):9.3f} {r.get('gbps') or '-':>7} {roof} "
                     f"{r.get('gops') or '-':>7} {peak}")
    return "\n".join(lines)


def projection(run_id: str, rows: list[dict], depths: list[int], results: dict | None = None) -> str:
    """The full V4 Flash from the measured stages: here, and on the named Zen 5 (ZEN5). With the
    children's results (their per-repetition decode times and roofs), decode's fraction is the
    median over repetitions of the full model's bytes over its time and that repetition's roof."""
    flash = flash_config()
    ratios = flash["compress_ratios"][:flash["num_hidden_layers"]]
    count = {r: ratios.count(r) for r in KINDS}
    z = ZEN5
    z_bw = z["dram_peak_gbps"] * z["dram_sustained"]
    z_int8 = z["cores"] * z["ghz"] * z["int8_ops_per_cycle"]  # GOP/s
    by = {(r["threads"], r["depth"], r["test"], r["stage"]): r for r in rows if r["engine"] == "zen5"}
    on_amx = any(r.get("isa") == "amx" for r in by.values())  # prefill on AMX tiles: not projected onto Zen 5
    peer = {(r["threads"], r["depth"], r["test"]): r for r in rows if r["engine"] != "zen5"}
    lines = [f"# DeepSeek V4 Flash projected from its real-width layers (run {run_id}, {cpu_name()})", "",
             "Generated by `python -m zen5 bench --deepseek-v4` (bench/dsv4_bench.py); do not edit.", "",
             f"Formula: a token's time = rest + sum over kinds of (layers of that kind x (attention + FFN "
             f"half)), the stage times measured on the bench model's one layer per kind; V4 Flash has "
             f"{count[0]} window-only, {count[4]} ratio-4 and {count[128]} ratio-128 layers. Bytes per token "
             f"likewise (the matrices read, 6 of 256 experts, the KV rows at the depth).", "",
             f"Named machine: {z['name']}. Assumed: DRAM read sustains {z['dram_sustained']:.0%} of "
             f"{z['dram_peak_gbps']:.0f} GB/s = {z_bw:.0f} GB/s; int8 peak {z['cores']} cores x {z['ghz']} GHz x "
             f"{z['int8_ops_per_cycle']} ops/cycle = {z_int8 / 1e3:.1f} TOP/s; zen5 reaches there the same "
             "fractions of those roofs as measured here (decode: of DRAM bandwidth; prefill: of int8 "
             "peak). Not measured, so not in the figures: 64-thread scaling and per-layer "
             "synchronisation, NUMA placement, and whether 160 GB of weights stream like the bench "
             "model's 12 GB. This machine cannot hold the real model (about 160 GB); its line is what "
             "the measured speed gives if it could.", "",
             *([] if not on_amx else [
                 "Prefill ran here on the amx tier: its int8 products on AMX tiles, its fraction of the "
                 "tile unit's TDPBSSD peak. Zen 5 has no AMX, so that fraction says nothing about it and no "
                 "prefill is projected there; `python -m zen5 bench --deepseek-v4 --isa avx512` measures "
                 "the tier Zen 5 runs. Decode runs the same AVX-512 kernels on both tiers.", ""]),
             "| threads | depth | test | bytes or ops / token | this machine | fraction of its roof | "
             "projected on the named Zen 5 |", "|---|---|---|---|---|---|---|"]
    for t in sorted({r["threads"] for r in rows}):
        for d in depths:
            for test in ("tg", f"pp{PREFILL}"):
                if (t, d, test, "rest") not in by:
                    continue
                stage = lambda s: by[(t, d, test, s)]  # noqa: E731
                secs = float(stage("rest")["seconds_per_token"])
                for r in KINDS:
                    secs += count[r] * (float(stage(f"attn_r{r}")["seconds_per_token"]) +
                                        float(stage(f"ffn_r{r}")["seconds_per_token"]))
                if test == "tg":
                    b = stage("rest")["bytes_per_token"] + sum(
                        count[r] * (stage(f"attn_r{r}")["bytes_per_token"] + stage(f"ffn_r{r}")["bytes_per_token"])
                        for r in KINDS)
                    frac = b / secs / 1e9 / stage("rest")["read_dram_gbps"]
                    probed = ((results or {}).get(t) or {}).get("depths", {}).get(str(d), {})
                    if probed.get("tg_roofs"):  # stage order: attn, ffn per kind in KINDS, then the rest
                        full = [rs[-1] + sum(count[r] * (rs[2 * i] + rs[2 * i + 1]) for i, r in enumerate(KINDS))
                                for rs in probed["tg_reps"]]
                        frac = statistics.median(b / x / 1e9 / g for x, g in zip(full, probed["tg_roofs"]))
                        secs = statistics.median(full)
                    there = frac * z_bw * 1e9 / b
                    amount = f"{b / 1e9:.2f} GB"
                else:
                    ops = 2.0 * flash["vocab_size"] * flash["hidden_size"] / PREFILL + sum(
                        count[r] * sum(matmul_ops(flash, r)) for r in KINDS)
                    frac = ops / secs / 1e9 / stage("rest")["int8_gops"]
                    there = None if on_amx else frac * z_int8 * 1e9 / ops
                    amount = f"{ops / 1e9:.1f} GOP"
                there = "- (AMX here)" if there is None else f"{there:.0f} tok/s"
                lines.append(f"| {t} | {d} | {'decode' if test == 'tg' else 'prefill ' + str(PREFILL)} | {amount} | "
                             f"{1 / secs:.2f} tok/s | {frac:.1%} | {there} |")
    lines += moe_prefill(by, None if on_amx else (z_bw, z_int8))
    for t, r in sorted((t, r) for t, r in (results or {}).items() if "load_s" in r):
        lines.append(f"\nLoad of the bench model at {t} thread(s): {r['load_s']:.1f} s to a ready engine (weight "
                     f"cache {r['weight_cache']['status']}); its routed experts ({r['expert_bytes'] / 1e9:.1f} GB) are "
                     f"packed on first use, here all at once before timing: {r['experts_s']:.1f} s.")
    if peer:
        name = next(iter(peer.values()))["engine"]
        lines += ["", f"The bench model itself (3 layers, real vocabulary), zen5 against {name} on the same "
                  "checkpoint converted by llama.cpp's own converter, whole-model tok/s:", "",
                  f"| threads | depth | test | zen5 | {name} | zen5 / llama.cpp |", "|---|---|---|---|---|---|"]
        for (t, d, test), r in sorted(peer.items()):
            z = 1 / float(by[(t, d, test, "total")]["seconds_per_token"])
            p = 1 / float(r["seconds_per_token"])
            lines.append(f"| {t} | {d} | {test} | {z:.2f} | {p:.2f} | {z / p:.2f}x |")
    return "\n".join(lines) + "\n"


def moe_prefill(by: dict, zen5: tuple[float, float] | None = None) -> list[str]:
    """The projection's section on the prefill's MoE halves (issue 22's prefill target): each one's
    fraction of the int8 peak beside its roofline bound. A stage runs no faster than the int8
    peak, nor than the DRAM roof times its operations per byte read; as a fraction of the int8
    peak that bound is min(1, f_int8 / f_dram), and the stage's share of it max(f_int8, f_dram).
    zen5: the named machine's (DRAM GB/s, int8 GOP/s) when the prefill is projected there, whose
    own bound for the same halves is checked against the fractions the projection carries."""
    keys = sorted((k for k in by if k[2] == f"pp{PREFILL}" and k[3].startswith("ffn_")
                   and by[k].get("frac_dram_roof") is not None),
                  key=lambda k: (k[0], k[1], KINDS.index(int(k[3][len("ffn_r"):]))))
    if not keys:
        return []
    lines = ["", f"The MoE halves of the {PREFILL}-token prefill, per layer kind. Each reads, once per prefill, the "
             "layer's FFN weights outside the routed experts and every expert the prefill's tokens were routed to "
             "(counted from the routing): those bytes over the tokens, against the decode rows' DRAM probe. The "
             "roofline bound is the most of the int8 peak the half could reach here: the peak, or the DRAM roof "
             "times its operations per byte, whichever is lower.", "",
             "| threads | depth | layer | GOP/s | of the int8 peak | weights read / token | of the DRAM roof | "
             "roofline bound, of the int8 peak | of that bound |", "|---|---|---|---|---|---|---|---|---|"]
    for t, d, _, stage in keys:
        r = by[(t, d, f"pp{PREFILL}", stage)]
        fi, fd = r["frac_int8_peak"], r["frac_dram_roof"]
        lines.append(f"| {t} | {d} | ratio {stage[len('ffn_r'):]} | {r['gops']:.0f} | {fi:.1%} | "
                     f"{r['bytes_per_token'] / 1e6:.2f} MB | {fd:.1%} | {min(1.0, fi / fd):.1%} | {max(fi, fd):.1%} |")
    if zen5:
        z_bw, z_int8 = zen5
        rows = [by[k] for k in keys]
        bound = [min(1.0, z_bw * r["gops"] / r["gbps"] / z_int8) for r in rows]  # DRAM x operations per byte
        over = sum(r["frac_int8_peak"] > b for r, b in zip(rows, bound))
        lines += ["", f"On the named Zen 5 the same halves' roofline bound is {min(bound):.0%}-{max(bound):.0%} of its "
                  "int8 peak (its DRAM roof times their operations per byte); the projection carries there the "
                  f"fractions of the peak measured here, {min(r['frac_int8_peak'] for r in rows):.1%}-"
                  f"{max(r['frac_int8_peak'] for r in rows):.1%}, "
                  + ("all below that bound." if not over else
                     f"and {over} of the {len(rows)} exceed it: there the projected prefill overstates them.")]
    return lines


if __name__ == "__main__" and sys.argv[1:2] == ["--route"]:
    print(json.dumps(route_counts(sys.argv[2], int(sys.argv[3]))))
if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _, _, path, threads, depths, gen, repeat, cache, tier = sys.argv
    print(json.dumps(child(path, int(threads), [int(d) for d in depths.split(",")], int(gen), int(repeat), cache,
                           tier)))
