"""What every bench script shares: appending result rows to bench/results/*.csv (the header is
written when the file is new), the commit a run measured and the CPU's name."""
from __future__ import annotations

import csv
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def commit() -> str:
    """The checked-out commit, with "+dirty" when csrc/, python/ or bench/ differ from it (not
    bench/results: an earlier run's uncommitted rows change no code)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=RESULTS.parent.parent, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", "csrc", "python", "bench", ":!bench/results") else "")


# AMD (family, model range) -> core generation, for the generic model names some VMs report
# ("AMD EPYC"), which would otherwise give a Zen 3 and a Zen 4 machine the same results files.
_AMD_CORES = (((25, 0x00, 0x0F), "Zen3"), ((25, 0x20, 0x2F), "Zen3"), ((25, 0x40, 0x5F), "Zen3"),
              ((25, 0x10, 0x1F), "Zen4"), ((25, 0x60, 0xAF), "Zen4"), ((26, 0x00, 0xFF), "Zen5"),
              ((23, 0x00, 0xFF), "Zen2"))


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU model, as a file-name-safe string (names bench/results/<cpu>*.csv).

    The "model name" line, spaces as "_" and "(R)" dropped: "Intel_Xeon_Processor" on the
    Xeon (the name its results already carry). A model name without a model number (no digit,
    e.g. "AMD EPYC" in a VM) gets the AMD core generation from family/model ("AMD_EPYC_Zen4"),
    or "_f<family>m<model>" for a family this table does not know, so a Zen 3 and a Zen 4 guest
    never share a file. Intel's generic name is kept as it is (its existing results continue)."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    info: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            info.setdefault(k.strip(), v.strip())
    name = info.get("model name")
    if not name:
        return platform.machine()
    out = name.replace(" ", "_").replace("(R)", "")
    if info.get("vendor_id") == "AuthenticAMD" and not any(c.isdigit() for c in name):
        try:
            fam, model = int(info.get("cpu family", "")), int(info.get("model", ""))
        except ValueError:
            return out
        core = next((c for (f, lo, hi), c in _AMD_CORES if f == fam and lo <= model <= hi), f"f{fam}m{model}")
        out += f"_{core}"
    return out


def append_rows(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
