"""The packed weight arena kept on disk, so a model's second load maps it instead of repacking.

Loading repacks every matrix for the kernels (csrc/model.cpp: pack_and_hash), which needs fresh
memory for a full copy of the weights; on a VM that first touch costs 0.4-2.5 s per GiB, several
times llama.cpp's whole load, which only maps the file. So the first load writes the packed arena
to a file here and later loads map that file (csrc/arena_cache.h has the format and why a
background thread then moves it onto huge pages).

Where: the `weight_cache` argument of Engine / zen5.load, `--weight-cache` on the command line,
or ZEN5_WEIGHT_CACHE; the default is ~/.cache/zen5/arena, and "off" turns the cache off.

Which file: `<source name>-<hash of its real path>-<key>.arena`, the key being the source files'
identity (real path, device, inode, size and modification time in ns, for every file of a
folder model): a source file changed in place gets a new key, and the stale file of the same
source is removed once the new one is written. The native side also checks the arena's size and
layout version and the model configuration's hash, so a file is never misread.

When: the first load packs the weights and the native side writes the file from a background
thread, so the first token does not wait for the disk; status "writing" until it is done. A process
that exits meanwhile waits for the write (finish_at_exit), so even one short `zen5 generate`
leaves the file for the next load.

How much disk: a file as large as the packed weights (about the model file's size). A file is
written only if the disk keeps max(2 GiB, 5% of its size) free afterwards (ZEN5_WEIGHT_CACHE_MIN_FREE
sets that floor in bytes instead: the test suite lowers it, so whether its writes happen does not
depend on how full the machine's disk is), and the KEEP most recently used files are kept, older
ones removed.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

from . import overrides

KEEP = 4  # arenas kept in the directory, most recently used first
MIN_FREE, MIN_FREE_FRACTION = 2 << 30, 0.05  # what a write must leave free on the disk: the larger
SUFFIX = ".arena"


@dataclass(frozen=True)
class Plan:
    """What the native loader is told: path "" means no cache."""
    path: str = ""
    key: int = 0
    write: bool = False


def directory(setting: str | None = None) -> Path | None:
    """The cache directory, or None when the cache is off."""
    raw = setting or overrides.get("ZEN5_WEIGHT_CACHE")
    if raw == "off":
        return None
    return Path(raw) if raw else Path.home() / ".cache" / "zen5" / "arena"


def source_files(path: str | os.PathLike) -> list[Path]:
    """The files a model is loaded from: the file itself, or every regular file of its folder."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file())
    return [p]


def identity_key(files: list[Path]) -> int:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return int.from_bytes(h.digest()[:8], "little")


def _stem(source: Path) -> str:
    real = str(source.resolve())
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", source.name)[:80] or "model"
    return f"{name}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"


def plan(source: str | os.PathLike | None, arena_bytes: int, setting: str | None = None) -> Plan:
    """The cache file for `source` (the loader's metadata path; None: weights not from a file)."""
    where = directory(setting)
    if where is None or source is None or not Path(source).exists():
        return Plan()
    key = identity_key(source_files(source))
    path = where / f"{_stem(Path(source))}-{key:016x}{SUFFIX}"
    try:
        if path.exists():
            os.utime(path)  # most recently used: what prune() keeps
        where.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(where)
    except OSError:
        return Plan(str(path), key, False) if path.exists() else Plan()  # not writable
    # write: on a miss, or over a file the native side finds invalid (renamed over it)
    return Plan(str(path), key, room_for(usage, arena_bytes))


def room_for(usage, n: int) -> bool:
    """Whether writing n bytes leaves the disk max(2 GiB, 5% of its size) free, or the bytes
    ZEN5_WEIGHT_CACHE_MIN_FREE names."""
    raw = overrides.get("ZEN5_WEIGHT_CACHE_MIN_FREE")
    if raw is not None:
        try:
            floor = int(raw)
        except ValueError:
            raise ValueError(f"ZEN5_WEIGHT_CACHE_MIN_FREE must be a whole number of bytes, not {raw!r}") from None
    else:
        floor = max(MIN_FREE, int(usage.total * MIN_FREE_FRACTION))
    return usage.free - n >= floor


_writing: weakref.WeakSet = weakref.WeakSet()  # native models whose cache file is being written


def finish_at_exit(native_model) -> None:
    """Waits at interpreter exit for `native_model`'s background write (if it is still alive)."""
    _writing.add(native_model)


@atexit.register
def _finish_writes() -> None:
    for m in list(_writing):
        m.finish_weight_cache()


def prune(written: str) -> None:
    """When `written` is being (or was) created: remove the stale files of its source, temporary
    files of processes that are gone, and all but the KEEP most recently used arenas, `written`
    being one of them."""
    path = Path(written)
    stem = path.name[: -len(SUFFIX)].rsplit("-", 1)[0]
    arenas = []
    for f in path.parent.iterdir():
        try:
            if f.name.startswith(stem + "-") and f.name.endswith(SUFFIX) and f != path:
                f.unlink()
            elif ".arena.tmp." in f.name and not _alive(f.name.rsplit(".", 1)[-1]):
                f.unlink()
            elif f.name.endswith(SUFFIX) and f != path:
                arenas.append((f.stat().st_mtime, f))
        except OSError:
            continue  # another process got there first
    for _, f in sorted(arenas, reverse=True)[KEEP - 1:]:
        try:
            f.unlink()
        except OSError:
            pass


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # not a pid we can judge, or another user's live process
    return True
