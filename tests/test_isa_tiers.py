"""The ISA tiers as a list: what each needs, what `zen5 info` says, what ZEN5_FORCE_ISA refuses,
and that no SIMD tier's object code can leak into the rest of the module."""
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiers import ALL, TIERS
from zen5 import _native

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "zen5", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_tiers_are_ordered_and_the_best_supported_one_is_chosen():
    assert [t for t, _ in ALL] == ["ref", "avx2", "avx2vnni", "avx512", "amx"]
    assert TIERS[0] == "ref"
    if "ZEN5_FORCE_ISA" not in os.environ:
        assert _native.isa == TIERS[-1]
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split("\nflags")[1].split("\n")[0].split() if cpuinfo.exists() else []
    if flags:  # the CPU's own word, independently of our CPUID reading
        need = {"avx2": {"avx2", "fma", "f16c"}, "avx2vnni": {"avx2", "fma", "f16c", "avx_vnni"},
                "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
                "amx": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "amx_tile", "amx_int8"}}
        for tier, missing in ALL[1:]:
            assert (not missing) == need[tier].issubset(flags), (tier, missing)


def test_info_lists_every_tier_and_the_chosen_one():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert [t["name"] for t in info["tiers"]] == [t for t, _ in ALL]
    for t, (name, missing) in zip(info["tiers"], ALL):
        assert t["supported"] == (not missing) and t.get("missing", "") == missing
    assert info["isa"] == TIERS[-1]


@pytest.mark.parametrize("tier", [t for t, _ in ALL])
def test_force_isa(tier):
    """Every tier can be forced where it runs; where it does not, the error names what is missing."""
    missing = dict(ALL)[tier]
    r = _run("info", env={"ZEN5_FORCE_ISA": tier})
    if missing:
        assert r.returncode != 0 and f"ZEN5_FORCE_ISA={tier}" in r.stderr and missing in r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["isa"] == tier


def _tier_objects():
    return sorted(ROOT.glob("build/*/CMakeFiles/zen5_*.dir/csrc/kernels/*.o"))


@pytest.mark.skipif(not _tier_objects(), reason="no build tree here (installed from a wheel)")
def test_tier_objects_define_no_weak_symbols():
    """A weak symbol (an inline or template function: std::vector<float>::resize, std::min...)
    defined in a tier's object file may be the copy the linker keeps for the whole module, and then
    baseline code would run AVX-512 instructions on a CPU without them. Tier files keep their
    helpers static, so their objects define no weak symbols at all."""
    for obj in _tier_objects():
        out = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True,
                             check=True).stdout
        weak = [line for line in out.splitlines() if re.match(r"^\S+ [WVu] ", line)]
        assert not weak, f"{obj.name} ({obj.parents[2].name}) defines weak symbols: {weak[:5]}"
        # and the wider instructions stay in their tier: no zmm in the AVX2 builds, no vpdpbusd without VNNI
        tier = obj.parents[2].name.removeprefix("zen5_").removesuffix(".dir")  # CMakeFiles/zen5_<tier>.dir/csrc/kernels
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                             check=True).stdout
        if tier in ("avx2", "avx2vnni"):
            assert "%zmm" not in asm and "%k1" not in asm, obj
        if tier == "avx2":
            assert "vpdpbusd" not in asm, obj
        if tier != "amx":  # tile instructions only in the AMX tier's file
            assert "%tmm" not in asm, obj


QEMU = shutil.which("qemu-x86_64")
# Run in a child: the tiny models through the engine on the tier chosen at import, logits saved.
_FORWARD = """
import sys, numpy as np
from zen5 import _native
from zen5.engine import Engine
out = {"isa": np.array(_native.isa)}
for i, path in enumerate(sys.argv[2:]):
    for matmul, kv in (("int8", "f16"), ("int8", "q8_0"), ("f32", "f32")):
        eng = Engine.load(path, n_ctx=64, threads=2, matmul=matmul, kv_type=kv)
        out[f"{i}-{matmul}-{kv}"] = eng.native_ctx.eval(list(range(3, 40)), all_logits=True)
np.savez(sys.argv[1], **out)
"""


@pytest.mark.skipif(platform.machine() != "x86_64" or not QEMU,
                    reason="needs qemu-x86_64 (Debian qemu-user; .ci/run installs it)")
@pytest.mark.parametrize("cpu,tier", [("max", "avx2"), ("max,-avx,-avx2,-fma,-f16c", "ref")])
def test_dispatch_on_a_cpu_without_avx512(tmp_path, cpu, tier):
    """QEMU's user-mode CPUs have no AVX-512 (x86-tiers.md), so under
    them the best tier is chosen from what is really there, and any AVX-512 instruction reachable
    from the AVX2 tier's code (a leaked weak symbol, a wrong table entry) would kill the process
    with SIGILL. Tiny Q4_1, Q8_0 and BF16 models, int8 and f32 matmuls, f16 and q8_0 caches:
    the emulated run must give the same logits, bit for bit, as this machine forcing that tier."""
    from gguf import GGMLQuantizationType as Q

    import tiny_gguf

    paths = [str(tiny_gguf.write_gguf(tmp_path / f"m-{q.name}.gguf", matrix_type=q))
             for q in (Q.Q4_1, Q.Q8_0, Q.BF16)]
    env = {k: v for k, v in os.environ.items() if k != "ZEN5_FORCE_ISA"}
    emulated, native = tmp_path / "emulated.npz", tmp_path / "native.npz"
    r = subprocess.run([QEMU, "-cpu", cpu, sys.executable, "-c", _FORWARD, str(emulated), *paths],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, f"under qemu -cpu {cpu}: rc {r.returncode}\n{r.stderr[-3000:]}"
    r = subprocess.run([sys.executable, "-c", _FORWARD, str(native), *paths], capture_output=True, text=True,
                       timeout=300, env={**env, "ZEN5_FORCE_ISA": tier})
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = np.load(emulated), np.load(native)
    assert str(a["isa"]) == tier and str(b["isa"]) == tier
    for key in a.files:
        assert np.array_equal(a[key], b[key]), key
