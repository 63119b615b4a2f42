"""Load a repository file that is not part of the installed package (bench/, scripts/) as a
module under a name of the test's choosing, so two tests can hold separate copies."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
