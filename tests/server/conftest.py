"""Real server processes, one per model, shared by the model-backed server tests. Each skips with
the reason when its weights are absent."""
from __future__ import annotations

import pytest
from serverlib import start_server


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """The default model, with a small context so over-long prompts are cheap to build, and
    keep-alives every 0.1 s so a test sees them during one long prefill (half a second to a
    second on a quiet machine with the int8 path)."""
    srv = start_server("smollm2", tmp_path_factory.mktemp("server-smollm2"), "--ctx", "2048", "--threads", "2",
                       "--keepalive", "0.1")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory):
    srv = start_server("smollm2-tools", tmp_path_factory.mktemp("server-tools"), "--ctx", "4096", "--threads", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def dsml_server(tmp_path_factory):
    srv = start_server("dsml-tiny", tmp_path_factory.mktemp("server-dsml"), "--threads", "2")
    yield srv
    srv.stop()
