"""What every bench script shares: appending result rows to bench/results/*.csv (the header is
written when the file is new), the commit a run measured and the CPU's name."""
from __future__ import annotations

import csv
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def commit() -> str:
    """The checked-out commit, with "+dirty" when csrc/, python/ or bench/ differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=RESULTS.parent.parent, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", "csrc", "python", "bench") else "")


def cpu_name() -> str:
    """The CPU model, as a file-name-safe string (names bench/results/<cpu>*.csv)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip().replace(" ", "_").replace("(R)", "")
    return platform.machine()


def append_rows(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
