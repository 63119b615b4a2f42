"""Disk KV checkpoints: string-prefix snapshots of the KV cache that survive restarts.

Memory holds the live session; disk is how a returning session, a switched client or a
restarted server resumes without a cold prefill. A checkpoint is keyed by the rendered *text* it
covers, not by token ids: a sampled token sequence and the re-tokenization of the same text can
differ, but the next request always arrives as text. Lookup finds the longest stored text that
is a byte prefix of the rendered prompt; the session restores its exact tokens and KV rows and
tokenizes and prefills only the remaining text (session.py, the "disk" rung of the ladder).

The directory is disposable: every file is checked before it is trusted, and a file that fails a
check (truncated, corrupted, other model, old format) is ignored and removed with a warning,
never restored. A full disk or an unwritable directory degrades to no disk cache with a warning;
the request being served always succeeds. Keep one directory per model: files of another model
found in it are removed as foreign. Files are 0600 and the directories the store creates 0700
(private_files.py): a checkpoint holds its prompt in clear text.

File format, version 1 (all integers little-endian)
====================================================
File name `<key>.z5kv`, key = the first 32 hex digits of SHA-256(text as UTF-8).

    offset size  field
    0      8     magic b"ZEN5CKPT"
    8      4     u32 format version (1)
    12     4     u32 header bytes (80)
    16     8     u64 model fingerprint (Model.fingerprint: config + every weight byte)
    24     4     u32 n_tokens, the tokens stored
    28     4     u32 n_ctx, the context size of the writer
    32     4     u32 n_vocab, the logits stored
    36     1     u8  save reason: 0 unknown, 1 cold, 2 continued, 3 evict, 4 shutdown
    37     1     u8  flags: bit 0 = a tool map is present
    38     2     u16 reserved, 0
    40     8     u64 created, unix milliseconds
    48     8     u64 last used, unix milliseconds  } mutable: rewritten in place on a hit and
    56     4     u32 hits                           } read as zero by both checksums
    60     4     u32 text_bytes
    64     4     u32 tool_bytes (0: no tool map)
    68     4     u32 meta CRC-32: the header (mutable fields and this one zeroed) + text + tool map
    72     8     u64 kv_bytes
    80           text: the rendered prompt prefix, UTF-8, exactly tokenizer.decode(tokens)
    +text        tool map: u32 count, then per call u32 index, u32 block_size and six strings
                 (u32 length + UTF-8): id, name, arguments, raw, block_raw, block_id (a
                 ToolRecord). Only calls whose sampled block lies inside the text are stored,
                 so exact replay of those calls survives a restart.
    +tools       tokens: u32 x n_tokens
    +4n          logits: f32 x n_vocab, the next-token logits after the last stored token
    +4V          KV: the native snapshot blob, kv_bytes long. DeepSeek V4 engines write their own
                 kind (DeepSeekV4Context.snapshot(), magic ZEN5DSV4: tokens, logits, raw window,
                 compressed and indexer rows, pending compressor inputs; deepseek_v4.cpp), which
                 a Llama-family context refuses and vice versa. Otherwise Context.snapshot()
                 (its own header with the build id, fingerprint, matmul path and KV type; per layer K then V rows
                 (n_tokens, kv_dim) in the cache's type (f32, f16, or int8 followed by the K then
                 V scales (n_head_kv, n_tokens) f32 for q8_0); the logits again; its own
                 checksum); restore is bit exact and refuses another matmul path or KV type
    end-4  4     u32 CRC-32 of every byte before it (mutable fields zeroed)

Why two checksums: the in-memory index reads only header + text + tool map of each file (text for
lookup, tool IDs for replay) and must trust those bytes without reading the KV rows; the trailing
CRC is checked when a checkpoint is loaded for restore.

Crash and concurrency safety: a file is written to `.<key>.<pid>.<random>.tmp` and renamed into
place, so a killed writer never leaves a half file under a real name, and two processes sharing
a directory never write the same temp file (a same-key race ends with one complete file: the last
rename wins). Temp files of dead writers are removed on the next scan. Files are not fsync'd by
default: after a power cut a file can at worst fail its checks and be removed.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import struct
import time
import zlib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from zen5.private_files import PRIVATE_FILE, make_private_dir
from zen5.tool_memory import ToolRecord

log = logging.getLogger(__name__)

MAGIC = b"ZEN5CKPT"
VERSION = 1
SUFFIX = ".z5kv"
REASONS = ("unknown", "cold", "continued", "evict", "shutdown")
FLAG_TOOLS = 1

_HEADER = struct.Struct("<8sIIQIIIBBHQQIIIIQ")
assert _HEADER.size == 80
_MUTABLE = (48, 60)        # last used + hits
_META_CRC = (68, 72)
_COUNTERS = struct.Struct("<QI")
_WRITE_CHUNK = 8 << 20     # plain writes in pieces: bounded syscalls, partial writes handled
_STALE_TEMP_S = 24 * 3600  # a temp file this old is removed even if its pid looks alive


class CheckpointError(Exception):
    """A file that fails its checks; it is never restored."""


class ForeignCheckpoint(CheckpointError):
    """A valid file written for another model."""


# ---- configuration -----------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointConfig:
    """Every knob of the disk cache, validated once; the CLI and the server derive from it."""
    byte_budget: int = 4 << 30        # total bytes of checkpoint files kept in the directory
    min_tokens: int = 512             # shorter states are not worth a file (prefill is quick)
    cold_max_tokens: int = 30000      # a fresh prompt longer than this gets no boundary save (0: never)
    interval_tokens: int = 10000      # continued saves at multiples of this, rounded up to the alignment (0: never)
    trim_tokens: int = 32             # the boundary save stays this far before a fresh prompt's end
    align_tokens: int = 1024          # boundaries and frontiers are multiples of this (0: no alignment)
    hit_half_life_s: float = 6 * 3600.0   # a hit's weight in the eviction score halves this often
    retry_after_s: float = 300.0      # after a failed write (disk full), saves pause this long
    fsync: bool = False               # see the module docstring: checksums make it optional

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "bool":
                ok = isinstance(v, bool)
            else:   # "int" knobs take ints only, "float" knobs ints or floats
                kinds = (int,) if f.type == "int" else (int, float)
                ok = isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            if not ok:
                raise ValueError(f"checkpoint {f.name} must be a {f.type} >= 0, got {v!r}")
        if self.byte_budget < 1 or self.min_tokens < 1:
            raise ValueError("checkpoint byte_budget and min_tokens must be >= 1")
        if self.cold_max_tokens and self.cold_max_tokens < self.min_tokens:
            raise ValueError(f"checkpoint cold_max_tokens must be 0 or >= min_tokens ({self.min_tokens})")
        if self.hit_half_life_s <= 0:
            raise ValueError("checkpoint hit_half_life_s must be > 0")

    def cold_boundary(self, n: int) -> int | None:
        """Where to save a fresh prompt of n tokens: trimmed so text appended after a slightly
        different tail (a changed last message, a dropped `<think>`) still matches, aligned down
        to a block; the whole prompt when that falls below the minimum. None: no save."""
        if not self.cold_max_tokens or not self.min_tokens <= n <= self.cold_max_tokens:
            return None
        b = n - self.trim_tokens
        if self.align_tokens:
            b -= b % self.align_tokens
        return b if b >= self.min_tokens else n

    @property
    def frontier_step(self) -> int:
        """Continued saves happen at multiples of this absolute position (0: never)."""
        if not self.interval_tokens:
            return 0
        a = self.align_tokens or 1
        return -(-self.interval_tokens // a) * a

    def frontiers(self, start: int, end: int) -> list[int]:
        """Frontier positions f with start < f <= end."""
        step = self.frontier_step
        return list(range(step * (start // step + 1), end + 1, step)) if step else []


# ---- index entries -----------------------------------------------------------------------
@dataclass
class Entry:
    """What the index knows of one file: its header, text and tool map (not the KV rows)."""
    key: str
    path: Path
    size: int
    fingerprint: int
    n_tokens: int
    n_ctx: int
    n_vocab: int
    reason: str
    created: float            # unix seconds
    last_used: float
    hits: int
    text: str
    tools: tuple[ToolRecord, ...] = ()
    stat_id: tuple = ()       # (inode, size, mtime_ns) when read: unchanged files are not re-read


@dataclass
class Checkpoint:
    entry: Entry
    tokens: list[int]
    logits: np.ndarray        # (n_vocab,) f32
    kv: bytes                 # native snapshot blob


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def score(e: Entry, now: float, half_life_s: float) -> float:
    """Eviction value: (hits decayed by time since last use + 1) x tokens per byte. Tokens per
    byte is the prefill a hit saves per byte of budget; fixed overhead (logits, text) makes short
    checkpoints less dense. Hits halve every half-life of disuse; below 0.01 they count as 0."""
    age = max(0.0, now - e.last_used)
    hits = e.hits * 0.5 ** (age / half_life_s)
    if hits < 0.01:
        hits = 0.0
    return (hits + 1.0) * e.n_tokens / max(1, e.size)


def eviction_order(entries: Iterable[Entry], now: float, half_life_s: float) -> list[Entry]:
    """Lowest score first; ties go to the least recently used."""
    return sorted(entries, key=lambda e: (score(e, now, half_life_s), e.last_used))


# ---- encoding ------------------------------------------------------------------------------
def _encode_tools(records: Sequence[ToolRecord]) -> bytes:
    if not records:
        return b""
    out = [struct.pack("<I", len(records))]
    for r in records:
        out.append(struct.pack("<II", r.index, r.block_size))
        for s in (r.id, r.name, r.arguments, r.raw, r.block_raw, r.block_id):
            b = s.encode("utf-8")
            out += [struct.pack("<I", len(b)), b]
    return b"".join(out)


def _decode_tools(buf: bytes) -> tuple[ToolRecord, ...]:
    try:
        (count,), pos, recs = struct.unpack_from("<I", buf), 4, []
        for _ in range(count):
            index, block_size = struct.unpack_from("<II", buf, pos)
            pos += 8
            strs = []
            for _ in range(6):
                (n,) = struct.unpack_from("<I", buf, pos)
                if pos + 4 + n > len(buf):
                    raise CheckpointError("tool map overruns its section")
                strs.append(buf[pos + 4: pos + 4 + n].decode("utf-8"))
                pos += 4 + n
            tid, name, args, raw, block_raw, block_id = strs
            recs.append(ToolRecord(tid, name, args, raw, block_raw, block_id, index, block_size))
    except (struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"tool map unreadable: {e}") from None
    if pos != len(buf):
        raise CheckpointError("tool map has trailing bytes")
    return tuple(recs)


@dataclass
class _Header:
    fingerprint: int
    n_tokens: int
    n_ctx: int
    n_vocab: int
    reason: int
    flags: int
    created_ms: int
    last_used_ms: int
    hits: int
    text_bytes: int
    tool_bytes: int
    meta_crc: int
    kv_bytes: int

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, _HEADER.size, self.fingerprint, self.n_tokens, self.n_ctx,
                            self.n_vocab, self.reason, self.flags, 0, self.created_ms, self.last_used_ms,
                            self.hits, self.text_bytes, self.tool_bytes, self.meta_crc, self.kv_bytes)

    @staticmethod
    def unpack(buf: bytes) -> "_Header":
        if len(buf) < _HEADER.size:
            raise CheckpointError(f"truncated: {len(buf)} bytes, shorter than the header")
        (magic, version, hbytes, fp, n_tok, n_ctx, n_vocab, reason, flags, _res, created, used, hits,
         tb, toolb, meta_crc, kvb) = _HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise CheckpointError("not a zen5 checkpoint (bad magic)")
        if version != VERSION or hbytes != _HEADER.size:
            raise CheckpointError(f"format version {version} is not supported (expected {VERSION})")
        return _Header(fp, n_tok, n_ctx, n_vocab, reason, flags, created, used, hits, tb, toolb, meta_crc, kvb)

    def file_size(self) -> int:
        return (_HEADER.size + self.text_bytes + self.tool_bytes + 4 * self.n_tokens + 4 * self.n_vocab
                + self.kv_bytes + 4)


def _zeroed(head: bytes, meta: bool) -> bytes:
    """The header as the checksums see it: mutable counters (and for the meta CRC, the meta CRC
    itself) read as zero."""
    b = bytearray(head)
    b[_MUTABLE[0]:_MUTABLE[1]] = bytes(_MUTABLE[1] - _MUTABLE[0])
    if meta:
        b[_META_CRC[0]:_META_CRC[1]] = bytes(4)
    return bytes(b)


def default_dir() -> Path:
    """Beside the per-install thinking key (session.py's default state directory)."""
    return Path.home() / ".cache" / "zen5" / "checkpoints"


def _now() -> float:
    return time.time()


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        n = os.write(fd, mv[:_WRITE_CHUNK])
        mv = mv[n:]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the store -------------------------------------------------------------------------------
class CheckpointStore:
    """A directory of checkpoints for one model, an in-memory index of their headers (refreshed
    by one directory scan; only new or changed files are read), a byte budget and eviction.

    `fingerprint` binds the store to a model (ChatSession does this with `attach`); unbound, the
    store only inspects (the `cache` CLI): bad files are reported in `problems`, not removed."""

    def __init__(self, directory: str | os.PathLike, byte_budget: int | None = None,
                 config: CheckpointConfig | None = None, *, fingerprint: int | None = None, **knobs):
        cfg = config or CheckpointConfig()
        if byte_budget is not None:
            knobs["byte_budget"] = byte_budget
        self.config = replace(cfg, **knobs) if knobs else cfg
        self.dir = Path(directory).expanduser()
        self.fingerprint = fingerprint
        self.problems: dict[str, str] = {}   # inspection mode: key -> why the file is unusable
        self._index: dict[str, Entry] = {}
        self._tools: dict[str, ToolRecord] = {}
        self._paused_until = 0.0
        self.enabled = self._open_dir()
        if self.enabled:
            self.refresh()
            if fingerprint is not None:
                self.evict()

    def _open_dir(self) -> bool:
        try:
            make_private_dir(self.dir)          # checkpoints hold prompts in clear text
        except OSError as e:
            log.warning("disk checkpoints disabled: cannot use %s (%s)", self.dir, e)
            return False
        if not os.access(self.dir, os.W_OK):
            log.warning("disk checkpoints read-only: %s is not writable; nothing will be saved", self.dir)
        return True

    def attach(self, fingerprint: int) -> None:
        """Bind to a model: files of other models are now foreign (removed on the next scan)."""
        if self.fingerprint is not None and self.fingerprint != fingerprint:
            raise ValueError(f"checkpoint store {self.dir} is bound to model {self.fingerprint:016x}, "
                             f"not {fingerprint:016x}; use one directory per model")
        self.fingerprint = fingerprint
        self._index.clear()
        if self.enabled:
            self.refresh()
            self.evict()

    # ---- the index ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """One scan of the directory; reads only files that are new or changed since last time."""
        if not self.enabled:
            return
        seen: set[str] = set()
        self.problems = {}
        try:
            with os.scandir(self.dir) as it:
                for de in it:
                    if de.name.startswith(".") and de.name.endswith(".tmp"):
                        self._clean_temp(de)
                    elif de.name.endswith(SUFFIX) and not de.name.startswith("."):
                        if self._index_file(de):
                            seen.add(de.name[: -len(SUFFIX)])
        except OSError as e:
            log.warning("disk checkpoints: cannot scan %s (%s)", self.dir, e)
            return
        for key in set(self._index) - seen:
            del self._index[key]
        self._tools = {r.id: r for e in self._index.values() for r in e.tools}

    def _index_file(self, de: os.DirEntry) -> bool:
        key = de.name[: -len(SUFFIX)]
        try:
            st = de.stat()
            sid = (st.st_ino, st.st_size, st.st_mtime_ns)
            old = self._index.get(key)
            if old is not None and old.stat_id == sid:
                return True
            self._index[key] = self._read_entry(Path(de.path), key, st.st_size, sid)
            self.problems.pop(key, None)
            return True
        except FileNotFoundError:
            return False  # removed by another process meanwhile
        except (CheckpointError, OSError) as e:
            self._bad_file(Path(de.path), key, e)
            return False

    def _read_entry(self, path: Path, key: str, size: int, sid: tuple) -> Entry:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            h = _Header.unpack(head)
            if size != h.file_size():
                raise CheckpointError(f"truncated or padded: {size} bytes, the header says {h.file_size()}")
            meta = f.read(h.text_bytes + h.tool_bytes)
        if zlib.crc32(meta, zlib.crc32(_zeroed(head, meta=True))) != h.meta_crc:
            raise CheckpointError("header checksum mismatch (corrupted)")
        try:
            text = meta[: h.text_bytes].decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError("text is not UTF-8") from None
        if text_key(text) != key:
            raise CheckpointError("file name does not match its text")
        if self.fingerprint is not None and h.fingerprint != self.fingerprint:
            raise ForeignCheckpoint(f"written for model {h.fingerprint:016x}, not {self.fingerprint:016x}")
        tools = _decode_tools(meta[h.text_bytes:]) if h.flags & FLAG_TOOLS else ()
        reason = REASONS[h.reason] if h.reason < len(REASONS) else "unknown"
        return Entry(key, path, size, h.fingerprint, h.n_tokens, h.n_ctx, h.n_vocab, reason,
                     h.created_ms / 1000, h.last_used_ms / 1000, h.hits, text, tools, sid)

    def _bad_file(self, path: Path, key: str, why: Exception) -> None:
        self._index.pop(key, None)
        if self.fingerprint is None:
            self.problems[key] = str(why)  # inspection: report, leave the file alone
            return
        log.warning("disk checkpoint %s ignored and removed: %s", path.name, why)
        path.unlink(missing_ok=True)

    def _clean_temp(self, de: os.DirEntry) -> None:
        """Remove a temp file whose writer is dead (killed mid-write). Name: .<key>.<pid>.<rand>.tmp"""
        parts = de.name.split(".")
        try:
            pid = int(parts[2])
            age = _now() - de.stat().st_mtime
        except (IndexError, ValueError, OSError):
            return
        if pid == os.getpid() or (_pid_alive(pid) and age < _STALE_TEMP_S):
            return
        try:
            os.unlink(de.path)
            log.info("disk checkpoints: removed %s left by a dead writer", de.name)
        except OSError:
            pass

    def entries(self) -> list[Entry]:
        self.refresh()
        return sorted(self._index.values(), key=lambda e: e.last_used, reverse=True)

    def get(self, key_prefix: str) -> Entry | None:
        """The entry whose key starts with `key_prefix` (unique), else None."""
        self.refresh()
        found = [e for k, e in self._index.items() if k.startswith(key_prefix)]
        return found[0] if len(found) == 1 else None

    def has(self, text: str) -> bool:
        e = self._index.get(text_key(text))
        return e is not None and e.text == text and e.path.exists()

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self._index.values())

    # ---- lookup and load ------------------------------------------------------------------------
    def lookup(self, prompt: str, max_tokens: int | None = None) -> list[Entry]:
        """Checkpoints whose text is a prefix of `prompt`, longest first (a str prefix of valid
        text is a byte prefix of its UTF-8)."""
        if not self.enabled or self.fingerprint is None:
            return []
        self.refresh()
        found = [e for e in self._index.values()
                 if e.n_tokens >= self.config.min_tokens and (max_tokens is None or e.n_tokens <= max_tokens)
                 and prompt.startswith(e.text)]
        return sorted(found, key=lambda e: len(e.text), reverse=True)

    def load(self, entry: Entry) -> Checkpoint | None:
        """Read and verify a whole file. None if it vanished or fails a check (then it is removed
        with a warning)."""
        try:
            ck = self._read_checkpoint(entry)
        except FileNotFoundError:
            self._index.pop(entry.key, None)
            return None
        except CheckpointError as e:
            self._bad_file(entry.path, entry.key, e)
            return None
        except OSError as e:
            log.warning("disk checkpoint %s unreadable: %s", entry.path.name, e)
            return None
        return ck

    def _read_checkpoint(self, entry: Entry) -> Checkpoint:
        with open(entry.path, "rb") as f:
            head = f.read(_HEADER.size)
            h = _Header.unpack(head)
            if os.fstat(f.fileno()).st_size != h.file_size():
                raise CheckpointError("truncated or padded since it was indexed")
            parts = [f.read(n) for n in (h.text_bytes + h.tool_bytes, 4 * h.n_tokens, 4 * h.n_vocab,
                                         h.kv_bytes, 4)]
        if any(len(p) != n for p, n in zip(parts, (h.text_bytes + h.tool_bytes, 4 * h.n_tokens,
                                                    4 * h.n_vocab, h.kv_bytes, 4))):
            raise CheckpointError("truncated while reading")
        meta, tok_b, logit_b, kv, trailer = parts
        crc = zlib.crc32(_zeroed(head, meta=False))
        for p in (meta, tok_b, logit_b, kv):
            crc = zlib.crc32(p, crc)
        if struct.pack("<I", crc) != trailer:
            raise CheckpointError("checksum mismatch (corrupted)")
        if meta[: h.text_bytes].decode("utf-8") != entry.text or h.n_tokens != entry.n_tokens:
            raise FileNotFoundError("replaced since it was indexed")  # another writer: a miss
        if self.fingerprint is not None and h.fingerprint != self.fingerprint:
            raise ForeignCheckpoint(f"written for model {h.fingerprint:016x}")
        tokens = np.frombuffer(tok_b, "<u4").astype(np.int64).tolist()
        return Checkpoint(entry, tokens, np.frombuffer(logit_b, "<f4").copy(), kv)

    def discard(self, entry: Entry, why: str) -> None:
        """A checkpoint the engine refused (BadSnapshot, ModelMismatch): remove it."""
        self._bad_file(entry.path, entry.key, CheckpointError(why))

    def touch(self, entry: Entry) -> None:
        """Count a hit: hits + 1 and last used = now, written in place (best effort: only these
        12 bytes change, and no checksum covers them)."""
        entry.hits += 1
        entry.last_used = _now()
        try:
            with open(entry.path, "r+b") as f:
                f.seek(_MUTABLE[0])
                f.write(_COUNTERS.pack(int(entry.last_used * 1000), entry.hits))
            st = entry.path.stat()
            entry.stat_id = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            pass

    def tool_records(self, ids: Iterable[str]) -> list[ToolRecord]:
        """Tool-ID map entries found in checkpoint files, for the IDs asked for."""
        if not self.enabled or self.fingerprint is None:
            return []
        self.refresh()
        return [self._tools[i] for i in ids if i in self._tools]

    # ---- save -----------------------------------------------------------------------------------
    @property
    def writable(self) -> bool:
        return (self.enabled and self.fingerprint is not None and _now() >= self._paused_until
                and os.access(self.dir, os.W_OK))

    def save(self, text: str, tokens: Sequence[int], logits: np.ndarray, kv: bytes, n_ctx: int,
             reason: str, tools: Sequence[ToolRecord] = ()) -> Entry | None:
        """Write one checkpoint (temp file + rename), then evict down to the budget, the new
        file protected. None when it does not fit the budget or the write failed (a warning;
        saves pause for `retry_after_s`)."""
        if not self.writable:
            return None
        text_b, tool_b = text.encode("utf-8"), _encode_tools(tools)
        tok_b = np.asarray(tokens, dtype="<u4").tobytes()
        logit_b = np.ascontiguousarray(logits, dtype="<f4").tobytes()
        now_ms = int(_now() * 1000)
        h = _Header(self.fingerprint, len(tokens), n_ctx, len(logit_b) // 4, REASONS.index(reason),
                    FLAG_TOOLS if tool_b else 0, now_ms, now_ms, 0, len(text_b), len(tool_b), 0, len(kv))
        size = h.file_size()
        if size > self.config.byte_budget:
            log.info("disk checkpoint of %d bytes not written: over the budget of %d", size,
                     self.config.byte_budget)
            return None
        h.meta_crc = zlib.crc32(text_b + tool_b, zlib.crc32(_zeroed(h.pack(), meta=True)))
        head = h.pack()
        key = text_key(text)
        path = self.dir / f"{key}{SUFFIX}"
        if not self._write_file(path, key, [head, text_b, tool_b, tok_b, logit_b, kv], _zeroed(head, meta=False)):
            return None
        st = path.stat()
        entry = Entry(key, path, size, self.fingerprint, len(tokens), n_ctx, h.n_vocab, reason,
                      now_ms / 1000, now_ms / 1000, 0, text, tuple(tools), (st.st_ino, st.st_size, st.st_mtime_ns))
        self._index[key] = entry
        self._tools.update((r.id, r) for r in tools)
        self.evict(protect=key)
        log.info("disk checkpoint %s saved: %d tokens, %s, %d bytes", key[:12], len(tokens), reason, size)
        return entry

    def _write_file(self, path: Path, key: str, parts: list, crc_head: bytes) -> bool:
        tmp = self.dir / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        crc = zlib.crc32(crc_head)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
            try:
                for i, p in enumerate(parts):
                    _write_all(fd, p)
                    if i:
                        crc = zlib.crc32(p, crc)
                _write_all(fd, struct.pack("<I", crc))
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return True
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._paused_until = _now() + self.config.retry_after_s
            log.warning("disk checkpoint not saved (%s); disk cache writes paused for %.0f s, "
                        "requests continue without it", e, self.config.retry_after_s)
            return False

    # ---- budget ---------------------------------------------------------------------------------
    def evict(self, protect: str | None = None) -> list[str]:
        """Remove the lowest-scoring files until the directory fits the budget. `protect` (the
        file just written) survives unless it alone exceeds the budget."""
        budget = self.config.byte_budget
        total = self.nbytes
        if total <= budget:
            return []
        keep = self._index.get(protect) if protect else None
        if keep is not None and keep.size > budget:
            keep = None
        removed = []
        for e in eviction_order(list(self._index.values()), _now(), self.config.hit_half_life_s):
            if total <= budget:
                break
            if e is keep:
                continue
            self._remove(e)
            total -= e.size
            removed.append(e.key)
        if removed:
            log.info("disk checkpoints evicted %d file(s) to fit %d bytes", len(removed), budget)
        return removed

    def _remove(self, e: Entry) -> None:
        self._index.pop(e.key, None)
        for r in e.tools:
            self._tools.pop(r.id, None)
        try:
            e.path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("disk checkpoint %s could not be removed: %s", e.path.name, err)

    def remove(self, key_prefix: str) -> bool:
        e = self.get(key_prefix)
        if e is None:
            return False
        self._remove(e)
        return True

    def clear(self) -> int:
        """Remove every checkpoint file (and temp files of dead writers); returns the count."""
        self.refresh()
        n = 0
        for e in list(self._index.values()):
            self._remove(e)
            n += 1
        for key in list(self.problems):
            (self.dir / f"{key}{SUFFIX}").unlink(missing_ok=True)
            del self.problems[key]
            n += 1
        return n
