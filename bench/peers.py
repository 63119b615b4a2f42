"""The peers zen5 is measured against, each behind the same `run(quant, threads, tokens, tests)`
as workload.Zen5Runner, so the harness can interleave them repetition by repetition.

- LlamaBench: llama.cpp's own `llama-bench` from a peer build made by bench/build_peers.sh. Which
  builds exist depends on the CPU (`planned_builds`, the same choice as the script's) and each
  build is a peer named after the instruction set it really runs (`llama_peers`):
    llama.cpp-amx     the native build on a CPU with AMX (tile, int8, bf16; the local tile-config fix)
    llama.cpp-avx512  AVX-512 F/BW/VL + VNNI/VBMI/BF16 without AMX, the Zen 5 instruction mix
                      (built only beside an AMX native build)
    llama.cpp-native  the native build elsewhere: AVX-512 on Zen 4/5, AVX2 on Zen 3
    llama.cpp-avx2    AVX/AVX2/FMA/F16C/BMI2 only (built on AVX-512 CPUs, for zen5's forced AVX2 tier)
  Older result files name `llama.cpp-avx512` and `llama.cpp-amx` (a Xeon with AMX): the same
  builds, so their rows keep their meaning. One process per call with `-r 1 --no-warmup`, and the
  same warm-up as zen5's put in front as extra tests (pp64, tg8) whose results are dropped:
  llama-bench's own warm-up would rerun every prompt in full and double the peer's share of the
  run. llama-bench feeds random token ids; prefill and decode speed do not depend on which ids.
- TorchWorker: bench/torch_peer.py in a child process (fp32 or bf16 eager PyTorch with a KV
  cache, weights dequantized from the same GGUF), so torch's OpenMP threads and zen5's pool never
  share a process. PyTorch picks its own kernels (the CPU's best); it cannot be held to a tier, so
  a run with a forced zen5 tier below the best leaves it out unless asked (`default_peers`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from workload import WARMUP, n_tokens

HERE = Path(__file__).resolve().parent
TIERS = ("ref", "avx2", "avx2vnni", "avx512", "amx")  # zen5's ISA tiers, worst to best
TORCH_DTYPES = {"torch-fp32": "fp32", "torch-bf16": "bf16"}
LLAMA_PEERS = ("llama.cpp-native", "llama.cpp-avx512", "llama.cpp-amx", "llama.cpp-avx2vnni", "llama.cpp-avx2")
ALL_PEERS = LLAMA_PEERS + tuple(TORCH_DTYPES)


@dataclass(frozen=True)
class LlamaPeer:
    name: str    # engine column of the results
    build: str   # build directory under peer_dir(): build-<build>
    label: str   # the results' "build" column
    isa: str     # what the build really runs
    tier: str    # the zen5 tier it is measured against


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: ZEN5_CPU_FLAGS (space-separated) if set, else /proc/cpuinfo."""
    if text is None:
        text = os.environ.get("ZEN5_CPU_FLAGS")
    if text is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
        line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "flags:")
        text = line.split(":", 1)[1]
    return frozenset(text.split())


def has_avx512(flags) -> bool:
    return {"avx512f", "avx512bw", "avx512vl"} <= set(flags)


def has_amx(flags) -> bool:
    return {"amx_tile", "amx_int8"} <= set(flags)


def has_avxvnni(flags) -> bool:
    return "avx_vnni" in set(flags)


def planned_builds(flags) -> list[str]:
    """The llama.cpp builds bench/build_peers.sh makes on a CPU with these flags (it prints the
    same list with --plan): native always; avx512 beside an AMX native; avx2 where native has
    more than AVX2 (AVX-512 or AVX-VNNI); avx2vnni (AVX2 + AVX-VNNI) where native has AVX-512 and
    the CPU also has AVX-VNNI."""
    plan = ["native"]
    if has_avx512(flags) and has_amx(flags):
        plan.append("avx512")
    if has_avx512(flags) or has_avxvnni(flags):
        plan.append("avx2")
    if has_avx512(flags) and has_avxvnni(flags):
        plan.append("avx2vnni")
    return plan


def llama_peers(flags) -> dict[str, LlamaPeer]:
    """Peer name -> LlamaPeer for the builds a CPU with these flags gets."""
    out = {}
    for build in planned_builds(flags):
        if build == "native":
            if has_amx(flags):
                p = LlamaPeer("llama.cpp-amx", "native", "native (AMX)", "avx512+amx", "amx")
            elif has_avx512(flags):
                p = LlamaPeer("llama.cpp-native", "native", "native (AVX-512)", "avx512", "avx512")
            elif {"avx2", "fma"} <= set(flags):
                isa, label = ("avx2vnni", "AVX2 + AVX-VNNI") if has_avxvnni(flags) else ("avx2", "AVX2")
                p = LlamaPeer("llama.cpp-native", "native", f"native ({label})", isa, isa)
            else:
                p = LlamaPeer("llama.cpp-native", "native", "native", "native", "ref")
        elif build == "avx512":
            p = LlamaPeer("llama.cpp-avx512", "avx512", "avx512 (no AMX)", "avx512", "avx512")
        elif build == "avx2vnni":
            p = LlamaPeer("llama.cpp-avx2vnni", "avx2vnni", "avx2 + AVX-VNNI (no AVX-512)", "avx2vnni", "avx2vnni")
        else:
            p = LlamaPeer("llama.cpp-avx2", "avx2", "avx2 (no AVX-512/VNNI)", "avx2", "avx2")
        out[p.name] = p
    return out


def default_peers(tier: str, best: str, flags) -> tuple[str, ...]:
    """The peers a run of zen5's `tier` is measured against: the llama.cpp builds of the same
    instruction set (avx2vnni: the AVX2 + AVX-VNNI build and, to show what VNNI gives each
    engine, the plain AVX2 one; amx: the AMX build and, likewise, the AVX-512 one), plus PyTorch
    when `tier` is the CPU's best (torch cannot be limited to a lower tier)."""
    want = {"avx2vnni": {"avx2vnni", "avx2"}, "amx": {"amx", "avx512"}}.get(tier, {tier})
    built = llama_peers(flags)
    names = [n for n in LLAMA_PEERS if n in built and built[n].tier in want]  # the old order
    return tuple(names) + (tuple(TORCH_DTYPES) if tier == best else ())


def peer_dir() -> Path:
    return Path(os.environ.get("ZEN5_PEERS") or Path.home() / ".cache" / "zen5" / "peers")


class LlamaBench:
    def __init__(self, name: str, root: Path | None = None, flags=None):
        peers = llama_peers(cpu_flags() if flags is None else flags)
        if name not in peers:
            raise ValueError(f"{name} is not built on this CPU: bench/build_peers.sh makes "
                             f"{', '.join(peers)} here")
        peer = peers[name]
        self.name, self.build, self.isa = name, peer.label, peer.isa
        self.exe = (root or peer_dir()) / f"build-{peer.build}" / "bin" / "llama-bench"
        if not os.access(self.exe, os.X_OK):
            raise FileNotFoundError(f"{self.exe} is missing: build the llama.cpp peers with "
                                    f"`bash bench/build_peers.sh` (about 15 minutes a build, once)")

    def describe(self, quant: str, threads: int) -> tuple[str, str]:
        return self.build, self.isa

    def run(self, quant: str, threads: int, tokens: list[int], tests: list[str],
            model: str | None = None, warmup: tuple[str, ...] = WARMUP) -> dict[str, float]:
        """Seconds per test on `model` (default: the kernel workload's file for `quant`), after
        the `warmup` tests (not returned)."""
        from workload import model_path

        pp = [t for t in list(warmup) + tests if t.startswith("pp")]
        tg = [t for t in list(warmup) + tests if t.startswith("tg")]
        cmd = [str(self.exe), "-m", model or model_path(quant), "-t", str(threads), "-r", "1", "--no-warmup",
               "-o", "json", "-p", ",".join(str(n_tokens(t)) for t in pp) or "0",
               "-n", ",".join(str(n_tokens(t)) for t in tg) or "0"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.name} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        out = {}
        for r in json.loads(proc.stdout):
            test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
            out[test] = r["avg_ns"] / 1e9
        missing = [t for t in tests if t not in out]
        if missing:
            raise RuntimeError(f"{self.name}: llama-bench returned no result for {missing}")
        return {t: out[t] for t in tests}


class TorchWorker:
    """One child process serving both dtypes (weights loaded once, per-dtype copies on first use)."""

    _proc: subprocess.Popen | None = None
    torch_version = ""

    def __init__(self, name: str, model: str, max_ctx: int, eos: list[int]):
        self.name, self.dtype, self.eos = name, TORCH_DTYPES[name], eos
        if TorchWorker._proc is None:
            # torch's default OpenMP settings, as a user would run it (a passive wait policy
            # would slow its many-small-ops decode); its threads sleep soon after each call.
            TorchWorker._proc = subprocess.Popen(
                [sys.executable, str(HERE / "torch_peer.py"), model, str(max_ctx)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            hello = json.loads(TorchWorker._proc.stdout.readline() or "{}")
            if not hello.get("ready"):
                raise RuntimeError("the PyTorch peer worker did not start (is torch installed?)")
            TorchWorker.torch_version = hello["torch"]

    def describe(self, quant: str, threads: int) -> tuple[str, str]:
        flags = cpu_flags()
        isa = "avx512" if has_avx512(flags) else "avx2" if "avx2" in flags else "native"
        if has_amx(flags) and self.dtype == "bf16":
            isa += "+amx (oneDNN)"
        return f"torch {self.torch_version} {self.dtype}", isa

    def run(self, quant: str, threads: int, tokens: list[int], tests: list[str]) -> dict[str, float]:
        longest = max(n_tokens(t) for t in tests if t.startswith("pp")) if any(
            t.startswith("pp") for t in tests) else 1
        cmd = {"cmd": "run", "dtype": self.dtype, "threads": threads, "tokens": tokens[:max(longest, 64)],
               "tests": list(WARMUP) + list(tests), "eos": self.eos}
        p = TorchWorker._proc
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("the PyTorch peer worker died")
        res = json.loads(line)
        return {t: res[t] for t in tests}

    @classmethod
    def close(cls) -> None:
        if cls._proc is not None:
            cls._proc.stdin.close()
            cls._proc.wait(timeout=60)
            cls._proc = None
