"""The constrained-decoding grammar of a DeepSeek V4 assistant message
(`DeepSeekV4Dialect.grammar`).

The grammar writes, byte for byte, what the official parser reads (deepseek_v4_syntax.py): in
thinking mode the reasoning first, free text up to `</think>`, capped by `thinking_budget` tokens
when given (a model that never closes its reasoning would otherwise never reach a forced call);
then the answer or a DSML block after its blank line. String parameters are raw text
(string="true"), the rest JSON (string="false", `%json` sub-grammars of the schema, grammar.py).
The control strings the official parser refuses in reasoning and content cannot be sampled
there, in any spelling.

Special tokens are referenced by id (`<[id]>`): `</think>` and `｜DSML｜` must be the single tokens
the model was trained on. Generation ends on `<｜end▁of▁sentence｜>`, which llguidance allows
exactly when the grammar accepts. A custom tool's input is a raw string parameter, so its Lark
grammar is used as is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from zen5.chat_types import CUSTOM_INPUT, ToolSpec
from zen5.grammar import (
    ConstraintError,
    Demand,
    Lark,
    answer,
    json_rule,
    lit,
    no_substrings,
    required_names,
    rx_escape,
    slash,
)

from .deepseek_v4_syntax import DSML, FORBIDDEN_IN_TEXT, THINK_CLOSE

__all__ = ["grammar"]


def grammar(demand: Demand, thinking_mode: str, token_id) -> str:
    """The llguidance grammar (JSON text) for a demand; `token_id(text)` maps the dialect's
    special tokens to ids."""
    g = Lark()
    ids = _Ids(_required_id(token_id, DSML), _required_id(token_id, THINK_CLOSE))
    return g.text(_start(g, demand, thinking_mode == "thinking", ids))


@dataclass(frozen=True)
class _Ids:
    dsml: int
    think_close: int


def _start(g: Lark, demand: Demand, thinking: bool, ids: _Ids) -> str:
    """The start expression for a DeepSeek V4 assistant message (after the prompt's <think> or
    </think>)."""
    prefix = ""
    if thinking:
        cap = "" if demand.thinking_budget is None else f"[max_tokens={demand.thinking_budget}]"
        reasoning = g.rule(g.terminal(no_substrings(*FORBIDDEN_IN_TEXT)), "reasoning", cap)
        prefix = f"{reasoning} <[{ids.think_close}]> "
    text_answer = answer(g, demand, no_substrings(*FORBIDDEN_IN_TEXT))
    if demand.calls == "none":
        return f"{prefix}{text_answer}"
    d = f"<[{ids.dsml}]>"
    invoke = g.rule(" | ".join(_invoke(g, t, d) for t in demand.tools), "invoke")
    more = f' ("\\n" {invoke})*' if demand.parallel else ""
    # "\n" and "</" apart: a lexer that took "\n</" as one literal could not back out of "\n<"
    # when the next invoke starts instead (lexemes are matched greedily, without backtracking)
    rest = g.rule(f'{invoke}{more} "\\n" "</" {d} "tool_calls>"', "block_rest")
    block = f'"\\n\\n<" {d} "tool_calls>\\n" {rest}'
    if demand.calls == "forced":
        return f"{prefix}{block}"
    if demand.answer is not None:
        return f"{prefix}({text_answer} | {block})"
    # content, then maybe a block: the lazy head ends at the block's opening tag
    plain = g.terminal(no_substrings(*FORBIDDEN_IN_TEXT))
    head = g.rule(f'{plain} "\\n\\n<{DSML}tool_calls>\\n"', "head", "[lazy]")
    return f"{prefix}({text_answer} | {head} {rest})"


def _invoke(g: Lark, tool: ToolSpec, d: str) -> str:
    """One invoke: header, one line per parameter (each followed by "\\n"), closing tag."""
    header = f'"<" {d} {lit(f"invoke name={json.dumps(tool.name, ensure_ascii=False)}>" + chr(10))}'
    if tool.kind == "custom":
        params = [(_string_param(g, CUSTOM_INPUT, _custom_input(g, tool, d), d), True)]
    else:
        params = _params(g, tool, d)
    body = " ".join(f'({p} "\\n")' + ("" if required else "?") for p, required in params)
    if not params:
        body = '"\\n"'  # the canonical empty invoke has a blank line
    return g.rule(f'{header} {body} "</" {d} "invoke>"', "invoke")


def _params(g: Lark, tool: ToolSpec, d: str) -> list[tuple[str, bool]]:
    """(parameter rule, required) in schema order. string="true" for string values (raw text),
    string="false" with JSON for the rest; a property that may be either offers both."""
    schema = _resolve_top(tool.parameters)
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = required_names(schema)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = []
    for key, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        alts = []
        if _may_be_string(sub):
            alts.append(_string_param(g, key, _raw_string(g, sub, d), d))
        if _may_be_other(sub):
            value = g.rule(json_rule({**sub, **defs}, tool.strict), "value")
            alts.append(g.rule(f'"<" {d} {lit(_param_head(key, False))} {value} "</" {d} "parameter>"',
                               "param"))
        out.append((g.rule(" | ".join(alts), "param"), key in required))
    return out


def _param_head(key: str, is_string: bool) -> str:
    return f'parameter name="{key}" string="{"true" if is_string else "false"}">'


def _string_param(g: Lark, key: str, value_and_close: str, d: str) -> str:
    return g.rule(f'"<" {d} {lit(_param_head(key, True))} {value_and_close}', "param")


def _free_value(g: Lark, body: str) -> str:
    """Raw text matching `body` (a terminal body) and then the parameter's closing tag, as one
    terminal: text may contain "</", so a lexer reading value and tag separately would take the
    tag's "</" into the value; text without the DSML marker can only end at the tag."""
    value = g.terminal(f"{body} & ~/(?s:.*{rx_escape(DSML)}.*)/")
    return g.terminal(f'{value} "</{DSML}parameter>"')


def _resolve_top(schema: dict) -> dict:
    """A tool schema whose top level is a local $ref, resolved one level."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith("#/"):
        node = schema
        for part in ref[2:].split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        merged = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
        return merged if isinstance(node, dict) else schema
    return schema if isinstance(schema, dict) else {}


def _types(sub: dict) -> set[str] | None:
    """The JSON types a property schema allows, when it says so plainly; None when unknown."""
    if "const" in sub:
        return {"string" if isinstance(sub["const"], str) else "other"}
    if isinstance(sub.get("enum"), list):
        return {"string" if isinstance(v, str) else "other" for v in sub["enum"]}
    kind = sub.get("type")
    if isinstance(kind, str):
        kind = [kind]
    if isinstance(kind, list):
        return {"string" if k == "string" else "other" for k in kind}
    return None


def _may_be_string(sub: dict) -> bool:
    kinds = _types(sub)
    return kinds is not None and "string" in kinds


def _may_be_other(sub: dict) -> bool:
    kinds = _types(sub)
    return kinds is None or "other" in kinds


def _raw_string(g: Lark, sub: dict, d: str) -> str:
    """A string="true" value and its closing tag: the raw string (no quotes, no escapes) within
    the schema's enum, const, pattern (anchored ones) and length bounds."""
    values = [sub["const"]] if "const" in sub else sub.get("enum")
    if isinstance(values, list):
        strings = [v for v in values if isinstance(v, str) and DSML not in v]
        if strings:
            return f'({" | ".join(lit(v) for v in strings)}) "</" {d} "parameter>"'
    lo, hi = sub.get("minLength", 0), sub.get("maxLength")
    body = f"/(?s:.{{{int(lo)},{'' if hi is None else int(hi)}}})/"
    pattern = sub.get("pattern")
    if isinstance(pattern, str):
        inner = pattern[1 if pattern.startswith("^") else 0:]
        inner = inner[:-1] if inner.endswith("$") and not inner.endswith("\\$") else inner
        if pattern.startswith("^") and pattern.endswith("$"):
            body += f" & /{slash(inner)}/"
        else:
            body += f" & /(?s:.*)({slash(inner)})(?s:.*)/"
    return _free_value(g, body)


def _custom_input(g: Lark, tool: ToolSpec, d: str) -> str:
    """A custom tool's input as a raw string parameter, followed by its closing tag; constrained
    to the tool's grammar when it has one."""
    if tool.grammar is None or tool.grammar_syntax == "regex":
        rx = "(?s:.*)" if tool.grammar is None else tool.grammar
        return _free_value(g, f"/{slash(rx)}/")
    # a grammar that ends in open text (e.g. /.*/) would swallow the closing tag's "</";
    # grammars such as apply_patch end in fixed text
    return g.side_grammar(tool.grammar) + f' "</" {d} "parameter>"'


def _required_id(token_id, text: str) -> int:
    tid = token_id(text) if token_id is not None else None
    if tid is None:
        raise ConstraintError(f"the tokenizer has no {text!r} token")
    return tid
