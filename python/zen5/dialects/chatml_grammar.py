"""The constrained-decoding grammar of a ChatML assistant message (`ChatMLDialect.grammar`).

The grammar writes, byte for byte, what `chatml.py`'s parser reads: `<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>` blocks joined by "\\n". Arguments are `%json` sub-grammars of
each tool's schema (grammar.py). A forced call starts at once (no text before it). Under "none"
and in free text the call opener cannot be sampled, in any spelling. Generation ends on the
tokenizer's EOS (`<|im_end|>`), which llguidance allows exactly when the grammar accepts.

A custom tool (Codex's apply_patch) puts its input inside a JSON string, so its Lark grammar is
first rewritten to the JSON-escaped form of its language (lark_json_string.py).
"""
from __future__ import annotations

import json

from zen5 import lark_json_string as ljs
from zen5.chat_types import CUSTOM_INPUT, ToolSpec
from zen5.grammar import ConstraintError, Demand, Lark, answer, json_rule, lit, no_substrings, slash

from .chatml_syntax import CALL_CLOSE, CALL_OPEN, IM_END

__all__ = ["grammar"]


def grammar(demand: Demand) -> str:
    """The llguidance grammar (JSON text) for a demand."""
    g = Lark()
    return g.text(_start(g, demand))


def _start(g: Lark, demand: Demand) -> str:
    """The start expression for a ChatML assistant message."""
    if demand.calls == "none":
        return answer(g, demand, no_substrings(CALL_OPEN, IM_END))
    body = g.rule(" | ".join(_call_body(g, t) for t in demand.tools), "call_body")
    call = g.rule(f"{lit(CALL_OPEN)} {body}", "call")
    # blocks are joined by "\n"; with parallel calls a blank tail (dropped by the parser) lets a
    # model that writes "\n" after each block still stop; a single call ends at EOS
    tail = f' ("\\n" {call})* "\\n"?' if demand.parallel else ""
    if demand.calls == "forced":
        return f"{call}{tail}"
    text_answer = answer(g, demand, no_substrings(CALL_OPEN, IM_END))
    if demand.answer is not None:  # a JSON answer or calls: they differ in the first byte
        return f"{text_answer} | {call}{tail}"
    # free text, then maybe calls: the lazy head ends at the first "<tool_call>"
    plain = g.terminal(no_substrings(IM_END))
    head = g.rule(f"{plain} {lit(CALL_OPEN)}", "head", "[lazy]")
    return f"{text_answer} | {head} {body}{tail}"


def _call_body(g: Lark, tool: ToolSpec) -> str:
    """Everything of one call after `<tool_call>`: the JSON line and the closing tag."""
    head = '\n{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
    close = lit("}\n" + CALL_CLOSE)
    if tool.kind == "custom":  # {"input": "<the input, JSON-escaped>"}
        opening, closing = lit(head + "{" + json.dumps(CUSTOM_INPUT) + ': "'), lit('"}')
        return g.rule(f"{opening} {_custom_input(g, tool)} {closing} {close}", "body")
    args = g.rule(json_rule(tool.parameters, tool.strict), "args")
    return g.rule(f"{lit(head)} {args} {close}", "body")


def _custom_input(g: Lark, tool: ToolSpec) -> str:
    """A custom tool's input inside a JSON string (escaped, without its quotes), constrained to
    the tool's grammar when it has one."""
    if tool.grammar is None:
        return g.terminal(ljs.JSON_STRING_BODY)
    if tool.grammar_syntax == "regex":
        return g.terminal(f"/{slash(ljs.escape_regex(tool.grammar))}/")
    try:
        lark = ljs.json_string_grammar(tool.grammar)
    except ljs.GrammarError as e:
        raise ConstraintError(f"custom tool {tool.name!r}: {e}") from None
    return g.side_grammar(lark)
