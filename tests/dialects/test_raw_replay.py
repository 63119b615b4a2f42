"""Exact replay: an assistant message carrying RAW_TOOL_BLOCK renders the sampled bytes, while
the same calls as JSON render canonically (and differently when the model's spelling was not
canonical)."""
import json

import pytest

from zen5.dialects import get_dialect
from zen5.dialects.base import RAW_TOOL_BLOCK

SAMPLED = {
    # key order and spacing the canonical renderer would not produce
    "chatml": 'Let me check.\n<tool_call>\n{"arguments": {"b": 1,  "a": "x"}, "name": "f"}\n</tool_call>',
    "deepseek_v4": ('ok</think>Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                    '<｜DSML｜parameter name="b" string="false">1.0</｜DSML｜parameter>\n'
                    '<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'
                    '</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_raw_block_renders_sampled_bytes(name):
    d = get_dialect(name)
    # with tools, DeepSeek V4 keeps earlier reasoning (drop rule off), so history only grows
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    opts = {"thinking_mode": "thinking", "tools": tools}
    user = [{"role": "user", "content": "go"}]
    prompt = d.render(user, **opts)
    parsed = d.parse(SAMPLED[name], lenient=True, **opts)
    assert len(parsed.tool_calls) == 1 and parsed.tool_block_raw
    # the client replays the call as JSON of its own spelling: keys sorted, numbers re-printed
    replayed = json.dumps(json.loads(parsed.tool_calls[0].arguments), sort_keys=True)
    call = {"id": "call_1", "type": "function",
            "function": {"name": parsed.tool_calls[0].name, "arguments": replayed}}
    msg = {"role": "assistant", "content": parsed.content, "tool_calls": [call]}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    result = [{"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    exact = d.render(user + [dict(msg, **{RAW_TOOL_BLOCK: parsed.tool_block_raw})] + result, **opts)
    canonical = d.render(user + [msg] + result, **opts)
    assert exact.startswith(prompt + SAMPLED[name])
    assert not canonical.startswith(prompt + SAMPLED[name])
    assert "".join(s.text for s in d.render_segments(user + [dict(msg, **{RAW_TOOL_BLOCK: parsed.tool_block_raw})]
                                                    + result, **opts)) == exact
