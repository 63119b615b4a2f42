"""Chat dialects, and which one a model speaks.

Why detection looks at the tokenizer: a model's control markers are tokens in its vocabulary,
and some checkpoints (dsml-tiny, DeepSeek V4) ship no chat template at all, so the tokenizer is
the one source every model has. A chat template, when given, must agree; an explicit override
handles unusual files. Unknown formats fail loudly instead of guessing.
"""
from __future__ import annotations

from typing import Iterable

from zen5.dialects.base import Dialect

__all__ = ["DIALECTS", "UnknownDialectError", "detect_dialect", "get_dialect"]

DIALECTS = ("deepseek_v4", "chatml")
DEEPSEEK_V4_MARKERS = ("<｜User｜>", "<｜Assistant｜>", "｜DSML｜", "<think>")
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
_MARKERS = {"deepseek_v4": DEEPSEEK_V4_MARKERS, "chatml": CHATML_MARKERS}


class UnknownDialectError(ValueError):
    """The model's chat format could not be recognised; pass an explicit dialect override."""


def _added_tokens(tokenizer) -> set[str]:
    """The added/special token strings of a zen5 Tokenizer, an HF `tokenizers.Tokenizer`, or
    a plain collection of token strings."""
    if hasattr(tokenizer, "special_tokens"):
        return set(tokenizer.special_tokens)
    if hasattr(tokenizer, "get_added_tokens_decoder"):
        return {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    if isinstance(tokenizer, Iterable) and not isinstance(tokenizer, str):
        return set(tokenizer)
    raise TypeError(f"cannot read the added tokens of {type(tokenizer).__name__}")


def detect_dialect(tokenizer, chat_template: str | None = None,
                   override: str | None = None) -> str:
    """"deepseek_v4" when the tokenizer has DeepSeek V4's markers as added tokens, "chatml"
    when it has <|im_start|>/<|im_end|>; `override` ("deepseek_v4" | "chatml") wins. When a
    chat template is given it must use the detected dialect's first marker."""
    if override is not None:
        if override not in DIALECTS:
            raise ValueError(f"unknown dialect override {override!r}; expected one of {DIALECTS}")
        return override
    added = _added_tokens(tokenizer)
    found = {name: [m for m in markers if m in added] for name, markers in _MARKERS.items()}
    for name in DIALECTS:
        if len(found[name]) == len(_MARKERS[name]):
            marker = _MARKERS[name][0]
            if chat_template and marker not in chat_template:
                raise UnknownDialectError(
                    f"the tokenizer has the {name} markers but the chat template does not use "
                    f"{marker}; pass a dialect override ({' | '.join(DIALECTS)})")
            return name
    seen = [m for ms in found.values() for m in ms]
    raise UnknownDialectError(
        "unrecognised chat format: the tokenizer has "
        + (f"only {seen} of the known markers" if seen else "none of the known markers")
        + f" (deepseek_v4 needs {list(DEEPSEEK_V4_MARKERS)}, chatml needs "
        + f"{list(CHATML_MARKERS)}); pass a dialect override ({' | '.join(DIALECTS)})")


def get_dialect(name: str) -> Dialect:
    """The dialect object for a name returned by `detect_dialect`."""
    if name == "chatml":
        from zen5.dialects.chatml import ChatMLDialect
        return ChatMLDialect()
    if name == "deepseek_v4":
        from zen5.dialects.deepseek_v4 import DeepSeekV4Dialect
        return DeepSeekV4Dialect()
    raise ValueError(f"unknown dialect {name!r}; expected one of {DIALECTS}")
