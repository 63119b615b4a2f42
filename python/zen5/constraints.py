"""Constrained decoding: forced tool calls, forbidden calls, JSON outputs, custom-tool grammars.

Why this module exists: a client that sets `tool_choice: "required"` or a `json_schema` response
format must get output that parses and validates, from any model at any temperature. Asking
nicely in the prompt is not enough for a 135M model at temperature 1, so each request that
demands structure gets a grammar, and every sampling step masks the logits to the tokens the
grammar allows (llguidance: a Rust Earley parser with a token-trie lexer; JSON Schema and Lark).

How a request becomes a grammar:

* `demand_of(request)` reads the neutral fields (tool_choice, parallel_tool_calls,
  response_format, tools' kind/strict/grammar, thinking_budget) into a `Demand`, or None when the
  request is unconstrained (the common case: no cost at all).
* A dialect builder writes one Lark grammar in that dialect's own output syntax, byte for byte
  what its parser reads (chatml.py / deepseek_v4.py): ChatML `<tool_call>\\n{"name": ...,
  "arguments": ...}\\n</tool_call>` blocks joined by "\\n"; DSML blocks after the reasoning.
  Arguments are `%json` sub-grammars of each tool's schema, in the compact separators the
  dialects re-serialize with (", " and ": "). The text that may not appear (the call opener
  under "none", control strings in reasoning) is excluded by regex negation, so neither a
  special token nor its spelling in ordinary tokens can produce it.
* Special tokens are referenced by id (`<[id]>`): DeepSeek's `</think>` and `｜DSML｜` must be
  the single tokens the model was trained on. Generation ends on the tokenizer's EOS, which
  llguidance allows exactly when the grammar accepts (`<|im_end|>` / `<｜end▁of▁sentence｜>`).
* Custom tools (Codex's apply_patch) carry a Lark grammar for their input. DSML passes string
  parameters raw, so the grammar is used as is; ChatML puts the input inside a JSON string, so
  the grammar is first rewritten to the JSON-escaped form of its language (lark_json_string.py).

Choices, each a subset of what the client's schema allows (the output still validates):
objects that declare properties and say nothing of others get `additionalProperties: false`,
unbounded numbers get bounds and at most 9 decimals (`narrowed`: a small model otherwise
invents keys, or digits, until max_tokens); properties come in schema order; JSON is compact.
A forced call starts at once (no text before it); in DeepSeek thinking mode the reasoning comes
first, free text up to `</think>`, capped by `thinking_budget` tokens when given (a model that
never closes its reasoning would otherwise never reach the forced call). Lexemes are matched
greedily without backtracking, so the grammar never offers two literals where one is a prefix
of the other and the longer may go on past the shorter's end (see `_dsml`, `_dsml_free_value`).

`TokenConstraint` is the per-request runtime: the mask for the next token, advanced by each
sampled token. The mask for step n+1 is computed right after token n is sampled, while the
engine evaluates token n (llguidance releases the GIL), so decode does not wait for it.
"""
from __future__ import annotations

import json
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from zen5.chat_types import CUSTOM_INPUT, ChatRequest, ToolSpec

__all__ = ["ConstraintError", "Demand", "TokenConstraint", "build_grammar", "demand_of",
           "llg_tokenizer", "narrowed", "JSON_FORMAT"]

# Separators as Python's json.dumps writes them: what the dialects re-serialize and render.
JSON_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class ConstraintError(ValueError):
    """A request whose constraint cannot be built (unknown tool, bad schema or grammar): the
    session answers 400."""


# ---- what a request demands ------------------------------------------------------------------
@dataclass(frozen=True)
class Demand:
    calls: str                          # "none" | "auto" | "forced"
    tools: tuple[ToolSpec, ...]         # the tools a call may name
    parallel: bool                      # False: at most one call
    answer: dict | None                 # JSON schema of a text answer; None: free text
    answer_strict: bool = True
    thinking_budget: int | None = None


def demand_of(request: ChatRequest) -> Demand | None:
    """The request's structural demands, or None when it needs no constraint (tool_choice auto
    with parallel calls allowed and no custom or strict tools, no response_format, no thinking
    budget)."""
    calls, tools = _calls_of(request.tool_choice, tuple(request.tools))
    answer, strict = _answer_schema(request.response_format)
    budget = request.thinking_budget
    single = bool(tools) and not request.parallel_tool_calls   # "at most one call" under auto too
    if calls == "auto" and not any(t.kind == "custom" or t.strict for t in tools) \
            and not single and answer is None and budget is None:
        return None
    if calls == "auto" and not tools:
        calls = "none"
    return Demand(calls, tools, request.parallel_tool_calls, answer, strict, budget)


def _calls_of(choice, tools: tuple[ToolSpec, ...]) -> tuple[str, tuple[ToolSpec, ...]]:
    """("none" | "auto" | "forced", the tools a call may name) for a neutral tool_choice."""
    if isinstance(choice, dict):
        picked = tuple(t for t in tools if t.name == choice.get("name"))
        if not picked:
            raise ConstraintError(f"tool_choice names {choice.get('name')!r}, which is not among "
                                  "the tools")
        return "forced", picked
    if choice == "required":
        if not tools:
            raise ConstraintError('tool_choice "required" needs at least one tool')
        return "forced", tools
    if choice in ("auto", "none"):
        return choice, tools
    raise ConstraintError(f'tool_choice must be "auto", "none", "required" or {{"name": ...}}, '
                          f"got {choice!r}")


def _answer_schema(fmt: dict | None) -> tuple[dict | None, bool]:
    """(JSON schema the answer must follow, strict) for a response_format."""
    if fmt is None or fmt.get("type") == "text":
        return None, True
    if fmt.get("type") == "json_object":
        return {"type": "object"}, True
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError("response_format json_schema needs a schema object")
        if fmt.get("strict"):
            return schema, True
        # not strict: the schema is guidance for the model; the output is still valid JSON
        kind = schema.get("type")
        return ({"type": kind} if isinstance(kind, str) else {}), False
    raise ConstraintError(f"response_format type must be text, json_object or json_schema, "
                          f"got {fmt.get('type')!r}")


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
            and _required(out) <= set(props):
        out["additionalProperties"] = False
    _bound_numbers(out)
    return out


def _required(schema: dict) -> set[str]:
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


def _json_rule_body(schema: dict, strict: bool) -> str:
    """A `%json {...}` element: the schema narrowed, compact, lenient about unknown keywords unless
    strict (a strict schema llguidance cannot enforce is an error, not a silent approximation)."""
    options = dict(JSON_FORMAT, lenient=not strict)
    body = {**narrowed(schema), "x-guidance": options}
    return "%json " + json.dumps(body, ensure_ascii=False)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _no_substrings(*texts: str) -> str:
    """A Lark terminal body: any UTF-8 text containing none of `texts`."""
    alts = "|".join(_rx_escape(t) for t in texts)
    return f"/(?s:.*)/ & ~/(?s:.*({alts}).*)/"


def _rx_escape(text: str) -> str:
    """`text` as a regex (inside /.../) matching itself."""
    out = []
    for c in text:
        if c.isascii() and not c.isalnum() and c not in " _":
            out.append(f"\\x{{{ord(c):x}}}")
        else:
            out.append(c)
    return "".join(out)


# ---- the grammar under construction ----------------------------------------------------------
class _Lark:
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


def _custom_input(g: _Lark, tool: ToolSpec, dsml: str | None = None) -> str:
    """Grammar element for a custom tool's input: inside a ChatML JSON string (escaped, without
    its quotes) or, given the DSML token element `dsml`, a raw DSML string parameter followed by
    its closing tag; constrained to the tool's grammar when it has one."""
    from zen5 import lark_json_string as ljs
    json_string = dsml is None
    if tool.grammar is None or tool.grammar_syntax == "regex":
        rx = "(?s:.*)" if tool.grammar is None else tool.grammar
        if json_string:
            return g.terminal(ljs.JSON_STRING_BODY if tool.grammar is None
                              else f"/{_slash(ljs.escape_regex(rx))}/")
        return _dsml_free_value(g, f"/{_slash(rx)}/")
    try:
        lark = ljs.json_string_grammar(tool.grammar) if json_string else tool.grammar
    except ljs.GrammarError as e:
        raise ConstraintError(f"custom tool {tool.name!r}: {e}") from None
    # DSML: a grammar that ends in open text (e.g. /.*/) would swallow the closing tag's "</";
    # grammars such as apply_patch end in fixed text
    return g.side_grammar(lark) + ("" if json_string else f' "</" {dsml} "parameter>"')


def _slash(rx: str) -> str:
    """A regex made safe for Lark's /.../ syntax."""
    import llguidance
    return llguidance.regex_to_lark(rx, "")


# ---- ChatML: <tool_call> JSON blocks ---------------------------------------------------------
_IM_END = "<|im_end|>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def _chatml(g: _Lark, demand: Demand) -> str:
    """The start expression for a ChatML assistant message."""
    if demand.calls == "none":
        return _answer(g, demand, _no_substrings(_CALL_OPEN, _IM_END))
    body = g.rule(" | ".join(_chatml_call_body(g, t) for t in demand.tools), "call_body")
    call = g.rule(f"{_lit(_CALL_OPEN)} {body}", "call")
    # blocks are joined by "\n"; with parallel calls a blank tail (dropped by the parser) lets a
    # model that writes "\n" after each block still stop; a single call ends at EOS
    tail = f' ("\\n" {call})* "\\n"?' if demand.parallel else ""
    if demand.calls == "forced":
        return f"{call}{tail}"
    answer = _answer(g, demand, _no_substrings(_CALL_OPEN, _IM_END))
    if demand.answer is not None:  # a JSON answer or calls: they differ in the first byte
        return f"{answer} | {call}{tail}"
    # free text, then maybe calls: the lazy head ends at the first "<tool_call>"
    plain = g.terminal(_no_substrings(_IM_END))
    head = g.rule(f"{plain} {_lit(_CALL_OPEN)}", "head", "[lazy]")
    return f"{answer} | {head} {body}{tail}"


def _chatml_call_body(g: _Lark, tool: ToolSpec) -> str:
    """Everything of one call after `<tool_call>`: the JSON line and the closing tag."""
    head = '\n{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
    close = _lit("}\n" + _CALL_CLOSE)
    if tool.kind == "custom":  # {"input": "<the input, JSON-escaped>"}
        opening, closing = _lit(head + "{" + json.dumps(CUSTOM_INPUT) + ': "'), _lit('"}')
        return g.rule(f"{opening} {_custom_input(g, tool)} {closing} {close}", "body")
    args = g.rule(_json_rule_body(tool.parameters, tool.strict), "args")
    return g.rule(f"{_lit(head)} {args} {close}", "body")


def _answer(g: _Lark, demand: Demand, free_text: str) -> str:
    """The text answer: JSON per the response format, else free text (a terminal body)."""
    if demand.answer is not None:
        return g.rule(_json_rule_body(demand.answer, demand.answer_strict), "answer")
    return g.rule(g.terminal(free_text), "answer")


# ---- DeepSeek V4: DSML blocks ----------------------------------------------------------------
_DSML = "｜DSML｜"
# control strings the official parser refuses in reasoning and content
_DS_FORBIDDEN = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", _DSML)


@dataclass(frozen=True)
class _DsmlIds:
    dsml: int
    think_close: int


def _dsml(g: _Lark, demand: Demand, thinking: bool, ids: _DsmlIds) -> str:
    """The start expression for a DeepSeek V4 assistant message (after the prompt's <think> or
    </think>)."""
    prefix = ""
    if thinking:
        cap = "" if demand.thinking_budget is None else f"[max_tokens={demand.thinking_budget}]"
        reasoning = g.rule(g.terminal(_no_substrings(*_DS_FORBIDDEN)), "reasoning", cap)
        prefix = f"{reasoning} <[{ids.think_close}]> "
    answer = _answer(g, demand, _no_substrings(*_DS_FORBIDDEN))
    if demand.calls == "none":
        return f"{prefix}{answer}"
    d = f"<[{ids.dsml}]>"
    invoke = g.rule(" | ".join(_dsml_invoke(g, t, d) for t in demand.tools), "invoke")
    more = f' ("\\n" {invoke})*' if demand.parallel else ""
    # "\n" and "</" apart: a lexer that took "\n</" as one literal could not back out of "\n<"
    # when the next invoke starts instead (lexemes are matched greedily, without backtracking)
    rest = g.rule(f'{invoke}{more} "\\n" "</" {d} "tool_calls>"', "block_rest")
    block = f'"\\n\\n<" {d} "tool_calls>\\n" {rest}'
    if demand.calls == "forced":
        return f"{prefix}{block}"
    if demand.answer is not None:
        return f"{prefix}({answer} | {block})"
    # content, then maybe a block: the lazy head ends at the block's opening tag
    plain = g.terminal(_no_substrings(*_DS_FORBIDDEN))
    head = g.rule(f'{plain} "\\n\\n<{_DSML}tool_calls>\\n"', "head", "[lazy]")
    return f"{prefix}({answer} | {head} {rest})"


def _dsml_invoke(g: _Lark, tool: ToolSpec, d: str) -> str:
    """One invoke: header, one line per parameter (each followed by "\\n"), closing tag."""
    header = f'"<" {d} {_lit(f"invoke name={json.dumps(tool.name, ensure_ascii=False)}>" + chr(10))}'
    if tool.kind == "custom":
        params = [(_dsml_string_param(g, CUSTOM_INPUT, _custom_input(g, tool, d), d), True)]
    else:
        params = _dsml_params(g, tool, d)
    body = " ".join(f'({p} "\\n")' + ("" if required else "?") for p, required in params)
    if not params:
        body = '"\\n"'  # the canonical empty invoke has a blank line
    return g.rule(f'{header} {body} "</" {d} "invoke>"', "invoke")


def _dsml_params(g: _Lark, tool: ToolSpec, d: str) -> list[tuple[str, bool]]:
    """(parameter rule, required) in schema order. string="true" for string values (raw text),
    string="false" with JSON for the rest; a property that may be either offers both."""
    schema = _resolve_top(tool.parameters)
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = _required(schema)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = []
    for key, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        alts = []
        if _may_be_string(sub):
            alts.append(_dsml_string_param(g, key, _raw_string(g, sub, d), d))
        if _may_be_other(sub):
            value = g.rule(_json_rule_body({**sub, **defs}, tool.strict), "value")
            alts.append(g.rule(f'"<" {d} {_lit(_param_head(key, False))} {value} "</" {d} "parameter>"',
                               "param"))
        out.append((g.rule(" | ".join(alts), "param"), key in required))
    return out


def _param_head(key: str, is_string: bool) -> str:
    return f'parameter name="{key}" string="{"true" if is_string else "false"}">'


def _dsml_string_param(g: _Lark, key: str, value_and_close: str, d: str) -> str:
    return g.rule(f'"<" {d} {_lit(_param_head(key, True))} {value_and_close}', "param")


def _dsml_free_value(g: _Lark, body: str) -> str:
    """Raw text matching `body` (a terminal body) and then the parameter's closing tag, as one
    terminal: text may contain "</", so a lexer reading value and tag separately would take the
    tag's "</" into the value; text without the DSML marker can only end at the tag."""
    value = g.terminal(f"{body} & ~/(?s:.*{_rx_escape(_DSML)}.*)/")
    return g.terminal(f'{value} "</{_DSML}parameter>"')


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


def _raw_string(g: _Lark, sub: dict, d: str) -> str:
    """A string="true" value and its closing tag: the raw string (no quotes, no escapes) within
    the schema's enum, const, pattern (anchored ones) and length bounds."""
    values = [sub["const"]] if "const" in sub else sub.get("enum")
    if isinstance(values, list):
        strings = [v for v in values if isinstance(v, str) and _DSML not in v]
        if strings:
            return f'({" | ".join(_lit(v) for v in strings)}) "</" {d} "parameter>"'
    lo, hi = sub.get("minLength", 0), sub.get("maxLength")
    body = f"/(?s:.{{{int(lo)},{'' if hi is None else int(hi)}}})/"
    pattern = sub.get("pattern")
    if isinstance(pattern, str):
        inner = pattern[1 if pattern.startswith("^") else 0:]
        inner = inner[:-1] if inner.endswith("$") and not inner.endswith("\\$") else inner
        if pattern.startswith("^") and pattern.endswith("$"):
            body += f" & /{_slash(inner)}/"
        else:
            body += f" & /(?s:.*)({_slash(inner)})(?s:.*)/"
    return _dsml_free_value(g, body)


# ---- the whole grammar -----------------------------------------------------------------------
def build_grammar(demand: Demand, dialect: str, thinking_mode: str = "chat",
                  token_id=None) -> str:
    """The llguidance grammar (JSON text) for a demand in a dialect. `token_id(text)` maps the
    dialect's special tokens to ids (DeepSeek only)."""
    g = _Lark()
    if dialect == "chatml":
        start = _chatml(g, demand)
    elif dialect == "deepseek_v4":
        ids = _DsmlIds(_required_id(token_id, _DSML), _required_id(token_id, "</think>"))
        start = _dsml(g, demand, thinking_mode == "thinking", ids)
    else:
        raise ConstraintError(f"no constrained decoding for the {dialect!r} dialect")
    return g.text(start)


def _required_id(token_id, text: str) -> int:
    tid = token_id(text) if token_id is not None else None
    if tid is None:
        raise ConstraintError(f"the tokenizer has no {text!r} token")
    return tid


# ---- runtime ---------------------------------------------------------------------------------
_LLG_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zen5-mask")
BACKGROUND_MASK = True   # compute the next mask while the engine evaluates (bench: --sync)


def llg_tokenizer(tokenizer):
    """llguidance's view of a zen5 Tokenizer (its token trie), built once per tokenizer (about a
    second for a 129k vocabulary). EOS: every id that ends generation."""
    cached = _LLG_TOKENIZERS.get(tokenizer)
    if cached is None:
        import llguidance
        eos = sorted(tokenizer.eos_ids)
        cached = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                        eos_token=eos or None)
        _LLG_TOKENIZERS[tokenizer] = cached
    return cached


class TokenConstraint:
    """One request's matcher: `mask(logits)` before sampling, `advance(token)` after it. The
    next mask is computed in the background from `advance` on (see the module docstring)."""

    def __init__(self, tokenizer, grammar: str, background: bool | None = None):
        import llguidance
        self._llg = llg_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self._llg, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"cannot constrain this request: {self.matcher.get_error()}")
        self.n_vocab = self._llg.vocab_size
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._background = BACKGROUND_MASK if background is None else background
        self._pending: Future | None = None
        self._start_mask()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        self._wait()
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab,
                                bitorder="little").view(bool)
        if not allowed.any():  # the matcher failed: advance() reports it and drops the constraint
            return logits
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(self.n_vocab, logits.shape[-1])
        np.copyto(out[:n], logits[:n], where=allowed[:n])
        return out

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False (the matcher is then in an error state) if the grammar
        did not allow it. Starts computing the next mask."""
        self._wait()
        ok = self.matcher.consume_token(int(token))
        if ok:
            self._start_mask()  # once the grammar is complete, the mask is the EOS alone
        return ok

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def _start_mask(self) -> None:
        if self._background:
            # the task holds the buffer: a request dropped mid-computation must not free it
            self._pending = _POOL.submit(_fill_mask, self.matcher, self._bits)
        else:
            _fill_mask(self.matcher, self._bits)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def _fill_mask(matcher, bits: np.ndarray) -> None:
    """The matcher's next-token mask written into `bits` (llguidance releases the GIL)."""
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
