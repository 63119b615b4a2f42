"""ruff over the Python sources (lint: pycodestyle, pyflakes; import order), configured in
pyproject.toml. A guardrail the team keeps on itself: an unused import, a shadowed name or an
import out of order fails the suite, not a later review."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: it is a test extra (pip install -e .[test])"
    r = subprocess.run([ruff, "check", "--no-cache", "python", "tests", "bench", "scripts"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
