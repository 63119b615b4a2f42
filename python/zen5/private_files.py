"""Files that hold prompts or secrets are private to the user who runs zen5.

Checkpoints hold rendered prompts in clear text, and the thinking key is what makes a signature
or an encrypted reasoning blob ours: every directory zen5 creates for them is 0700 and every file
0600, as ssh keeps ~/.ssh. A directory that already exists keeps its mode: an operator who made
one group-readable (replicas sharing a checkpoint directory) chose that, and a 0700 directory
above a 0755 one already keeps others out.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600     # for os.open(..., flags, PRIVATE_FILE); the umask can only narrow it


def make_private_dir(path: str | os.PathLike) -> Path:
    """`mkdir -p` with each directory it creates 0700 (Path.mkdir(parents=True) gives the parents
    the default mode). Raises OSError when the path cannot be a directory (a read-only or full
    file system, a regular file in the way)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:   # a regular file above stops the walk: mkdir says ENOTDIR
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:               # another process made it meanwhile
            pass
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    return path
