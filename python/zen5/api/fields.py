"""Typed reads of wire JSON, with errors that name the field and say what was expected.

Adapters are tolerant of what they do not use (unknown fields are ignored everywhere, as real
clients send many) and strict about what they do use: a wrong type on a field we act on is a 400
naming its path (`messages[2].content[0].text: expected a string, got an integer`), never a 500.
"""
from __future__ import annotations

import json
import math
import re

from zen5.api.errors import bad_request

_MISSING = object()
_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
          int: "an integer", float: "a number"}


def type_name(value) -> str:
    return _NAMES.get(type(value), type(value).__name__)


def at(path: str, key) -> str:
    """Path of a child: at("messages", 2) -> "messages[2]", at("m", "content") -> "m.content"."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _fail(path: str, expected: str, value):
    return bad_request(f"{path}: expected {expected}, got {type_name(value)}", param=path)


def obj(value, path: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, "an object", value)
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _lone_surrogate(value) -> bool:
    """Whether any string (key or value) holds a lone UTF-16 surrogate, which no reply can encode."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object (a 400 that says why otherwise). Python's parser takes
    more than JSON, and what it takes would fail later as a 500: NaN and Infinity (refused here),
    lone surrogate escapes such as "\ud800" (refused when the body has a surrogate escape at all,
    so only such bodies are walked) and nesting deeper than the interpreter's recursion limit."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply; send a flatter JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type_name(body)}")
    if re.search(rb"\\u[dD][89a-fA-F]", raw) and _lone_surrogate(body):
        raise bad_request("the request body holds a lone UTF-16 surrogate escape (e.g. \\ud800), "
                          "which is not text; pair it or remove it")
    return body


def _get(d: dict, key: str, path: str, required: bool):
    v = d.get(key, _MISSING)
    if v is _MISSING or (v is None and not required):
        if required:
            raise bad_request(f"{at(path, key)}: this field is required", param=at(path, key))
        return _MISSING
    return v


def get_str(d: dict, key: str, path: str = "", *, required: bool = False, default=None):
    v = _get(d, key, path, required)
    if v is _MISSING:
        return default
    if not isinstance(v, str):
        raise _fail(at(path, key), "a string", v)
    return v


def get_int(d: dict, key: str, path: str = "", *, required: bool = False, default=None,
            minimum: int | None = None):
    v = _get(d, key, path, required)
    if v is _MISSING:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(at(path, key), "an integer", v)
    if minimum is not None and v < minimum:
        raise bad_request(f"{at(path, key)}: must be >= {minimum}, got {v}", param=at(path, key))
    return v


def get_num(d: dict, key: str, path: str = "", *, default=None, low: float | None = None,
            high: float | None = None):
    v = _get(d, key, path, False)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(at(path, key), "a finite number", v)
    if (low is not None and v < low) or (high is not None and v > high):
        raise bad_request(f"{at(path, key)}: must be between {low} and {high}, got {v}", param=at(path, key))
    return float(v)


def get_bool(d: dict, key: str, path: str = "", *, default: bool = False) -> bool:
    v = _get(d, key, path, False)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise _fail(at(path, key), "a boolean", v)
    return v


def get_list(d: dict, key: str, path: str = "", *, required: bool = False) -> list:
    v = _get(d, key, path, required)
    if v is _MISSING:
        return []
    if not isinstance(v, list):
        raise _fail(at(path, key), "an array", v)
    return v


def get_obj(d: dict, key: str, path: str = "", *, required: bool = False) -> dict:
    v = _get(d, key, path, required)
    if v is _MISSING:
        return {}
    return obj(v, at(path, key))


# Every stop string is matched against the tail of the text at each sampled token, and holding
# back a partial match costs up to its length squared: bound both. OpenAI documents at most 4
# `stop` strings; Anthropic documents no limit for `stop_sequences`, and real clients send a
# handful of short markers. These limits are far above either.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000


def get_stop(d: dict, key: str, path: str = "") -> tuple[str, ...]:
    """A stop string or a list of them (empty strings are dropped: they would stop at once);
    at most MAX_STOP_STRINGS of at most MAX_STOP_CHARS characters each."""
    v = _get(d, key, path, False)
    if v is _MISSING:
        return ()
    items = [v] if isinstance(v, str) else v
    where = at(path, key)
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _fail(where, "a string or an array of strings", v)
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"{where}: at most {MAX_STOP_STRINGS} stop strings, got {len(items)}", param=where)
    for i, s in enumerate(items):
        if len(s) > MAX_STOP_CHARS:
            p = where if isinstance(v, str) else at(where, i)
            raise bad_request(f"{p}: a stop string may be at most {MAX_STOP_CHARS} characters, got {len(s)}",
                              param=p)
    return tuple(s for s in items if s)


def text_parts(content, path: str, text_types: tuple[str, ...]) -> str:
    """Content given as a string or as an array of text parts (`{"type": "text", "text": ...}`),
    joined. Other part types (images, files) are refused by name: our models read text only."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _fail(path, "a string or an array of content parts", content)
    out = []
    for i, part in enumerate(content):
        p = obj(part, at(path, i))
        kind = p.get("type", text_types[0])
        if kind not in text_types:
            raise bad_request(f"{at(path, i)}: content type {kind!r} is not supported; this server's "
                              f"models read text only ({', '.join(text_types)})", param=at(path, i))
        out.append(get_str(p, "text", at(path, i), required=True))
    return "".join(out)


def arguments_text(value, path: str) -> str:
    """Tool-call arguments: a JSON object, or a string holding one (kept byte-exact)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise _fail(path, "a JSON object or a string holding one", value)


def one_of(value, choices: tuple[str, ...], path: str) -> str:
    """A string that must be one of `choices` (a 400 listing them otherwise)."""
    if not isinstance(value, str):
        raise _fail(path, "a string", value)
    if value not in choices:
        names = (", ".join(repr(c) for c in choices[:-1]) + " or " if len(choices) > 1 else "") + repr(choices[-1])
        raise bad_request(f"{path}: expected {names}, got {value!r}", param=path)
    return value


FORMAT_TYPES = ("text", "json_object", "json_schema")


def output_format(fmt: dict, path: str, *, nested: str | None = None, strict_default: bool = False,
                  types: tuple[str, ...] = FORMAT_TYPES) -> dict | None:
    """A structured-output format (Chat `response_format`, Responses `text.format`, Anthropic
    `output_config.format`) -> the neutral `ChatRequest.response_format`; None for plain text.
    `nested` names the object that holds name/schema/strict (Chat's `json_schema`); the other
    protocols keep them beside `type`. The schema must be a JSON object; whether it compiles is
    the session's question (a 400 too)."""
    kind = one_of(get_str(fmt, "type", path, required=True), types, at(path, "type"))
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec, spath = (get_obj(fmt, nested, path, required=True), at(path, nested)) if nested else (fmt, path)
    out = {"type": "json_schema", "schema": get_obj(spec, "schema", spath, required=True),
           "strict": get_bool(spec, "strict", spath, default=strict_default)}
    name = get_str(spec, "name", spath)
    if name:
        out["name"] = name
    return out

