"""The ISA tiers this machine can test: every kernel, architecture, KV cache and reference
agreement test runs on each (ZEN5_FORCE_ISA picks one for a whole process; tests pass `isa=`)."""
from zen5 import _native

ALL = [(name, missing) for name, missing in _native.isa_tiers()]  # worst to best
TIERS = [name for name, missing in ALL if not missing]            # "ref" always first
FAST_TIERS = [t for t in TIERS if t != "ref"]                     # the SIMD tiers checked against ref
UNTESTED = {name: missing for name, missing in ALL if missing}
