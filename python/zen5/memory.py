"""Does a model fit? The bytes the engine will hold against the memory this process may use,
checked before anything large is allocated (issue 21, lean loading).

What the engine holds: the weight arena (every matrix repacked for the kernels, `_native.
owned_matrix_bytes`; the file's pages are released as they are copied, and the token embedding's
rows are read from the file on demand) plus the KV cache for the whole context at its type
(reserved up front, resident as positions are used: a context that fills up needs all of it).
Available: MemAvailable (/proc/meminfo), lowered to what a cgroup v2 limit leaves
(memory.max - memory.current) when one is set; ZEN5_MEM_AVAILABLE overrides both (tests fake a
small machine with it; a user who knows better can raise it).
"""
from __future__ import annotations

import os

from zen5 import overrides
from zen5.config import UnsupportedModelError

_MIB = 1 << 20


class InsufficientMemory(UnsupportedModelError, MemoryError):
    """The model (weights + KV cache for the requested context) does not fit in the memory
    available; raised before anything large is allocated."""


def _meminfo_available(path="/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_available(root="/sys/fs/cgroup") -> int | None:
    try:
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(root, "memory.current")) as f:
            used = int(f.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def available_bytes() -> tuple[int | None, str]:
    """(bytes this process may still use, where the figure comes from); None when unknown."""
    raw = overrides.get("ZEN5_MEM_AVAILABLE")
    if raw is not None:
        try:
            return int(raw), "ZEN5_MEM_AVAILABLE"
        except ValueError:
            raise ValueError(f"ZEN5_MEM_AVAILABLE must be a number of bytes, got {raw!r}") from None
    found = [(v, src) for v, src in ((_meminfo_available(), "MemAvailable"),
                                     (_cgroup_available(), "the cgroup's memory.max")) if v is not None]
    return min(found) if found else (None, "unknown")


def check_fits(weight_bytes: int, kv_bytes: int, n_ctx: int, kv_type: str, source=None) -> None:
    """Raise InsufficientMemory when weight_bytes + kv_bytes exceed the available memory."""
    avail, src = available_bytes()
    need = weight_bytes + kv_bytes
    if avail is None or need <= avail:
        return
    where = f"{source}: " if source else ""
    fix = []
    if kv_bytes > avail // 4:
        fix.append(f"a smaller context (--ctx / n_ctx; {kv_bytes / n_ctx / 1024:.1f} KiB a token)")
        if kv_type != "q8_0":
            fix.append("the q8_0 KV cache (--kv-type q8_0 / kv_type='q8_0')")
    fix.append("a smaller quantization of the model (Q4_0 / Q4_1 instead of Q8_0 or BF16)")
    raise InsufficientMemory(
        f"{where}the model does not fit in memory: it needs {need / _MIB:.0f} MiB "
        f"({weight_bytes / _MIB:.0f} MiB of weights + {kv_bytes / _MIB:.0f} MiB of {kv_type} KV cache "
        f"for {n_ctx} tokens) but {avail / _MIB:.0f} MiB are available ({src}). Try "
        + ", or ".join(fix) + ".")


def llama_weight_bytes(weights) -> int:
    """The arena bytes of a llama/qwen model (model.cpp: every matrix but the token embedding;
    a tied head is the embedding's copy)."""
    from zen5 import _native
    total = 0
    for t in weights.tensors.values():
        if len(t.shape) != 2 or (t.name == "token_embd.weight" and not weights.config.tied_output):
            continue
        total += _native.owned_matrix_bytes(t.ggml_type, t.shape[0], t.shape[1])
    return total
