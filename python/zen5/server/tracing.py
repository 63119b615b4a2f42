"""--trace FILE: one JSON line per request (the rendered prompt, the cache decision, the parsed
output). Prompts are in clear text, so the file is created private (0600)."""
from __future__ import annotations

import json
import os


class Tracer:
    """Appends records to the trace file; written on the worker thread only."""

    def __init__(self, path: str | None):
        self.file = None
        if path:
            # created 0600; an existing file keeps the mode its owner gave it
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.file = os.fdopen(fd, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
