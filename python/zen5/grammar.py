"""Writing llguidance grammars: what a grammar must enforce (`Demand`) and the Lark building
blocks every dialect's constrained-decoding grammar is written with.

Why this module exists: each dialect writes the grammar of its own output syntax
(`Dialect.grammar`: dialects/chatml_grammar.py, dialects/deepseek_v4_grammar.py), and they share
everything that is not syntax: the rule builder, literals and regex terminals, and the JSON
Schema sub-grammars of tool arguments and answers. Keeping those here means a new dialect writes
only its framing, and the session never sees a grammar's insides.

Choices, each a subset of what the client's schema allows (the output still validates):
objects that declare properties and say nothing of others get `additionalProperties: false`,
unbounded numbers get bounds and at most 9 decimals (`narrowed`: a small model otherwise
invents keys, or digits, until max_tokens); properties come in schema order; JSON is compact,
in the separators the dialects re-serialize with (", " and ": "). Text that may not appear is
excluded by regex negation (`no_substrings`), so neither a special token nor its spelling in
ordinary tokens can produce it. Lexemes are matched greedily without backtracking, so a grammar
must never offer two literals where one is a prefix of the other and the longer may go on past
the shorter's end.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from zen5.chat_types import ToolSpec

__all__ = ["ConstraintError", "Demand", "JSON_FORMAT", "Lark", "answer", "json_rule", "lit",
           "narrowed", "no_substrings", "required_names", "rx_escape", "slash"]

# Separators as Python's json.dumps writes them: what the dialects re-serialize and render.
JSON_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class ConstraintError(ValueError):
    """A request whose constraint cannot be built (unknown tool, bad schema or grammar): the
    session answers 400."""


@dataclass(frozen=True)
class Demand:
    """What a request's grammar must enforce (built by constraints.demand_of)."""
    calls: str                          # "none" | "auto" | "forced"
    tools: tuple[ToolSpec, ...]         # the tools a call may name
    parallel: bool                      # False: at most one call
    answer: dict | None                 # JSON schema of a text answer; None: free text
    answer_strict: bool = True
    thinking_budget: int | None = None


# ---- JSON Schema helpers ---------------------------------------------------------------------
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "contains")
_SAFE_INT = 2**53 - 1          # JSON numbers beyond this are not exact in most parsers
_NUMBER_LIMIT, _NUMBER_STEP = 10**15, 1e-9


def narrowed(schema):
    """`schema` narrowed for generation; every output still validates against the original.

    Objects that declare their properties and say nothing of others get additionalProperties
    false; numbers without bounds or a multipleOf get |x| < 1e15 in steps of 1e-9 (no exponent),
    integers |x| <= 2**53-1. A small model at temperature 1 otherwise invents keys, or digits,
    until max_tokens. allOf branches are left alone: narrowing them one by one could make their
    intersection empty."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: narrowed(s) for name, s in out[k].items()}
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [narrowed(s) for s in out[k]]
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = narrowed(out[k])
    props = out.get("properties")
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
                 "anyOf", "oneOf", "$ref")
    if isinstance(props, dict) and not any(k in out for k in open_keys) \
            and required_names(out) <= set(props):
        out["additionalProperties"] = False
    _bound_numbers(out)
    return out


def required_names(schema: dict) -> set[str]:
    names = schema.get("required")
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _bound_numbers(out: dict) -> None:
    kinds = out.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if "number" in kinds:
        limit = _NUMBER_LIMIT
        if "multipleOf" not in out:
            out["multipleOf"] = _NUMBER_STEP
    elif "integer" in kinds:
        limit = _SAFE_INT
    else:
        return
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -limit
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = limit


def json_rule(schema: dict, strict: bool) -> str:
    """A `%json {...}` element: the schema narrowed, compact, lenient about unknown keywords unless
    strict (a strict schema llguidance cannot enforce is an error, not a silent approximation)."""
    options = dict(JSON_FORMAT, lenient=not strict)
    body = {**narrowed(schema), "x-guidance": options}
    return "%json " + json.dumps(body, ensure_ascii=False)


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def no_substrings(*texts: str) -> str:
    """A Lark terminal body: any UTF-8 text containing none of `texts`."""
    alts = "|".join(rx_escape(t) for t in texts)
    return f"/(?s:.*)/ & ~/(?s:.*({alts}).*)/"


def rx_escape(text: str) -> str:
    """`text` as a regex (inside /.../) matching itself."""
    out = []
    for c in text:
        if c.isascii() and not c.isalnum() and c not in " _":
            out.append(f"\\x{{{ord(c):x}}}")
        else:
            out.append(c)
    return "".join(out)


# ---- the grammar under construction ----------------------------------------------------------
class Lark:
    """Rules of one request's grammar, plus named side grammars (`@name`) for custom tools."""

    def __init__(self):
        self.rules: list[str] = []
        self.side: list[dict] = []
        self._n = 0

    def rule(self, body: str, prefix: str = "r", attrs: str = "") -> str:
        self._n += 1
        name = f"{prefix}_{self._n}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def terminal(self, body: str, prefix: str = "T") -> str:
        self._n += 1
        name = f"{prefix}_{self._n}"
        self.rules.append(f"{name}: {body}")
        return name

    def side_grammar(self, lark: str) -> str:
        name = f"g_{len(self.side)}"
        self.side.append({"name": name, "lark_grammar": lark})
        return "@" + name

    def text(self, start: str) -> str:
        """The llguidance grammar: JSON with the top-level Lark grammar first."""
        top = "\n".join(["%llguidance {}", f"start: {start}", *self.rules])
        return json.dumps({"grammars": [{"lark_grammar": top}, *self.side]}, ensure_ascii=False)


def slash(rx: str) -> str:
    """A regex made safe for Lark's /.../ syntax."""
    import llguidance
    return llguidance.regex_to_lark(rx, "")


def answer(g: Lark, demand: Demand, free_text: str) -> str:
    """The text answer: JSON per the response format, else free text (a terminal body)."""
    if demand.answer is not None:
        return g.rule(json_rule(demand.answer, demand.answer_strict), "answer")
    return g.rule(g.terminal(free_text), "answer")
