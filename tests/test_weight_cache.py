"""The packed-weight cache (zen5/weight_cache.py, csrc/arena_cache.h): the first load writes the
arena in the background (a process that exits meanwhile waits for it), later loads map it and
give bit-identical logits and the same fingerprint, moving it onto huge pages in the background
while decoding (as a packed arena moves, which starts on 4 KiB pages); a corrupt, truncated or
stale file is ignored and rewritten; a full disk or too little free space costs only the cache,
never the load."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tiny_gguf import write_gguf
from zen5 import weight_cache
from zen5.engine import Engine
from zen5.loader import load_weights

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cache maps files with mmap")

PROMPT = [5, 17, 42, 9, 33, 2, 71, 8]


def run(path, cache_dir, **kw):
    """(engine, logits of every PROMPT position), any background cache write finished."""
    e = Engine(load_weights(str(path)), threads=2, n_ctx=64, weight_cache=str(cache_dir), **kw)
    e.native_ctx.eval(PROMPT, True)
    e.native.finish_weight_cache()
    return e, np.asarray(e.native_ctx.logits()).copy()


def wait_moved(e, seconds: float = 30) -> None:
    """Until the arena's background move onto huge pages has ended (or `seconds` have passed)."""
    deadline = time.monotonic() + seconds
    while not e.weight_cache["promoted"] and time.monotonic() < deadline:
        time.sleep(0.01)


def arenas(d: Path) -> list[Path]:
    return sorted(d.glob("*.arena"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Q8_0 matrices, F16 norms (converted: "others" in the arena) and an untied BF16 head (panels)."""
    p = tmp_path_factory.mktemp("wc") / "m.gguf"
    return write_gguf(p, tied=False, types={"output.weight": Q.BF16})


@pytest.fixture(scope="module")
def reference(model):
    """Logits and fingerprint with the cache off."""
    e, lg = run(model, "off")
    wait_moved(e)  # a packed arena moves onto huge pages too (model.cpp)
    assert e.weight_cache == {"status": "off", "miss": "", "promoted": True}
    return lg, e.native.fingerprint


def test_first_load_writes_then_later_loads_map(model, reference, tmp_path):
    lg0, fp0 = reference
    e1, lg1 = run(model, tmp_path)
    assert e1.weight_cache["status"] == "written"
    [f] = arenas(tmp_path)
    assert f.stat().st_size == e1.native.weight_bytes + 64  # the arena, then the trailer
    e2, lg2 = run(model, tmp_path)
    assert e2.weight_cache["status"] == "hit" and e2.weight_cache["miss"] == ""
    assert e2.native.fingerprint == e1.native.fingerprint == fp0
    np.testing.assert_array_equal(lg1, lg0)
    np.testing.assert_array_equal(lg2, lg0)
    wait_moved(e2)
    assert e2.weight_cache["promoted"]
    e2.native_ctx.rewind(0)  # once on huge pages, still the same bytes
    e2.native_ctx.eval(PROMPT, True)
    np.testing.assert_array_equal(np.asarray(e2.native_ctx.logits()), lg0)
    assert e2.info()["weight_cache"] == "hit"


def test_the_write_runs_in_the_background_and_an_exiting_process_finishes_it(model, reference, tmp_path):
    """The load returns with the file being written ("writing"; "written" if it was that quick),
    inference runs meanwhile, and a process that exits straight after the load still leaves the
    whole file (atexit waits): the next load maps it."""
    e = Engine(load_weights(str(model)), threads=2, n_ctx=64, weight_cache=str(tmp_path))
    assert e.weight_cache["status"] in ("writing", "written")
    e.native_ctx.eval(PROMPT, True)
    np.testing.assert_array_equal(np.asarray(e.native_ctx.logits()), reference[0])
    e.native.finish_weight_cache()
    assert e.weight_cache["status"] == "written"
    child = tmp_path / "child"
    code = ("import sys; from zen5.engine import Engine; from zen5.loader import load_weights; "
            "e = Engine(load_weights(sys.argv[1]), threads=1, n_ctx=16, weight_cache=sys.argv[2]); "
            "print(e.weight_cache['status'])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", code, str(model), str(child)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("writing", "written")
    [f] = arenas(child)
    assert f.stat().st_size == e.native.weight_bytes + 64
    assert not [p for p in child.iterdir() if ".tmp." in p.name]
    e2, lg = run(model, child)
    assert e2.weight_cache["status"] == "hit"
    np.testing.assert_array_equal(lg, reference[0])


def test_decoding_during_the_promotion_reads_the_same_weights(smollm2_path, tmp_path):
    """SmolLM2's 100 MB arena takes a while to move; decode from the first moment on (the engines
    run one after the other, so the one without the cache does not slow the promotion)."""
    prompt = list(range(100, 164))
    off = Engine(load_weights(smollm2_path), threads=1, n_ctx=128, weight_cache="off")
    off.native_ctx.eval(prompt, True)
    want = np.asarray(off.native_ctx.logits()).copy()
    del off
    Engine(load_weights(smollm2_path), threads=1, n_ctx=128, weight_cache=str(tmp_path))  # writes
    hit = Engine(load_weights(smollm2_path), threads=1, n_ctx=128, weight_cache=str(tmp_path))
    assert hit.weight_cache["status"] == "hit"
    for _ in range(3):
        hit.native_ctx.rewind(0)
        hit.native_ctx.eval(prompt, True)
        np.testing.assert_array_equal(np.asarray(hit.native_ctx.logits()), want)


def test_a_packed_arena_moves_onto_huge_pages_while_decoding(smollm2_path):
    """Without a cache file the arena is packed on 4 KiB pages (a faster first touch) and then
    moved in the background: decode reads the same weights during the move and after it."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here: a packed arena stays where it is")
    prompt = list(range(100, 164))
    e = Engine(load_weights(smollm2_path), threads=1, n_ctx=128, weight_cache="off")
    assert not e.weight_cache["promoted"]  # 100 MB: the move has just begun
    e.native_ctx.eval(prompt, True)
    want = np.asarray(e.native_ctx.logits()).copy()
    deadline = time.monotonic() + 120
    while not e.weight_cache["promoted"] and time.monotonic() < deadline:
        e.native_ctx.rewind(0)
        e.native_ctx.eval(prompt, True)
        np.testing.assert_array_equal(np.asarray(e.native_ctx.logits()), want)
    assert e.weight_cache["promoted"]
    e.native_ctx.rewind(0)
    e.native_ctx.eval(prompt, True)
    np.testing.assert_array_equal(np.asarray(e.native_ctx.logits()), want)


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-64] + bytes([b[-64] ^ 1]) + b[-63:], "trailer is corrupt"),   # the magic
    (lambda b: b[:-16] + bytes(16), "trailer is corrupt"),                        # the checksum
    (lambda b: b[:-1], "size"),                                                   # truncated
    (lambda b: b + b"x", "size"),
])
def test_a_damaged_file_is_ignored_and_rewritten(model, reference, tmp_path, damage, why):
    run(model, tmp_path)
    [f] = arenas(tmp_path)
    good = f.read_bytes()
    f.write_bytes(damage(good))
    e, lg = run(model, tmp_path)
    assert why in e.weight_cache["miss"] and e.weight_cache["status"] == "written"
    np.testing.assert_array_equal(lg, reference[0])
    assert f.read_bytes() == good
    assert run(model, tmp_path)[0].weight_cache["status"] == "hit"


def test_a_file_of_another_model_is_not_read(model, tmp_path):
    """Same name and key (a file copied over another's cache entry), other arena: refused."""
    other = write_gguf(tmp_path / "other.gguf", tied=False, types={"output.weight": Q.BF16}, n_ff=160)
    run(other, tmp_path / "o")
    run(model, tmp_path / "m")
    [mine], [theirs] = arenas(tmp_path / "m"), arenas(tmp_path / "o")
    mine.write_bytes(theirs.read_bytes())
    e, _ = run(model, tmp_path / "m")
    assert e.weight_cache["miss"] and e.weight_cache["status"] == "written"


def test_a_changed_source_gets_a_new_file_and_the_stale_one_goes(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    run(src, cache)
    [old] = arenas(cache)
    os.utime(src, ns=(1, 1))  # rewritten in place: same path, other identity
    e, _ = run(src, cache)
    assert e.weight_cache["status"] == "written"
    [new] = arenas(cache)
    assert new != old and new.name.split("-")[:-1] == old.name.split("-")[:-1]


def test_only_the_most_recently_used_files_are_kept(tmp_path):
    cache = tmp_path / "cache"
    srcs = [write_gguf(tmp_path / f"m{i}.gguf", n_layer=1) for i in range(weight_cache.KEEP + 2)]
    for i, s in enumerate(srcs[:-1]):
        run(s, cache)
        for f in arenas(cache):  # deterministic ages: each earlier file one hour older
            os.utime(f, (f.stat().st_mtime - 3600, f.stat().st_mtime - 3600))
    run(srcs[0], cache)  # a hit makes the oldest the most recent
    run(srcs[-1], cache)
    names = {f.name.split("-")[0] for f in arenas(cache)}
    assert len(names) == weight_cache.KEEP
    assert "m0.gguf" in names and "m1.gguf" not in names


def test_off_writes_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEN5_WEIGHT_CACHE", "off")
    e = Engine(load_weights(model), threads=1, n_ctx=16)
    assert e.weight_cache["status"] == "off"
    assert weight_cache.directory() is None


def test_too_little_free_space_skips_the_write(model, reference, tmpfs):
    d = tmpfs("size=1m")
    e, lg = run(model, d)
    assert e.weight_cache["status"] == "not written: too little free disk space"
    assert list(d.iterdir()) == []
    np.testing.assert_array_equal(lg, reference[0])


def test_the_free_space_floor_is_the_larger_of_2_gib_and_5_percent_unless_overridden(monkeypatch):
    """The suite runs with ZEN5_WEIGHT_CACHE_MIN_FREE lowered (conftest); the default rule is
    checked here on made-up disks."""
    disk = lambda total, free: SimpleNamespace(total=total, used=total - free, free=free)  # noqa: E731
    gib = 1 << 30
    monkeypatch.delenv("ZEN5_WEIGHT_CACHE_MIN_FREE")
    assert weight_cache.room_for(disk(20 * gib, 3 * gib), gib)  # 2 GiB left = the 2 GiB floor
    assert not weight_cache.room_for(disk(20 * gib, 3 * gib), gib + 1)
    assert weight_cache.room_for(disk(252 * gib, 14 * gib), gib)  # 13 GiB left >= 12.6 GiB (5%)
    assert not weight_cache.room_for(disk(252 * gib, 13 * gib), gib)  # 12 GiB left < 5%
    monkeypatch.setenv("ZEN5_WEIGHT_CACHE_MIN_FREE", str(gib))
    assert weight_cache.room_for(disk(252 * gib, 3 * gib), 2 * gib)
    assert not weight_cache.room_for(disk(252 * gib, 3 * gib), 2 * gib + 1)
    monkeypatch.setenv("ZEN5_WEIGHT_CACHE_MIN_FREE", "2G")
    with pytest.raises(ValueError, match="whole number of bytes, not '2G'"):
        weight_cache.room_for(disk(252 * gib, 3 * gib), 1)


def test_a_full_disk_during_the_write_leaves_nothing_behind(model, reference, tmpfs, monkeypatch):
    d = tmpfs("size=64k")  # the free-space check told to pass: the write itself hits ENOSPC
    monkeypatch.setattr(weight_cache, "room_for", lambda usage, n: True)
    e, lg = run(model, d)
    assert e.weight_cache["status"].startswith("not written: ")
    assert "No space left" in e.weight_cache["status"]
    assert list(d.iterdir()) == []
    np.testing.assert_array_equal(lg, reference[0])


def test_an_unwritable_directory_loads_without_a_cache(model, reference, tmpfs):
    d = tmpfs("ro")
    e, lg = run(model, d / "sub")
    assert e.weight_cache["status"] == "off"
    np.testing.assert_array_equal(lg, reference[0])


def test_a_crashed_writers_temporary_file_is_removed(model, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"x.arena.tmp.{dead}").write_bytes(b"partial")
    (tmp_path / f"y.arena.tmp.{os.getpid()}").write_bytes(b"in progress")  # alive: kept
    run(model, tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir() if ".tmp." in f.name) == [f"y.arena.tmp.{os.getpid()}"]


def test_deepseek_v4_checkpoints_are_cached_too(tmp_path):
    from dsv4_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ck", tokenizer=True)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    out = []
    for _ in range(2):
        e = Engine(load_weights(str(ckpt)), threads=2, n_ctx=64, weight_cache=str(tmp_path / "cache"))
        e.native_ctx.eval(ids, True)
        e.native.finish_weight_cache()
        out.append((e.weight_cache["status"], e.native.fingerprint, np.asarray(e.native_ctx.logits()).copy()))
    assert [o[0] for o in out] == ["written", "hit"] and out[0][1] == out[1][1]
    np.testing.assert_array_equal(out[0][2], out[1][2])
