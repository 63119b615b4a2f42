"""The ISA tiers this machine can test: every kernel, architecture, KV cache and reference
agreement test runs on each (ZEN5_FORCE_ISA picks one for a whole process; tests pass `isa=`).

With ZEN5_FORCE_ISA set, the forced tier counts as this machine's best and the tiers above it
are not tested: `ZEN5_FORCE_ISA=avx2 pytest` on an AVX-512 machine runs what an AVX2-only
machine runs."""
import os

from zen5 import _native

ALL = [(name, missing) for name, missing in _native.isa_tiers()]  # worst to best
_names = [name for name, _ in ALL]
_forced = os.environ.get("ZEN5_FORCE_ISA")
_cap = _names.index(_forced) if _forced in _names else len(_names) - 1
TIERS = [name for name, missing in ALL[:_cap + 1] if not missing]  # "ref" always first
FAST_TIERS = [t for t in TIERS if t != "ref"]                     # the SIMD tiers checked against ref
UNTESTED = {name: missing or f"above ZEN5_FORCE_ISA={_forced}" for name, missing in ALL if name not in TIERS}
