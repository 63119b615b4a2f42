"""A Lark grammar's language, JSON-string-escaped: for custom tools inside ChatML's JSON calls.

Why: ChatML writes a custom tool's free-form input as a JSON string (`{"input": "..."}`), so the
model samples the *escaped* text (`\\n` for a newline, `\\"` for a quote) while the tool's grammar
describes the raw input. JSON escaping maps each character to a fixed sequence, so the escaped
language of a context-free grammar is the same grammar with every terminal replaced by its
escaped form: the rules are kept and only terminals (string literals and regexes) are rewritten.
Escapes are Python json.dumps's (ensure_ascii=False): `\\"`, `\\\\`, `\\b \\f \\n \\r \\t`, and
`\\u00XX` for other control characters; every other character stands for itself.

The grammar is read with the `lark` package (imports such as `%import common.LF` resolved,
`+ * ? [ ]` expanded into plain rules), each terminal's Python regex is parsed with the standard
library's regex parser, and the result is written in llguidance's Lark dialect (Rust regex
syntax). llguidance-only extensions (`%json`, `<[id]>`, `&`, `~`, lexeme attributes) are not
accepted here: GrammarError.
"""
from __future__ import annotations

import json
import re

try:  # the standard library's regex parser (sre_parse before Python 3.11)
    from re import _constants as C
    from re import _parser as sre
except ImportError:  # pragma: no cover
    import sre_constants as C  # type: ignore
    import sre_parse as sre  # type: ignore

__all__ = ["GrammarError", "JSON_STRING_BODY", "escape_regex", "json_string_grammar"]

# Any JSON string body in canonical escaping (a Lark terminal body).
JSON_STRING_BODY = r'/([^"\\\x00-\x1f]|\\["\\bfnrt]|\\u00[01][0-9a-f])*/'

_SPECIAL = ['"', "\\"] + [chr(i) for i in range(0x20)]   # the characters JSON escapes
_PLAIN = r'[^"\\\x00-\x1F]'                               # all the others
_CATEGORIES = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
               C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}
_CATEGORY_TEST = {k: re.compile(v) for k, v in _CATEGORIES.items()}
_ANCHORS = (C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING)


class GrammarError(ValueError):
    """The grammar cannot be read or uses something the rewrite does not support."""


def _escaped(ch: str) -> str:
    """The canonical JSON escape of one character, as a regex."""
    return _literal(json.dumps(ch, ensure_ascii=False)[1:-1])


def _literal(text: str) -> str:
    """`text` as a Rust regex matching exactly it (never a raw '/' or newline)."""
    return "".join(c if c.isalnum() or not c.isascii() else f"\\x{{{ord(c):X}}}" for c in text)


# ---- regexes ---------------------------------------------------------------------------------
class _Rx:
    """Rewrites one parsed Python regex into the Rust regex of its escaped language."""

    def __init__(self, flags: int):
        self.flags = flags

    def seq(self, items) -> str:
        return "".join(self.node(op, av) for op, av in items)

    def node(self, op, av) -> str:
        if op is C.LITERAL:
            ch = chr(av)
            if ch in _SPECIAL:
                return _escaped(ch)
            return f"(?i:{_literal(ch)})" if self.flags & re.I and ch.isalpha() else _literal(ch)
        if op is C.NOT_LITERAL:
            return self.char_set([(C.LITERAL, av)], negate=True)
        if op is C.ANY:
            return self.any()
        if op is C.IN:
            negate = bool(av) and av[0][0] is C.NEGATE
            return self.char_set(av[1:] if negate else av, negate)
        if op is C.BRANCH:
            return "(?:" + "|".join(self.seq(b) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            return self.group(av)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            hi_text = "" if hi is C.MAXREPEAT else str(hi)
            return f"(?:{self.seq(sub)}){{{lo},{hi_text}}}"
        if op is getattr(C, "ATOMIC_GROUP", None):
            return f"(?:{self.seq(av)})"
        if op is C.AT and av in _ANCHORS:
            return ""  # a terminal matches whole; anchors add nothing
        raise GrammarError(f"regex construct {op} is not supported in a custom tool grammar")

    def group(self, av) -> str:
        _gid, add, remove, sub = av
        saved, self.flags = self.flags, (self.flags | add) & ~remove
        try:
            return f"(?:{self.seq(sub)})"
        finally:
            self.flags = saved

    def any(self) -> str:
        dotall = self.flags & re.S
        specials = [c for c in _SPECIAL if dotall or c != "\n"]
        return "(?:" + "|".join([_PLAIN] + [_escaped(c) for c in specials]) + ")"

    def char_set(self, items, negate: bool) -> str:
        """A character class: its unescaped members as they are, its special members escaped."""
        body = "".join(self.class_item(op, av) for op, av in items)
        cls = f"[{'^' if negate else ''}{body}]"
        plain = f"[{cls}&&{_PLAIN}]"
        if self.flags & re.I:
            plain = f"(?i:{plain})"
        specials = [c for c in _SPECIAL if self.contains(items, c) != negate]
        return "(?:" + "|".join([plain] + [_escaped(c) for c in specials]) + ")"

    @staticmethod
    def class_item(op, av) -> str:
        if op is C.LITERAL:
            return _literal(chr(av))
        if op is C.RANGE:
            return f"{_literal(chr(av[0]))}-{_literal(chr(av[1]))}"
        if op is C.CATEGORY and av in _CATEGORIES:
            return _CATEGORIES[av]
        raise GrammarError(f"character class item {op} {av} is not supported")

    @staticmethod
    def contains(items, ch: str) -> bool:
        code = ord(ch)
        for op, av in items:
            if op is C.LITERAL and av == code or op is C.RANGE and av[0] <= code <= av[1]:
                return True
            if op is C.CATEGORY and _CATEGORY_TEST[av].fullmatch(ch):
                return True
        return False


def escape_regex(pattern: str, flags: int = 0) -> str:
    """The Rust regex matching exactly the JSON escapes of the strings `pattern` matches (as a
    whole: anchors are dropped)."""
    try:
        parsed = sre.parse(pattern, flags)
    except re.error as e:
        raise GrammarError(f"bad regex {pattern!r}: {e}") from None
    return _Rx(parsed.state.flags).seq(parsed.data)


# ---- grammars ----------------------------------------------------------------------------------
_FLAG_BITS = {"i": re.I, "s": re.S, "m": re.M, "x": re.X, "u": 0, "l": 0}


def _load(grammar: str):
    """lark's Grammar object for a standard Lark grammar (imports resolved, not yet compiled)."""
    try:
        from lark.load_grammar import load_grammar
        return load_grammar(grammar, "<custom tool grammar>", [], False)[0]
    except ImportError:
        raise GrammarError("the lark package is needed for custom tool grammars in ChatML") from None
    except Exception as e:  # lark's GrammarError, UnexpectedInput, ...
        raise GrammarError(f"cannot read the Lark grammar: {e}") from None


def _pattern_regex(pattern) -> str:
    """The escaped-language regex of a lark PatternStr / PatternRE."""
    source = pattern.value if pattern.type == "re" else re.escape(pattern.value)
    flags = 0
    for f in pattern.flags:
        flags |= _FLAG_BITS.get(f, 0)
    return escape_regex(source, flags)


class _Recursive(Exception):
    pass


class _Inline:
    """A non-recursive grammar as one regex: every rule and terminal inlined. One lexeme means no
    lexeme boundaries, where escapes would make a greedy lexer stumble (a line terminal that may
    continue with `\\"` and a following "\\n" terminal both start with a backslash)."""

    def __init__(self, loaded):
        from lark.load_grammar import _literal_to_pattern
        self.literal = _literal_to_pattern
        self.defs = {(False, name): tree for name, params, tree, _o in loaded.rule_defs}
        self.defs.update({(True, name): tree for name, (tree, _p) in loaded.term_defs})
        if any(params for _n, params, _t, _o in loaded.rule_defs):
            raise GrammarError("rule templates are not supported")
        self.active: set = set()
        self.done: dict = {}

    def symbol(self, is_term: bool, name: str) -> str:
        key = (is_term, name)
        if key in self.done:
            return self.done[key]
        if key in self.active:
            raise _Recursive(name)
        if key not in self.defs:
            raise GrammarError(f"{name} is used but not defined")
        self.active.add(key)
        self.done[key] = self.tree(self.defs[key])
        self.active.discard(key)
        return self.done[key]

    def tree(self, t) -> str:
        kind, kids = t.data, t.children
        if kind == "expansions":
            return "(?:" + "|".join(self.tree(k) for k in kids) + ")"
        if kind == "expansion":
            return "".join(self.tree(k) for k in kids)
        if kind == "alias":
            return self.tree(kids[0])
        if kind == "maybe":
            return f"(?:{self.tree(kids[0])})?"
        if kind == "expr":
            return self.expr(kids)
        if kind == "value":
            return self.value(kids[0])
        raise GrammarError(f"grammar construct {kind!r} is not supported")

    def expr(self, kids) -> str:
        atom, op = self.tree(kids[0]), str(kids[1])
        if op == "~":
            lo = int(kids[2])
            hi = int(kids[3]) if len(kids) > 3 else lo
            return f"(?:{atom}){{{lo},{hi}}}"
        return f"(?:{atom}){op}"

    def value(self, v) -> str:
        if hasattr(v, "is_term"):  # a Terminal / NonTerminal reference
            return self.symbol(v.is_term, v.name)
        if v.data == "literal":
            return _pattern_regex(self.literal(v.children[0]))
        if v.data == "range":
            a, b = (self.literal(c).value for c in v.children)
            return escape_regex(f"[{re.escape(a)}-{re.escape(b)}]")
        return self.tree(v)


def _rules_grammar(loaded) -> str:
    """Fallback for recursive grammars: lark's compiled rules kept as rules, each terminal
    rewritten. Works unless a terminal may continue with an escape where the next one starts."""
    try:
        terminals, rules, ignore = loaded.compile(["start"], set())
    except Exception as e:
        raise GrammarError(f"cannot compile the Lark grammar: {e}") from None
    names = {t.name: f"T{i}" for i, t in enumerate(terminals)}
    rule_names: dict[str, str] = {"start": "start"}
    for r in rules:
        rule_names.setdefault(r.origin.name, f"r{len(rule_names)}")
    alternatives: dict[str, list[str]] = {}
    for r in rules:
        body = " ".join(names[s.name] if s.is_term else rule_names[s.name] for s in r.expansion)
        alternatives.setdefault(rule_names[r.origin.name], []).append(body or '""')
    lines = ["%llguidance {}"] + [f"{n}: {' | '.join(alts)}" for n, alts in alternatives.items()]
    lines += [f"{names[t.name]}: /{_pattern_regex(t.pattern)}/" for t in terminals]
    lines += [f"%ignore {names[n]}" for n in ignore if n in names]
    return "\n".join(lines)


def json_string_grammar(grammar: str) -> str:
    """The llguidance Lark grammar of the JSON string bodies (no quotes) whose decoded text is in
    the language of `grammar` (a standard Lark grammar with a `start` rule)."""
    loaded = _load(grammar)
    try:
        if not loaded.ignore:  # %ignore acts between lexemes: it needs the rules kept
            try:
                return f"%llguidance {{}}\nstart: /{_Inline(loaded).symbol(False, 'start')}/"
            except _Recursive:
                pass
        return _rules_grammar(loaded)
    except GrammarError:
        raise
    except Exception as e:  # lark's own errors on reading a literal (e.g. an empty "")
        raise GrammarError(f"cannot read the Lark grammar: {e}") from None
