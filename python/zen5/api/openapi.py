"""The server's OpenAPI document (GET /openapi.json), written by hand.

It describes the fields the adapters act on, with their types and ranges, so schema-driven tools
(schemathesis in tests/server) can generate valid and invalid requests; every other field real
clients send is accepted and ignored, so objects stay open (`additionalProperties` allowed).
It is a map of the surface, not the full upstream API schemas.
"""
from __future__ import annotations

_STR = {"type": "string"}
_INT1 = {"type": "integer", "minimum": 1}
_BOOL = {"type": "boolean"}
_OBJ = {"type": "object"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STR}}


def _content(block_schema: dict) -> dict:
    return {"anyOf": [_STR, {"type": "array", "items": block_schema}]}


# structured outputs: a JSON Schema the answer must follow (compiled by the session; 400 if it cannot be)
_SCHEMA_FIELDS = {"name": _STR, "schema": _OBJ, "strict": _BOOL}
_OPENAI_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}}}

_ANTHROPIC_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
    "text": _STR, "id": _STR, "name": _STR, "input": _OBJ, "tool_use_id": _STR,
    "content": _content(_TEXT_PART), "is_error": _BOOL, "thinking": _STR, "signature": _STR, "data": _STR}}

_ANTHROPIC_COMMON = {
    "model": _STR,
    "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant", "system"]},
        "content": _content(_ANTHROPIC_BLOCK)}}},
    "system": _content(_TEXT_PART),
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": _STR, "description": _STR, "input_schema": _OBJ, "strict": _BOOL}}},
    "tool_choice": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": _STR,
        "disable_parallel_tool_use": _BOOL}},
    "output_config": {"type": "object", "properties": {"effort": _STR, "format": {
        "type": "object", "required": ["type", "schema"], "properties": {
            "type": {"type": "string", "enum": ["json_schema"]}, "schema": _OBJ}}}},
    "thinking": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["enabled", "adaptive", "disabled"]}, "budget_tokens": _INT1,
        "display": {"type": "string", "enum": ["summarized", "omitted"]}}},
    "thread": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["create", "continue"]}, "previous_message_id": _STR}},
}

_MESSAGES = {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
    **_ANTHROPIC_COMMON, "max_tokens": _INT1, "stream": _BOOL,
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "top_k": {"type": "integer", "minimum": 0},
    "stop_sequences": {"type": "array", "items": _STR}}}

_COUNT = {"type": "object", "required": ["model", "messages"], "properties": _ANTHROPIC_COMMON}

_OPENAI_SAMPLING = {"temperature": {"type": "number", "minimum": 0, "maximum": 2},
                    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
                    "stream": _BOOL, "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}}}

_NAMED = {"type": "object", "required": ["name"], "properties": {"name": _STR}}
_CUSTOM_FORMAT = {"type": "object", "required": ["type"], "properties": {   # Chat custom tools
    "type": {"type": "string", "enum": ["text", "grammar"]},
    "grammar": {"type": "object", "required": ["syntax", "definition"], "properties": {
        "syntax": {"type": "string", "enum": ["lark", "regex"]}, "definition": _STR}}}}

_CHAT = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": _STR,
    "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [_STR, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
        "reasoning_content": _STR, "tool_call_id": _STR,
        "tool_calls": {"type": "array", "items": {"anyOf": [
            {"type": "object", "required": ["id", "function"], "properties": {
                "id": _STR, "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {
                    "name": _STR, "arguments": _STR}}}},
            {"type": "object", "required": ["id", "type", "custom"], "properties": {
                "id": _STR, "type": {"type": "string", "enum": ["custom"]},
                "custom": {"type": "object", "required": ["name"], "properties": {
                    "name": _STR, "input": _STR}}}}]}}}}},
    "tools": {"type": "array", "items": {"anyOf": [
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": _STR, "description": _STR, "parameters": _OBJ, "strict": _BOOL}}}},
        {"type": "object", "required": ["type", "custom"], "properties": {
            "type": {"type": "string", "enum": ["custom"]},
            "custom": {"type": "object", "required": ["name"], "properties": {
                "name": _STR, "description": _STR, "format": _CUSTOM_FORMAT}}}}]}},
    "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]}, "function": _NAMED}}, {
        "type": "object", "required": ["type", "custom"], "properties": {
            "type": {"type": "string", "enum": ["custom"]}, "custom": _NAMED}}]},
    "parallel_tool_calls": _BOOL,
    "response_format": {**_OPENAI_FORMAT, "properties": {
        **_OPENAI_FORMAT["properties"], "json_schema": {"type": "object", "required": ["schema"],
                                                        "properties": _SCHEMA_FIELDS}}},
    "max_tokens": _INT1, "max_completion_tokens": _INT1, "n": {"type": "integer", "minimum": 1, "maximum": 1},
    "seed": {"type": "integer"}, "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
    "reasoning_effort": _STR, "logprobs": _BOOL, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    **_OPENAI_SAMPLING}}

_COMPLETIONS = {"type": "object", "required": ["model", "prompt"], "properties": {
    "model": _STR, "prompt": {"anyOf": [_STR, {"type": "array", "items": {"type": "integer", "minimum": 0},
                                               "minItems": 1}]},
    "max_tokens": _INT1, "echo": _BOOL, "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "seed": {"type": "integer"}, "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}]}, **_OPENAI_SAMPLING}}

_RESPONSE_ITEM = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "custom_tool_call",
                                        "custom_tool_call_output", "reasoning"]},
    "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
    "content": {"anyOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                             "properties": {"type": {"type": "string", "enum": [
                                                                 "input_text", "output_text"]}, "text": _STR}}}]},
    "call_id": _STR, "name": _STR, "arguments": _STR, "input": _STR, "output": _STR, "encrypted_content": _STR}}

_RESPONSES = {"type": "object", "required": ["model", "input"], "properties": {
    "model": _STR, "input": {"anyOf": [_STR, {"type": "array", "items": _RESPONSE_ITEM}]},
    "instructions": _STR, "previous_response_id": _STR, "store": _BOOL,
    "include": {"type": "array", "items": {"type": "string", "enum": [
        "reasoning.encrypted_content", "message.output_text.logprobs"]}},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function", "custom"]}, "name": _STR, "description": _STR,
        "parameters": _OBJ, "strict": _BOOL,
        "format": {"type": "object", "required": ["type"], "properties": {   # custom tools
            "type": {"type": "string", "enum": ["text", "grammar"]},
            "syntax": {"type": "string", "enum": ["lark", "regex"]}, "definition": _STR}}}}},
    "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"type": "string", "enum": ["function", "custom"]}, "name": _STR}}]},
    "parallel_tool_calls": _BOOL,
    "text": {"type": "object", "properties": {"format": {**_OPENAI_FORMAT, "properties": {
        **_OPENAI_FORMAT["properties"], **_SCHEMA_FIELDS}}}},
    "max_output_tokens": _INT1, "reasoning": {"type": "object", "properties": {"effort": _STR, "summary": _STR}},
    **_OPENAI_SAMPLING}}

_ERROR = {"description": "an error in the protocol's own shape",
          "content": {"application/json": {"schema": _OBJ}}}


def _post(summary: str, schema: dict, streams: bool = True) -> dict:
    ok = {"application/json": {"schema": _OBJ}}
    if streams:
        ok["text/event-stream"] = {"schema": _STR}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": {"description": "the completion", "content": ok},
                                   "400": _ERROR, "401": _ERROR, "409": _ERROR, "413": _ERROR,
                                   "429": _ERROR, "529": _ERROR}}}


def _get(summary: str, media: str = "application/json") -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary,
                                                              "content": {media: {"schema": {}}}}}}}


def openapi_spec(model: str) -> dict:
    return {
        "openapi": "3.0.3",
        "info": {"title": "zen5", "version": "0.1.0",
                 "description": f"OpenAI and Anthropic compatible APIs serving {model}"},
        "paths": {
            "/v1/messages": _post("Anthropic Messages", _MESSAGES),
            "/v1/messages/count_tokens": _post("Anthropic token count", _COUNT, streams=False),
            "/v1/chat/completions": _post("OpenAI Chat Completions", _CHAT),
            "/v1/completions": _post("OpenAI Completions", _COMPLETIONS),
            "/v1/responses": _post("OpenAI Responses", _RESPONSES),
            "/v1/models": _get("the served model"),
            "/health": _get("liveness and queue state"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
        },
    }
