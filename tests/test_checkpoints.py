"""Disk KV checkpoints: the file format, lookup, eviction, faults, and restarts on real weights.

The store tests (no marker) write synthetic checkpoints (any bytes stand in for the KV blob) and
run in a few seconds. The `model` tests drive ChatSession on SmolLM2 with scripted model output
(`scripted` from test_session.py) and restart in a fresh process to show a restored checkpoint
gives the uninterrupted session's next-token logits bit for bit.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from zen5 import checkpoints as ckmod
from zen5.checkpoints import SUFFIX, CheckpointConfig, CheckpointStore, Entry, eviction_order, score, text_key
from zen5.tool_memory import ToolRecord

FP = 0x1234_5678_9ABC_DEF0
ROOT = Path(__file__).resolve().parents[1]


def store_at(path, **knobs) -> CheckpointStore:
    knobs.setdefault("min_tokens", 1)
    return CheckpointStore(path, fingerprint=FP, **knobs)


def save(st: CheckpointStore, text: str, n_tokens: int = 8, kv_bytes: int = 1000, reason="cold", tools=()):
    kv = bytes((i * 7) % 251 for i in range(kv_bytes))
    return st.save(text, list(range(n_tokens)), np.arange(16, dtype=np.float32), kv, 4096, reason, tools)


def only_file(path) -> Path:
    (f,) = [p for p in Path(path).iterdir() if p.name.endswith(SUFFIX)]
    return f


def run_py(code: str, *args, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


# ---- format -----------------------------------------------------------------------------------
def test_format_round_trip_and_documented_layout(tmp_path):
    st = store_at(tmp_path)
    rec = ToolRecord("call_" + "a" * 32, "get_weather", '{"city": "Oslo"}', "<tool_call>x</tool_call>",
                     "<tool_call>x</tool_call>", "call_" + "a" * 32, 0, 1)
    e = save(st, "héllo <tool_call>x</tool_call>", n_tokens=5, kv_bytes=333, tools=[rec])
    path = only_file(tmp_path)
    assert path.name == text_key("héllo <tool_call>x</tool_call>") + SUFFIX == e.key + SUFFIX
    raw = path.read_bytes()
    # the header fields at the offsets the module docstring documents
    assert raw[:8] == b"ZEN5CKPT"
    assert struct.unpack_from("<IIQIII", raw, 8) == (1, 80, FP, 5, 4096, 16)
    assert raw[36] == 1 and raw[37] == 1                      # reason cold, tool map present
    text_b = "héllo <tool_call>x</tool_call>".encode()
    assert struct.unpack_from("<I", raw, 60)[0] == len(text_b) and raw[80:80 + len(text_b)] == text_b
    assert len(raw) == path.stat().st_size == e.size
    assert struct.unpack("<I", raw[-4:])[0] == zlib.crc32(raw[:48] + bytes(12) + raw[60:-4])
    ck = CheckpointStore(tmp_path, fingerprint=FP).load(e)   # a fresh index reads it back
    assert ck.tokens == [0, 1, 2, 3, 4] and ck.logits.tolist() == list(range(16))
    assert ck.kv == bytes((i * 7) % 251 for i in range(333))
    assert ck.entry.tools == (rec,) and ck.entry.reason == "cold"


def test_hits_are_counted_in_place_and_the_file_still_verifies(tmp_path):
    st = store_at(tmp_path)
    e = save(st, "counted")
    st.touch(e)
    st.touch(e)
    again = CheckpointStore(tmp_path, fingerprint=FP)
    (e2,) = again.entries()
    assert e2.hits == 2 and e2.last_used >= e2.created
    assert again.load(e2) is not None


def test_config_is_validated_and_boundaries_align():
    cfg = CheckpointConfig()
    assert cfg.frontier_step == 10240 and cfg.frontiers(0, 30000) == [10240, 20480]
    assert cfg.frontiers(10240, 10240) == [] and cfg.frontiers(10239, 10240) == [10240]
    assert cfg.cold_boundary(11011) == 10240          # (11011 - 32) aligned down to 1024
    assert cfg.cold_boundary(1500) == 1024 and cfg.cold_boundary(1000) == 1000   # below the minimum: whole
    assert cfg.cold_boundary(100) is None and cfg.cold_boundary(40000) is None
    assert CheckpointConfig(align_tokens=0, trim_tokens=32).cold_boundary(3500) == 3468
    assert CheckpointConfig(align_tokens=1000).cold_boundary(3500) == 3000
    assert CheckpointConfig(interval_tokens=0).frontiers(0, 10 ** 6) == []
    assert CheckpointConfig(cold_max_tokens=0).cold_boundary(5000) is None
    for bad in (dict(min_tokens=0), dict(byte_budget=0), dict(trim_tokens=-1), dict(align_tokens=1.5),
                dict(cold_max_tokens=10), dict(hit_half_life_s=0), dict(fsync=1), dict(retry_after_s=float("nan"))):
        with pytest.raises(ValueError):
            CheckpointConfig(**bad)
    st = CheckpointStore("/nonexistent-unused", byte_budget=5, config=CheckpointConfig(min_tokens=3))
    assert st.config.byte_budget == 5 and st.config.min_tokens == 3


# ---- lookup and index -------------------------------------------------------------------------
def test_lookup_is_the_longest_byte_prefix(tmp_path):
    st = store_at(tmp_path)
    for text, n in (("system: be brief.", 10), ("system: be brief. user: hi", 20), ("system: be long.", 30)):
        save(st, text, n_tokens=n)
    prompt = "system: be brief. user: hi there"
    assert [e.text for e in st.lookup(prompt)] == ["system: be brief. user: hi", "system: be brief."]
    assert st.lookup("system: be brief! user: hi there") == []          # one changed byte
    assert [e.n_tokens for e in st.lookup(prompt, max_tokens=15)] == [10]   # must fit the context
    assert [e.n_tokens for e in store_at(tmp_path, min_tokens=15).lookup(prompt)] == [20]


def test_index_reads_only_new_or_changed_files(tmp_path, monkeypatch):
    st = store_at(tmp_path)
    for i in range(5):
        save(st, f"text {i}")
    reads = []
    orig = CheckpointStore._read_entry
    monkeypatch.setattr(CheckpointStore, "_read_entry", lambda self, *a: reads.append(a[1]) or orig(self, *a))
    other = store_at(tmp_path)
    assert len(reads) == 5
    assert [e.text for e in other.lookup("text 3 and more")] == ["text 3"]
    other.refresh()
    assert len(reads) == 5                         # unchanged files are not re-read
    save(st, "text 5")                             # another process adds one
    assert [e.text for e in other.lookup("text 5!")] == ["text 5"] and len(reads) == 6
    (tmp_path / (text_key("text 0") + SUFFIX)).unlink()
    assert len(other.entries()) == 5


# ---- faults -----------------------------------------------------------------------------------
def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        raw = raw[: len(raw) - 100]
    elif how == "truncate_header":
        raw = raw[:40]
    elif how in ("flip_header", "flip_text", "flip_kv", "flip_trailer"):
        pos = {"flip_header": 26, "flip_text": 82, "flip_kv": len(raw) - 500, "flip_trailer": len(raw) - 2}[how]
        raw[pos] ^= 0x10
    elif how == "old_version":
        raw[8:12] = struct.pack("<I", 0)
    elif how == "not_ours":
        raw[:8] = b"GGUF\x00\x00\x00\x00"
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["truncate", "truncate_header", "flip_header", "flip_text", "flip_kv",
                                 "flip_trailer", "old_version", "foreign", "not_ours"])
def test_damaged_files_are_detected_removed_and_never_restored(tmp_path, caplog, how):
    if how == "foreign":   # a valid file of another model
        e = save(CheckpointStore(tmp_path, fingerprint=FP ^ 1, min_tokens=1), "a prompt prefix " * 4)
    else:
        e = save(store_at(tmp_path), "a prompt prefix " * 4, kv_bytes=4000)
        _damage(e.path, how)
    caplog.set_level(logging.WARNING, "zen5.checkpoints")
    fresh = CheckpointStore(tmp_path, fingerprint=FP, min_tokens=1)
    found = fresh.lookup("a prompt prefix " * 5)
    if found:   # damage in the KV rows or the trailer is found when the file is loaded
        assert how in ("flip_kv", "flip_trailer")
        assert fresh.load(found[0]) is None
    assert not e.path.exists() and fresh.entries() == []
    assert any("removed" in r.getMessage() for r in caplog.records), how
    if how == "foreign":
        assert "written for model" in caplog.text


def test_inspection_reports_bad_files_without_removing_them(tmp_path):
    e = save(store_at(tmp_path), "x" * 40)
    _damage(e.path, "flip_text")
    st = CheckpointStore(tmp_path)                     # no fingerprint: the CLI's view
    assert st.entries() == [] and "checksum" in st.problems[e.key] and e.path.exists()


def test_killed_writer_never_leaves_a_half_file_under_a_real_name(tmp_path):
    writer = """
        import sys, numpy as np
        from zen5.checkpoints import CheckpointStore
        st = CheckpointStore(sys.argv[1], fingerprint=%d, min_tokens=1, byte_budget=400 << 20)
        kv = bytes(120 << 20)
        for i in range(10 ** 6):
            st.save(f"text {i}", list(range(100)), np.zeros(16, np.float32), kv, 4096, "cold")
    """ % FP
    for _attempt in range(5):   # a kill between two files (no temp) is retried
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(writer), str(tmp_path)], cwd=ROOT)
        try:
            deadline = time.time() + 120
            while time.time() < deadline:   # at least one file done, and the next one mid-write
                names = os.listdir(tmp_path)
                if any(n.endswith(SUFFIX) for n in names) and any(n.endswith(".tmp") for n in names):
                    break
                time.sleep(0.002)
            p.send_signal(signal.SIGKILL)
        finally:
            p.wait()
        names = os.listdir(tmp_path)
        if any(n.endswith(".tmp") for n in names):
            break
    assert any(n.endswith(".tmp") for n in names), "the kill did not land mid-write"
    st = CheckpointStore(tmp_path, fingerprint=FP, min_tokens=1, byte_budget=400 << 20)
    real = [n for n in names if n.endswith(SUFFIX)]
    assert len(st.entries()) == len(real) and not st.problems
    assert all(st.load(e) is not None for e in st.entries())          # every real file is whole
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]   # the dead writer's temp is gone


def test_two_processes_share_one_directory(tmp_path):
    writer = """
        import os, sys, numpy as np
        from zen5.checkpoints import CheckpointStore
        st = CheckpointStore(sys.argv[1], fingerprint=%d, min_tokens=1)
        for i in range(40):
            for text in (f"shared {i %% 8}", f"own {os.getpid()} {i}"):
                st.save(text, list(range(50)), np.zeros(16, np.float32), os.urandom(1 << 20), 4096, "cold")
    """ % FP
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(writer), str(tmp_path)], cwd=ROOT)
             for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    st = CheckpointStore(tmp_path, fingerprint=FP, min_tokens=1)
    assert len(st.entries()) == 8 + 80 and not st.problems
    assert all(st.load(e) is not None for e in st.entries())
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def _enospc(*_a, **_k):
    raise OSError(28, "No space left on device")


def test_full_disk_degrades_to_no_disk_cache(tmp_path, caplog, monkeypatch):
    st = store_at(tmp_path, retry_after_s=3600)
    save(st, "before")
    monkeypatch.setattr(ckmod, "_write_all", _enospc)
    caplog.set_level(logging.WARNING, "zen5.checkpoints")
    assert save(st, "while full") is None
    assert "No space left" in caplog.text and not st.writable
    assert [e.text for e in st.entries()] == ["before"]              # reads still work
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    monkeypatch.undo()
    assert save(st, "still paused") is None                            # until retry_after_s


def test_full_tmpfs_and_read_only_dir(tmpfs, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "zen5.checkpoints")
    small = store_at(tmpfs("size=1m"))
    assert save(small, "fits", kv_bytes=200_000) is not None
    assert save(small, "too big for the disk", kv_bytes=2_000_000) is None
    assert "No space left" in caplog.text
    assert [n for n in os.listdir(small.dir)] == [text_key("fits") + SUFFIX]   # no half file, no temp
    ro = store_at(tmpfs("size=1m,ro"))
    assert not ro.writable and save(ro, "x") is None and "not writable" in caplog.text


def test_unusable_directory_disables_the_store(tmp_path, caplog):
    (tmp_path / "a_file").write_text("")
    caplog.set_level(logging.WARNING, "zen5.checkpoints")
    st = store_at(tmp_path / "a_file" / "checkpoints")
    assert not st.enabled and not st.writable and "disabled" in caplog.text
    assert st.lookup("anything") == [] and save(st, "anything") is None and st.tool_records(["x"]) == []


def test_checkpoint_files_and_the_directories_made_for_them_are_private(tmp_path):
    """Issue 19 (security): checkpoints hold rendered prompts in clear text, and were created 0644
    in 0755 directories. Files are 0600 and every directory the store creates 0700 (under the
    usual umask 022); a directory that already exists keeps its mode."""
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)   # noqa: E731
    (tmp_path / "shared").mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        e = save(store_at(tmp_path / "shared" / "state" / "checkpoints" / "model"), "a private prompt")
    finally:
        os.umask(old)
    assert mode(e.path) == 0o600
    assert [mode(tmp_path / "shared" / d) for d in ("state", "state/checkpoints", "state/checkpoints/model")] \
        == [0o700] * 3
    assert mode(tmp_path / "shared") == 0o755


# ---- budget and eviction ---------------------------------------------------------------------
def _entry(key, tokens, size, hits=0, last_used=1000.0) -> Entry:
    return Entry(key, Path(key), size, FP, tokens, 4096, 16, "cold", 0.0, last_used, hits, key)


def test_eviction_order_follows_the_score_rules():
    now, hl = 10_000.0, 100.0
    # fewer tokens per byte goes first
    assert [e.key for e in eviction_order([_entry("dense", 100, 1000), _entry("sparse", 100, 2000)], now, hl)] \
        == ["sparse", "dense"]
    # recent hits outweigh density
    hot = _entry("hot", 100, 2000, hits=4, last_used=now)
    assert [e.key for e in eviction_order([hot, _entry("cold", 100, 1000, last_used=now)], now, hl)][0] == "cold"
    # 10 hits 14 half-lives ago have decayed to nothing: a fresh, denser entry wins
    stale = _entry("stale", 100, 1000, hits=10, last_used=now - 14 * hl)
    fresh = _entry("fresh", 150, 1000, last_used=now)
    assert score(stale, now, hl) == 100 / 1000
    assert [e.key for e in eviction_order([fresh, stale], now, hl)] == ["stale", "fresh"]
    # hits decay smoothly: one half-life halves them
    assert score(_entry("h", 100, 1000, hits=2, last_used=now - hl), now, hl) == pytest.approx(2 * 100 / 1000)
    # equal scores: the least recently used goes first
    older, newer = _entry("older", 100, 1000, last_used=5.0), _entry("newer", 100, 1000, last_used=6.0)
    assert [e.key for e in eviction_order([newer, older], now, hl)] == ["older", "newer"]


def test_budget_protects_the_new_file_unless_it_alone_is_too_big(tmp_path):
    st = store_at(tmp_path, byte_budget=10_000)
    a = save(st, "a dense old one", n_tokens=400, kv_bytes=2000)
    b = save(st, "another dense one", n_tokens=400, kv_bytes=2000)
    # the new file is the least dense, yet survives: the others make room
    c = save(st, "a sparse new one", n_tokens=10, kv_bytes=4000)
    assert c is not None and c.path.exists() and st.nbytes <= 10_000
    assert sum(x.path.exists() for x in (a, b)) == 1
    assert save(st, "bigger than the budget", kv_bytes=20_000) is None     # never written
    # protection is dropped when the protected file alone exceeds the budget
    survivor = a if a.path.exists() else b
    st.config = replace(st.config, byte_budget=survivor.size)
    assert st.evict(protect=c.key) == [c.key] and survivor.path.exists()


def test_tool_records_are_served_from_the_index(tmp_path):
    st = store_at(tmp_path)
    recs = [ToolRecord(f"call_{i}", "f", "{}", f"<c{i}>", "<c0><c1>", "call_0", i, 2) for i in range(2)]
    save(st, "history <c0><c1>", tools=recs)
    fresh = CheckpointStore(tmp_path, fingerprint=FP)
    assert fresh.tool_records(["call_1", "call_9", "call_0"]) == [recs[1], recs[0]]


# ---- the cache CLI ------------------------------------------------------------------------------
def test_cache_cli(tmp_path, capsys):
    from zen5.__main__ import main

    st = store_at(tmp_path)
    e1 = save(st, "system prompt\nuser: first question", n_tokens=600, reason="shutdown")
    save(st, "another conversation", n_tokens=50, reason="evict")
    assert main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert e1.key[:12] in out and "shutdown" in out and "600" in out and "first question" in out
    assert "2 checkpoint(s)" in out
    assert main(["cache", "show", e1.key[:6], "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("--- text ---")[0])["tokens"] == 600 and "user: first question" in out
    assert main(["cache", "rm", e1.key[:8], "--dir", str(tmp_path)]) == 0
    assert not e1.path.exists()
    assert main(["cache", "show", "zzzz", "--dir", str(tmp_path)]) == 2
    assert main(["cache", "ls", "--dir", str(tmp_path / "missing")]) == 2 and not (tmp_path / "missing").exists()
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 file" in capsys.readouterr().out and not os.listdir(tmp_path)


# ---- sessions on real weights -------------------------------------------------------------------
from test_session import assistant_turn, calls_of, chatml_calls, dsml_calls, run, scripted  # noqa: E402
from zen5.chat_types import ChatError, ChatRequest, Message, ToolResultBlock  # noqa: E402
from zen5.engine import Engine  # noqa: E402
from zen5.session import ChatSession  # noqa: E402

KNOBS = dict(min_tokens=64, align_tokens=64, trim_tokens=16)
SYSTEM = "You are the build assistant for project zen5.\n" + "\n".join(
    f"Rule {i}: when src/module_{i}.py changes, run tests/test_module_{i}.py and report each "
    "failure with its line number." for i in range(80))
RESTART = """
    import json, sys
    import numpy as np
    sys.path.insert(0, "tests")
    from test_session import scripted
    from zen5.chat_types import ChatRequest, Message
    from zen5.checkpoints import CheckpointStore
    from zen5.engine import Engine
    from zen5.session import ChatSession
    a = json.load(open(sys.argv[1]))
    eng = Engine.load(a["model"], n_ctx=4096)
    s = ChatSession(eng, "chatml", state_dir=a["state"], checkpoints=CheckpointStore(a["dir"], **a["knobs"]))
    out = {}
    for name, msgs in a["requests"]:
        seen = []
        with scripted(s, "Done.", record=seen):
            ev = list(s.chat(ChatRequest(tuple(Message.text(r, t) for r, t in msgs), max_tokens=20)))
        u = ev[-1].usage
        np.save(f"{a['out']}/{name}.npy", seen[0])
        out[name] = dict(source=u.cache_source, reused=u.reused_tokens, prefilled=u.prefilled_tokens,
                         prompt=u.prompt_tokens, tokens=list(eng.tokens))
    json.dump(out, open(f"{a['out']}/usage.json", "w"))
"""


@pytest.fixture(scope="module")
def smol_engine(smollm2_path):
    return Engine.load(smollm2_path, n_ctx=4096)


def new_session(engine, tmp_path, name="ck", **knobs) -> ChatSession:
    store = CheckpointStore(tmp_path / name, **{**KNOBS, **knobs})
    return ChatSession(engine, "chatml", state_dir=tmp_path / "state", checkpoints=store)


def _texts(*pairs) -> list:
    return [Message.text(r, t) for r, t in pairs]


@pytest.mark.model
def test_restart_restores_the_checkpoint_and_prefills_only_the_suffix(smollm2_path, smol_engine, tmp_path):
    smol_engine.reset()
    s = new_session(smol_engine, tmp_path, min_tokens=256, align_tokens=256, trim_tokens=32)
    first = [("system", SYSTEM), ("user", "Which tests cover module 7?")]
    answer = "tests/test_module_7.py covers it."
    with scripted(s, answer):
        _, fin = run(s, _texts(*first), tools=())
    n_prompt = fin.usage.prompt_tokens
    assert fin.usage.cache_source == "cold" and n_prompt > 2000
    (cold,) = s.checkpoints.entries()                      # the trimmed, aligned boundary
    assert cold.reason == "cold" and cold.n_tokens == (n_prompt - 32) // 256 * 256
    s.close()                                              # clean shutdown: the live state
    resume = first + [("assistant", answer), ("user", "And module 8?")]
    live_seen: list = []
    with scripted(s, "Done.", record=live_seen):           # the uninterrupted session goes on
        _, fin2 = run(s, _texts(*resume), tools=(), max_tokens=20)
    assert fin2.usage.cache_source in ("token_prefix", "text_prefix")
    shutdown = [e for e in s.checkpoints.entries() if e.reason == "shutdown"][0]
    assert shutdown.n_tokens == n_prompt + len(smol_engine.tokenizer.encode(answer))

    # a new process: nothing in memory, only the checkpoint directory
    other = [("system", SYSTEM), ("user", "Which rule mentions module 42?")]
    args = dict(model=smollm2_path, state=str(tmp_path / "state"), dir=str(tmp_path / "ck"), out=str(tmp_path),
                knobs={**KNOBS, "min_tokens": 256, "align_tokens": 256, "trim_tokens": 32},
                requests=[("other", other), ("resume", resume)])
    (tmp_path / "args.json").write_text(json.dumps(args))
    r = run_py(RESTART, tmp_path / "args.json")
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "usage.json").read_text())
    res = out["resume"]
    print(f"restart: restored {res['reused']} tokens, prefilled {res['prefilled']} "
          f"(uninterrupted session prefilled {fin2.usage.prefilled_tokens})")
    assert res["source"] == "disk" and res["reused"] == shutdown.n_tokens
    assert res["prefilled"] == fin2.usage.prefilled_tokens == res["prompt"] - shutdown.n_tokens
    assert res["tokens"] == list(smol_engine.tokens)
    assert np.array_equal(np.load(tmp_path / "resume.npy"), live_seen[0])          # bit for bit
    # another question on the same system prompt: the trimmed cold checkpoint, then the suffix,
    # gives exactly what a cold prefill of those tokens gives
    oth = out["other"]
    assert oth["source"] == "disk" and oth["reused"] == cold.n_tokens
    fresh = Engine(smol_engine.weights, n_ctx=4096)
    fresh.append(oth["tokens"][: oth["prompt"]])
    assert np.array_equal(np.load(tmp_path / "other.npy"), fresh.native_ctx.logits())


@pytest.mark.model
def test_exact_tool_replay_survives_a_restart(smol_engine, tmp_path):
    smol_engine.reset()
    s = new_session(smol_engine, tmp_path)
    sampled = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    ask = [Message.text("user", "Weather in Oslo?")]
    with scripted(s, sampled):
        ev, fin = run(s, ask)
    assert fin.reason == "tool_calls"
    call_id = calls_of(ev)[0].id
    s.close()
    (saved,) = [e for e in s.checkpoints.entries() if e.reason == "shutdown"]
    assert [r.id for r in saved.tools] == [call_id] and sampled in saved.text
    assert all(not e.tools for e in s.checkpoints.entries() if sampled not in e.text)

    # restart: a fresh engine, tool memory and store; only the directory is shared
    restarted = new_session(Engine(smol_engine.weights, n_ctx=4096), tmp_path)
    only_result = (Message("user", (ToolResultBlock(call_id, "cold"),)),)
    with pytest.raises(ChatError) as e:                    # known ID, live state gone: 409, not 400
        restarted.chat(ChatRequest(only_result))
    assert e.value.status == 409
    replay = ask + [assistant_turn(ev, respell=True), Message("user", (ToolResultBlock(call_id, "cold"),))]
    with scripted(restarted, "It is cold."):
        _, fin2 = run(restarted, replay)
    assert not [d for d in fin2.diagnostics if "canonically" in d]
    assert fin2.usage.cache_source == "disk" and fin2.usage.reused_tokens == saved.n_tokens
    assert sampled in restarted.engine.tokenizer.decode(restarted.engine.tokens)


@pytest.mark.model
def test_deepseek_thinking_tool_turn_resumes_from_disk(tiny_deepseek_dir, tmp_path):
    """DeepSeek V4 (thinking mode, DSML calls): the shutdown checkpoint holds the sampled turn and
    its tool map; a restarted session replaying it re-spelled restores and prefills the results."""
    def session():
        store = CheckpointStore(tmp_path / "ck", min_tokens=32, align_tokens=32, trim_tokens=8)
        return ChatSession(Engine.load(str(tiny_deepseek_dir), n_ctx=4096), state_dir=tmp_path, checkpoints=store)

    s = session()
    ask = [Message.text("system", "You are a weather bot. " * 20), Message.text("user", "Weather in Cairo?")]
    with scripted(s, dsml_calls("Cairo")):
        ev, fin = run(s, ask)
    assert fin.reason == "tool_calls"
    s.close()
    restarted = session()
    replay = ask + [assistant_turn(ev, respell=True), Message("user", (ToolResultBlock(calls_of(ev)[0].id, "hot"),))]
    with scripted(restarted, "Hot."):
        _, fin2 = run(restarted, replay)
    assert fin2.usage.cache_source == "disk" and not fin2.diagnostics
    assert fin2.usage.reused_tokens == fin.usage.prompt_tokens + fin.usage.completion_tokens - 1  # EOS not cached


@pytest.mark.model
def test_unrelated_request_saves_the_live_state_first(smol_engine, tmp_path):
    smol_engine.reset()
    s = new_session(smol_engine, tmp_path, trim_tokens=4096)   # no cold boundary saves here
    conv = _texts(("system", SYSTEM[:1500]), ("user", "Summarise the rules."))
    with scripted(s, "Run the matching test file."):
        run(s, conv, tools=())
    assert s.checkpoints.entries() == [] or all(e.reason != "evict" for e in s.checkpoints.entries())
    with scripted(s, "Hi."):
        run(s, _texts(("user", "Something unrelated.")), tools=())
    (evicted,) = [e for e in s.checkpoints.entries() if e.reason == "evict"]
    back = conv + _texts(("assistant", "Run the matching test file."), ("user", "Thanks."))
    with scripted(s, "You are welcome."):
        _, fin = run(s, back, tools=())
    assert fin.usage.cache_source == "disk" and fin.usage.reused_tokens == evicted.n_tokens
    assert fin.usage.prefilled_tokens == fin.usage.prompt_tokens - evicted.n_tokens


@pytest.mark.model
def test_generation_frontiers_are_saved_outside_tool_calls(smol_engine, tmp_path):
    smol_engine.reset()
    s = new_session(smol_engine, tmp_path, align_tokens=16, interval_tokens=16, cold_max_tokens=0)
    story = " ".join(f"Step {i} is done." for i in range(30))
    with scripted(s, story):
        _, fin = run(s, [Message.text("user", "Tell me the steps.")], tools=(), max_tokens=400)
    p = fin.usage.prompt_tokens
    during = [e for e in s.checkpoints.entries() if e.reason == "continued" and e.n_tokens > p]
    assert len(during) >= 5 and all(e.n_tokens % 16 == 0 for e in during)
    longest = max(during, key=lambda e: e.n_tokens)
    assert story.startswith(longest.text.split("assistant\n")[-1])
    s.checkpoints.clear()
    before = "Checking the weather in all five cities for you now, one by one. "
    with scripted(s, before + chatml_calls("Oslo", "Paris", "Rome", "Lima", "Kyiv")):
        _, fin = run(s, [Message.text("user", "Weather in five cities?")], max_tokens=400)
    assert fin.reason == "tool_calls" and fin.usage.completion_tokens > 5 * 16   # frontiers crossed
    opened_at = fin.usage.prompt_tokens + len(smol_engine.tokenizer.encode(before)) + 1
    for e in s.checkpoints.entries():
        if e.reason == "continued" and e.n_tokens > fin.usage.prompt_tokens:   # saved while sampling
            assert e.n_tokens <= opened_at and "<tool_call>" not in e.text.split("<|im_start|>assistant\n")[-1]


@pytest.mark.model
def test_session_survives_bad_checkpoints_and_a_full_disk(smol_engine, tiny_deepseek_dir, tmp_path, caplog,
                                                          monkeypatch):
    caplog.set_level(logging.WARNING, "zen5.checkpoints")
    conv = _texts(("system", SYSTEM[:2000]), ("user", "Rule 3?"))
    smol_engine.reset()
    s = new_session(smol_engine, tmp_path, trim_tokens=0, align_tokens=0)
    with scripted(s, "Run it."):
        run(s, conv, tools=())
    (whole,) = s.checkpoints.entries()
    # 1. rows flipped on disk: the restore is refused, the file removed, the request served cold
    # (whose boundary save then writes a good file under the same name)
    _damage(whole.path, "flip_kv")
    damaged = whole.path.read_bytes()
    smol_engine.reset()
    with scripted(s, "Run it."):
        _, fin = run(s, conv, tools=())
    assert fin.usage.cache_source == "cold" and any("not used" in d for d in fin.diagnostics)
    # (compare bytes, not inodes: the filesystem may hand the new file the old inode number)
    assert "checksum" in caplog.text and whole.path.read_bytes() != damaged
    # 2. another model's KV rows under a valid header for this model: the engine refuses them
    other = Engine.load(str(tiny_deepseek_dir), n_ctx=4096)
    other.append(list(range(whole.n_tokens)))
    forged = s.checkpoints.save(whole.text, list(s.engine.tokens[: whole.n_tokens]), other.native_ctx.logits(),
                                other.snapshot(), 4096, "cold")
    assert forged is not None
    forged_bytes = forged.path.read_bytes()
    smol_engine.reset()
    with scripted(s, "Run it."):
        _, fin = run(s, conv, tools=())
    assert fin.usage.cache_source == "cold" and "different model" in caplog.text
    assert forged.path.read_bytes() != forged_bytes  # replaced by this model's rows (inodes may be reused)
    # 3. a full disk: no checkpoint, a warning, the request still succeeds
    s.checkpoints.clear()
    monkeypatch.setattr(ckmod, "_write_all", _enospc)
    smol_engine.reset()
    with scripted(s, "Run it."):
        _, fin = run(s, conv, tools=())
    assert fin.reason == "stop" and "No space left" in caplog.text and s.checkpoints.entries() == []
    # 4. an unusable directory: the session works without a disk cache
    (tmp_path / "file").write_text("")
    broken = ChatSession(smol_engine, "chatml", state_dir=tmp_path / "state",
                         checkpoints=CheckpointStore(tmp_path / "file" / "ck"))
    with scripted(broken, "Run it."):
        _, fin = run(broken, conv, tools=())
    assert fin.reason == "stop"
