"""The peers zen5 is measured against, each behind the same `run(quant, threads, tokens, tests)`
as workload.Zen5Runner, so the harness can interleave them repetition by repetition.

- LlamaBench: llama.cpp's own `llama-bench` from a peer build made by bench/build_peers.sh
  ("avx512": AVX-512 + VNNI without AMX, the Zen 5 instruction mix; "amx": the native build with
  AMX and the local tile-config fix). One process per call with `-r 1 --no-warmup`, and the same
  warm-up as zen5's put in front as extra tests (pp64, tg8) whose results are dropped: llama-bench's
  own warm-up would rerun every prompt in full and double the peer's share of the run. llama-bench
  feeds random token ids; prefill and decode speed do not depend on which ids.
- TorchWorker: bench/torch_peer.py in a child process (fp32 or bf16 eager PyTorch with a KV
  cache, weights dequantized from the same GGUF), so torch's OpenMP threads and zen5's pool never
  share a process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from workload import WARMUP, n_tokens

HERE = Path(__file__).resolve().parent
LLAMA_BUILDS = {"llama.cpp-avx512": ("build-avx512", "avx512 (no AMX)"),
                "llama.cpp-amx": ("build-native", "native (AMX)")}
TORCH_DTYPES = {"torch-fp32": "fp32", "torch-bf16": "bf16"}
ALL_PEERS = tuple(LLAMA_BUILDS) + tuple(TORCH_DTYPES)


def peer_dir() -> Path:
    return Path(os.environ.get("ZEN5_PEERS") or Path.home() / ".cache" / "zen5" / "peers")


class LlamaBench:
    def __init__(self, name: str, root: Path | None = None):
        sub, self.build = LLAMA_BUILDS[name]
        self.name = name
        self.exe = (root or peer_dir()) / sub / "bin" / "llama-bench"
        if not os.access(self.exe, os.X_OK):
            raise FileNotFoundError(f"{self.exe} is missing: build the llama.cpp peers with "
                                    f"`bash bench/build_peers.sh` (about 15 minutes, once)")
        self.isa = "avx512+amx" if name.endswith("amx") else "avx512"

    def describe(self, quant: str, threads: int) -> tuple[str, str]:
        return self.build, self.isa

    def run(self, quant: str, threads: int, tokens: list[int], tests: list[str]) -> dict[str, float]:
        from workload import model_path

        pp = [t for t in list(WARMUP) + tests if t.startswith("pp")]
        tg = [t for t in list(WARMUP) + tests if t.startswith("tg")]
        cmd = [str(self.exe), "-m", model_path(quant), "-t", str(threads), "-r", "1", "--no-warmup",
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
        isa = "avx512" + ("+amx (oneDNN)" if self.dtype == "bf16" else "")
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
