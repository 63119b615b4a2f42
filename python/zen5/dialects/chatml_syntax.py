"""ChatML's markers: the turn delimiters and the Hermes/Qwen tool-call tags.

Why a module of its own: the renderer, parsers and tracker (`chatml.py`) and the
constrained-decoding grammar (`chatml_grammar.py`) must agree on these strings byte for byte, and
the dialect class imports the grammar module, so the grammar cannot import `chatml.py` for them.
"""
from __future__ import annotations

__all__ = ["CALL_CLOSE", "CALL_OPEN", "IM_END", "IM_START"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
