"""Tool memory (IDs, exact blocks, LRU bounds) and thinking signatures/encryption."""
import os
import re
import stat

import pytest

from zen5.signatures import ThinkingSigner, load_or_create_secret
from zen5.tool_memory import ToolMemory, ToolRecord, new_tool_id


def block(mem, n, tag="b"):
    ids = [new_tool_id("toolu_") for _ in range(n)]
    raw = f"<block {tag}>"
    for i, tid in enumerate(ids):
        mem.remember(ToolRecord(tid, "f", "{}", f"<call {i}>", raw, tag, i, n))
    return ids, raw


def test_ids_are_unguessable_and_prefixed():
    ids = {new_tool_id("call_") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"call_[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(r"toolu_[0-9a-f]{32}", new_tool_id("toolu_"))
    with pytest.raises(ValueError):
        new_tool_id("x_")


def test_exact_block_only_for_the_complete_ordered_call_set():
    mem = ToolMemory()
    ids, raw = block(mem, 3)
    assert mem.exact_block(ids) == raw
    assert mem.exact_block(ids[:2]) is None            # partial set
    assert mem.exact_block(ids[::-1]) is None          # re-ordered
    assert mem.exact_block(ids + ids[:1]) is None      # repeated
    other, _ = block(mem, 1, tag="c")
    assert mem.exact_block(ids[:2] + other) is None    # mixed blocks
    assert mem.exact_block(["toolu_" + "0" * 32]) is None


def test_lru_bounds_by_count_and_bytes():
    mem = ToolMemory(max_entries=4)
    first, _ = block(mem, 2, "a")
    block(mem, 2, "b")
    mem.get(first[0])  # touch: now most recent
    block(mem, 1, "c")
    assert first[0] in mem and first[1] not in mem and len(mem) == 4
    small = ToolMemory(max_bytes=300)
    for k in range(10):
        block(small, 1, str(k))
    assert small.nbytes <= 300 and len(small) >= 1


def test_signatures(tmp_path):
    secret = load_or_create_secret(tmp_path)
    assert load_or_create_secret(tmp_path) == secret  # stable across restarts
    assert stat.S_IMODE(os.stat(tmp_path / "thinking.key").st_mode) == 0o600
    s = ThinkingSigner(secret, "model-a")
    sig = s.sign("I think therefore I am.")
    assert s.verify("I think therefore I am.", sig)
    assert not s.verify("I think therefore I am!", sig)          # altered text
    forged = sig[:-2] + ("AA" if sig[-2:] != "AA" else "BA")  # 1 random key in 1,024 signs to "...AA"
    assert forged != sig and not s.verify("I think therefore I am.", forged)
    assert not s.verify("I think therefore I am.", None)
    assert not ThinkingSigner(secret, "model-b").verify("I think therefore I am.", sig)   # foreign model
    assert not ThinkingSigner(os.urandom(32), "model-a").verify("I think therefore I am.", sig)  # other install


def test_key_directory_is_private(tmp_path):
    """Issue 19 (security): the key's directory, when created here, is 0700 (it was 0755), and so
    are the missing parents created with it."""
    old = os.umask(0o022)
    try:
        load_or_create_secret(tmp_path / "home" / "state")
    finally:
        os.umask(old)
    assert [stat.S_IMODE(os.stat(tmp_path / d).st_mode) for d in ("home", "home/state")] == [0o700, 0o700]
    assert stat.S_IMODE(os.stat(tmp_path / "home" / "state" / "thinking.key").st_mode) == 0o600


def test_encryption_round_trip_and_tamper(tmp_path):
    s = ThinkingSigner(load_or_create_secret(tmp_path), "m")
    blob = s.encrypt("secret reasoning ✓")
    assert "secret" not in blob
    assert s.decrypt(blob) == "secret reasoning ✓"
    assert s.encrypt("x") != s.encrypt("x")  # random nonce
    tampered = blob[:-4] + ("AAAA" if blob[-4:] != "AAAA" else "BBBB")
    assert s.decrypt(tampered) is None
    assert ThinkingSigner(load_or_create_secret(tmp_path), "other").decrypt(blob) is None
    assert s.decrypt("garbage") is None and s.decrypt("z5e1.!!!") is None
