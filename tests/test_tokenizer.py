"""Tokenizer tests: the real SmolLM2 vocabulary rebuilt from GGUF, tiny synthetic ones for each
pre-tokenizer branch, the HF tokenizer.json route, and StreamDecoder's exactness.
"""
import os
import sys
import warnings

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import tiny_gguf  # noqa: E402
from zen5.config import UnsupportedModelError  # noqa: E402
from zen5.loader.gguf import read_tokenizer  # noqa: E402
from zen5.registry import ModelNotFound, resolve_model  # noqa: E402
from zen5.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

SAMPLES = [
    "Hello, world!", "héllo wörld — naïve café", "日本語のテキストと中文", "emoji 🎉🎉 👩‍👩‍👧 ok",
    "tabs\tand\nnewlines\r\n  spaces   ", "12345 67.89 1e10", "<|im_start|>user\nhi<|im_end|>\n",
    "Ωμέγα ∑ ∫ ≤ ≥ ∞", "", " leading and trailing ", "😀" * 5 + "a",
]


@pytest.fixture(scope="module")
def smol():
    return read_tokenizer(resolve_model("smollm2"))


def tiny(tmp_path, **kw) -> Tokenizer:
    w = gguf.GGUFWriter(os.fspath(tmp_path / "tok.gguf"), "llama")
    tiny_gguf.add_tokenizer(w, **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_tokenizer(tmp_path / "tok.gguf")


def test_smollm2_specials_are_single_tokens_and_digits_split(smol):
    ids = smol.encode("<|im_start|>user\nHello 123<|im_end|>")
    assert ids[0] == smol.token_to_id("<|im_start|>") == 1
    assert ids[-1] == smol.token_to_id("<|im_end|>") == 2
    pieces = [smol.id_to_token(i) for i in ids]
    assert pieces[-4:-1] == ["1", "2", "3"]
    assert "<|im_start|>" in smol.special_tokens


def test_smollm2_ids_and_eos(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1
    assert smol.eos_ids == frozenset({0, 2})  # <|endoftext|> (EOS) and <|im_end|>
    assert smol.encode("Hello")[0] != smol.bos_id  # no automatic BOS


@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


# SmolLM2's vocabulary has no token for bytes 0x04 0x06 0x13 0x14 0x16 0x1d 0xf1 0xf2 (nor the
# never-valid 0xc0 0xc1 0xf5-0xff): text needing them cannot be represented (HF drops it too).
SMOL_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),
                                  exclude_characters="\x04\x06\x13\x14\x16\x1d"), max_size=60)


@settings(max_examples=150, deadline=None)
@given(SMOL_TEXT)
def test_smollm2_round_trip_any_text(smol, text):
    assert smol.decode(smol.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(SMOL_TEXT)
def test_token_bytes_spell_the_text(smol, text):
    """Each token's own bytes (a piece of a UTF-8 character included) concatenate to the text;
    special tokens give their text."""
    ids = smol.encode(text + "<|im_end|>")
    assert b"".join(smol.token_bytes(i) for i in ids) == (text + "<|im_end|>").encode()


def test_skip_special(smol):
    ids = smol.encode("<|im_start|>hi<|im_end|>")
    assert smol.decode(ids, skip_special=True) == "hi"


def stream(tok, ids) -> str:
    s = StreamDecoder(tok)
    return "".join(s.push(i) for i in ids) + s.flush()


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_decoder_matches_decode(smol, text):
    assert stream(smol, smol.encode(text)) == text


def test_stream_decoder_holds_back_partial_utf8(smol):
    ids = smol.encode("🎉")
    assert len(ids) > 1  # a 4-byte emoji is split over byte tokens in this vocabulary
    s = StreamDecoder(smol)
    outs = [s.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🎉"
    assert s.flush() == ""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 49151), max_size=30))
def test_stream_decoder_any_ids(smol, ids):
    assert stream(smol, ids) == smol.decode(ids)


def test_stream_decoder_flush_emits_dangling_bytes(smol):
    first = smol.encode("🎉")[0]
    s = StreamDecoder(smol)
    assert s.push(first) == ""
    assert s.flush() == smol.decode([first])


def test_tiny_vocab_specials_and_user_defined(tmp_path):
    tok = tiny(tmp_path)
    ids = tok.encode("<|im_start|>hello<tool> world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.token_to_id("<tool>") in ids and tok.token_to_id("hell") in ids
    assert tok.decode(ids) == "<|im_start|>hello<tool> world<|im_end|>"
    assert tok.eos_ids == frozenset({0, 2}) and tok.bos_id == 1


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2", "default", None])
def test_tiny_vocab_each_pre_tokenizer(tmp_path, pre):
    tok = tiny(tmp_path, pre=pre)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("pre,pieces", [("smollm", ["1", "2", "3", "4", "5"]),
                                         ("qwen2", ["1", "2", "3", "4", "5"]),
                                         ("llama-bpe", ["123", "45"]), ("gpt2", ["12345"])])
def test_digit_splitting_by_pre_tokenizer(tmp_path, pre, pieces):
    tok = tiny(tmp_path, pre=pre)
    assert [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str("12345")] == pieces


def test_unknown_pre_tokenizer_warns(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="zen5.tokenizer"):
        tok = tiny(tmp_path, pre="mystery-pre")
    assert "mystery-pre" in caplog.text
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_sentencepiece_gguf_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        tiny(tmp_path, model="llama")


def test_from_files_hf_dir(tmp_path):
    folder = tiny_gguf.write_hf_dir(tmp_path / "hf")
    tok = Tokenizer.from_files(os.path.join(folder, "tokenizer.json"))
    assert tok.bos_id == 1                      # config.json bos_token_id
    assert tok.eos_ids == frozenset({0, 2})     # config.json eos_token_id 2 + <|endoftext|>
    assert tok.encode("<|im_end|>") == [2]


def dsml_tiny():
    try:
        return resolve_model("dsml-tiny")
    except ModelNotFound as e:
        pytest.skip(str(e))


def test_dsml_tiny_tokenizer():
    folder = dsml_tiny()
    tok = Tokenizer.from_files(os.path.join(folder, "tokenizer.json"))
    assert tok.bos_id == tok.token_to_id("<｜begin▁of▁sentence｜>") == 0
    assert tok.eos_ids == frozenset({1})
    for special in ("<｜User｜>", "<｜Assistant｜>", "<think>"):
        assert tok.encode(special) == [tok.token_to_id(special)]
    text = "<｜User｜>What's 2+2? 日本<｜Assistant｜><think>ok</think>4"
    assert tok.decode(tok.encode(text)) == text
    assert stream(tok, tok.encode(text)) == text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tok.encode("a")[0] != tok.bos_id
