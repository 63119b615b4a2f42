"""The ISA tiers as a list: what each needs, what `zen5 info` says, what ZEN5_FORCE_ISA refuses,
and that no SIMD tier's object code can leak into the rest of the module."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import ALL, TIERS
from zen5 import _native

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "zen5", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_tiers_are_ordered_and_the_best_supported_one_is_chosen():
    assert [t for t, _ in ALL] == ["ref", "avx2", "avx2vnni", "avx512"]
    assert TIERS[0] == "ref"
    if "ZEN5_FORCE_ISA" not in os.environ:
        assert _native.isa == TIERS[-1]
    flags = Path("/proc/cpuinfo").read_text().split("\nflags")[1].split("\n")[0].split() if Path("/proc/cpuinfo").exists() else []
    if flags:  # the CPU's own word, independently of our CPUID reading
        need = {"avx2": {"avx2", "fma", "f16c"}, "avx2vnni": {"avx2", "fma", "f16c", "avx_vnni"},
                "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}}
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
        out = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
        weak = [line for line in out.splitlines() if re.match(r"^\S+ [WVu] ", line)]
        assert not weak, f"{obj.name} ({obj.parent.parent.parent.parent.name}) defines weak symbols: {weak[:5]}"
        # and the wider instructions stay in their tier: no zmm in the AVX2 builds, no vpdpbusd without VNNI
        tier = obj.parents[3].name.removeprefix("zen5_").removesuffix(".dir")
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                             check=True).stdout
        if tier in ("avx2", "avx2vnni"):
            assert "%zmm" not in asm and "%k1" not in asm, obj
        if tier == "avx2":
            assert "vpdpbusd" not in asm, obj
