"""What every bench script shares: appending result rows to bench/results/*.csv (the header is
written when the file is new) and the commit a run measured."""
from __future__ import annotations

import csv
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def append_rows(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
