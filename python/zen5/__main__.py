"""Command line: `python -m zen5 generate|info`.

Defaults come from the dataclasses (SamplingParams), so the CLI and the Python API agree.
"""
from __future__ import annotations

import argparse
import json
import sys

from zen5.sampling import SamplingParams

_DEFAULTS = SamplingParams()


def _add_model_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--model", default="smollm2" if required else None,
                   help="model name (smollm2) or path to a GGUF file / HF safetensors directory")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens (default: the model's, capped)")


def _cmd_generate(a: argparse.Namespace) -> int:
    from zen5.engine import Engine

    eng = Engine.load(a.model, threads=a.threads, ctx=a.ctx)
    prompt = a.prompt
    if not a.raw and eng.chat_template:
        prompt = eng.apply_chat_template([{"role": "user", "content": prompt}])
    chunks = eng.generate(prompt, max_tokens=a.max_tokens, stream=True, stop=a.stop or None,
                          temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          min_p=a.min_p, seed=a.seed)
    for c in chunks:
        sys.stdout.write(c.text)
        sys.stdout.flush()
        if c.usage:
            u = c.usage
            sys.stdout.write("\n")
            print(f"[{c.finish_reason}] prompt {u.prompt_tokens} tokens ({u.prefill_tps:.1f} tok/s), "
                  f"generated {u.completion_tokens} tokens ({u.decode_tps:.1f} tok/s), "
                  f"{eng.threads} threads, isa {eng.isa}", file=sys.stderr)
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    import zen5
    from zen5 import _native
    from zen5.engine import Engine, default_threads

    out = {"version": zen5.__version__, "isa": _native.isa,
           "avx512_supported": _native.avx512_supported(),
           "threads": a.threads or default_threads()}
    if a.model:
        eng = Engine.load(a.model, threads=a.threads, ctx=a.ctx)
        out["model"] = eng.info()
    print(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zen5", description="CPU-native LLM inference")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream a completion to stdout")
    _add_model_args(g, required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=_DEFAULTS.temperature)
    g.add_argument("--top-k", type=int, default=_DEFAULTS.top_k)
    g.add_argument("--top-p", type=float, default=_DEFAULTS.top_p)
    g.add_argument("--min-p", type=float, default=_DEFAULTS.min_p)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    g.set_defaults(fn=_cmd_generate)

    i = sub.add_parser("info", help="print version, kernel ISA and model facts as JSON")
    _add_model_args(i, required=False)
    i.set_defaults(fn=_cmd_info)

    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"zen5: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
