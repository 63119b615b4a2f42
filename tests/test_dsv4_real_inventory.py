"""V4 Flash's real inventory without the weights (issue 22): 46 sparse shards whose headers carry
the official checkpoint's names, dtypes and shapes (about 150 GB claimed, holes on disk, no bytes
used) are opened, validated and memory-mapped by the loader, in a fresh process, with resident
memory growth measured. This checks the offsets and the size arithmetic on files far larger than
this machine's memory. Then tokens run through the first three of those layers (two window-only,
one with ratio 4 and its indexer; hash routing) in the engine, which packs the arena for them
and only the routed experts tokens reach (V4Model::prepare_experts), not the 10 GB of the
layers' 768 experts: the time to the first token and the resident growth are measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dsv4_formats as fmt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")

CHILD = r"""
import json, sys, time
import numpy
from zen5.loader.deepseek_v4 import load_deepseek_v4_dir

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

base = rss()
t0 = time.perf_counter()
w = load_deepseek_v4_dir(sys.argv[1], require_tokenizer=False)
dt = time.perf_counter() - t0
types = {}
for name, d, shape, data in w.native_tensors():
    types[d] = types.get(d, 0) + data.nbytes
print(json.dumps(dict(growth=rss() - base, seconds=dt, n=len(w.tensors), bytes=types,
                      layers=w.config.num_hidden_layers)))
"""


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    path = tmp_path_factory.mktemp("inventory") / "v4flash"
    return path, fmt.write_inventory(path, fmt.V4_FLASH_CONFIG)


def test_the_real_inventory_loads_mapped_without_resident_growth(inventory):
    path, claimed = inventory
    used = sum(os.stat(f).st_blocks * 512 for f in path.iterdir())
    assert claimed > 140e9 and used < 50e6  # holes: the headers only
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    inventory = fmt.real_inventory(fmt.V4_FLASH_CONFIG)
    assert out["layers"] == 43 and out["n"] == len(inventory)
    assert sum(out["bytes"].values()) <= claimed
    print(f"\nV4 Flash inventory: {len(inventory)} tensors, {claimed / 1e9:.1f} GB claimed, {used / 1e6:.1f} MB "
          f"on disk; loaded in {out['seconds']:.1f} s, resident growth {out['growth'] / 2**20:.0f} MiB; "
          + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in sorted(out["bytes"].items())))
    assert out["growth"] < 1 << 30
    # the routed experts are the bulk, packed e2m1 in place: 256 x 3 x 2048 x 4096 / 2 bytes per layer
    assert out["bytes"]["MXFP4"] == 43 * 256 * 3 * 2048 * 4096 // 2


RUN = r"""
import ctypes, json, mmap, os, sys, time
import numpy as np
from zen5.engine import Engine
from zen5.loader.deepseek_v4 import load_deepseek_v4_dir

libc = ctypes.CDLL(None, use_errno=True)

def cached(a):  # bytes of the array's file pages in the page cache (mincore on its mapping)
    addr, page = a.ctypes.data, mmap.PAGESIZE
    lo, hi = addr // page * page, (addr + a.nbytes + page - 1) // page * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in bytes(vec)) * page

def rss(key="VmRSS:"):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

base = rss()
t0, c0 = time.perf_counter(), os.times()
w = load_deepseek_v4_dir(sys.argv[1], require_tokenizer=False, layers=3)
e = Engine(w, threads=2, n_ctx=64, weight_cache="off")
opened = time.perf_counter() - t0
logits = np.asarray(e.native_ctx.eval([7], True))
first, c1 = time.perf_counter() - t0, os.times()
more = np.asarray(e.native_ctx.eval([8, 9, 10, 11, 12, 13, 14], True))  # ratio 4 compresses at 4 and 8
print(json.dumps(dict(opened=opened, first=first, user=c1.user - c0.user, system=c1.system - c0.system,
                      growth=rss() - base, peak=rss("VmHWM:") - base,
                      arena=e.native.weight_bytes, packed=e.native.expert_bytes_packed,
                      experts=e.native.expert_bytes_total, finite=bool(np.isfinite(logits).all() and
                      np.isfinite(more).all()), shape=list(more.shape), info=e.info()["expert_bytes_packed"],
                      expert_cache=sum(cached(a) for name, _, _, a in w.native_tensors() if ".experts." in name))))
"""


def test_tokens_run_through_three_real_size_layers_of_the_sparse_inventory(inventory):
    path, _ = inventory
    # the load's memory check counts every expert of the three layers (10.3 GB), which a run that
    # routes to all of them would pack; this one packs three, so it is told 16 GB are available
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "ZEN5_MEM_AVAILABLE": str(16 << 30)}
    r = subprocess.run([sys.executable, "-c", RUN, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nV4 Flash, 3 of its layers from the sparse inventory: opened in {out['opened']:.1f} s, first token "
          f"after {out['first']:.1f} s (CPU: user {out['user']:.1f} s, system {out['system']:.1f} s); "
          f"arena {out['arena'] / 1e9:.2f} GB, experts packed "
          f"{out['packed'] / 1e6:.0f} of {out['experts'] / 1e9:.1f} GB; resident growth {out['growth'] / 1e9:.2f} GB, "
          f"peak {out['peak'] / 1e9:.2f} GB; experts' file pages cached {out['expert_cache'] / 1e6:.0f} MB")
    assert out["finite"] and out["shape"] == [7, 129280]
    # holes read as zeros: tid2eid routes every token of the hash layers to expert 0, so one expert
    # per layer is packed (3 x 3 matrices of 2048 x 4096 MXFP4 in 16-row groups), not 768
    one = 3 * 2048 * 4096 * 17 // 32
    assert out["packed"] == out["info"] == 3 * one and out["experts"] == 256 * 3 * one
    # nothing beyond what the kernels read: the arena, the packed experts and scratch
    assert out["peak"] < 1.15 * (out["arena"] + out["packed"]) + (300 << 20), out
    # nor read: of the routed experts' 10.3 GB of file, the page cache holds the sampled pages
    # (two per tensor) and the three packed experts (with their read-ahead). Read through the
    # mapping's read-around, the samples had put 9.8 GB there (read_ahead_kb 8192 on the Zen 3
    # VM; with the usual 128 KiB, 3,072 tensors x 2 x 128 KiB = 0.8 GB)
    assert out["expert_cache"] < 300e6, out["expert_cache"]
    # the bound is on the process's own work, its user CPU time to the first token (3.5 s here with
    # the page cache warm); the wall time is reported, not bounded: the rest of it is the kernel
    # zeroing pages (the holes' page cache and the arena), whose speed is the host's. On
    # this VM a first touch ran at 0.07-7 GB/s, and the same load took 5 s to 155 s of wall time
    assert out["user"] < 30, out
