"""Command line: `python -m zen5 serve|generate|info|cache`.

Defaults come from the dataclasses (SamplingParams, server.ServerConfig), so the CLI and the
Python API agree.
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
    # the flag stays --ctx (llama.cpp users know -c/--ctx-size); in Python the length is n_ctx
    p.add_argument("--ctx", dest="n_ctx", type=int, default=None, metavar="N",
                   help="context size in tokens (default: the model's, capped)")
    p.add_argument("--matmul", choices=("int8", "f32"), default=None,
                   help="quantized matmuls: int8 activations (fast, default) or exact fp32 (env ZEN5_MATMUL)")
    p.add_argument("--kv-type", choices=("f16", "f32", "q8_0"), default=None,
                   help="KV cache element type: f16 (default with int8 matmuls), f32 (default with f32) or "
                        "q8_0 (int8 + a scale per position and head: half the memory; env ZEN5_KV_TYPE)")
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="prompt-lookup speculative decoding: up to N tokens guessed from the context and "
                        "checked per decode step (default 5, 0: off; env ZEN5_LOOKUP). Replies are the same "
                        "token for token either way")
    p.add_argument("--qat-sim", choices=("on", "off"), default=None,
                   help="DeepSeek V4: the official model's FP8/FP4/Hadamard QAT simulations (default on; "
                        "env ZEN5_QAT_SIM=0 turns them off)")
    p.add_argument("--weight-cache", default=None, metavar="DIR|off",
                   help="where the packed weights are cached so later loads map them instead of repacking "
                        "(default ~/.cache/zen5/arena; off: no cache; env ZEN5_WEIGHT_CACHE)")


def _qat(a: argparse.Namespace) -> bool | None:
    return None if a.qat_sim is None else a.qat_sim == "on"


def _cmd_generate(a: argparse.Namespace) -> int:
    from zen5.engine import Engine

    eng = Engine.load(a.model, threads=a.threads, n_ctx=a.n_ctx, matmul=a.matmul, kv_type=a.kv_type,
                      lookup=a.lookup, qat=_qat(a), weight_cache=a.weight_cache)
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
           "tiers": [{"name": name, "supported": not missing, **({"missing": missing} if missing else {})}
                     for name, missing in _native.isa_tiers()],
           "avx512_supported": _native.avx512_supported(),
           "threads": a.threads or default_threads()}
    if a.model:
        eng = Engine.load(a.model, threads=a.threads, n_ctx=a.n_ctx, matmul=a.matmul, kv_type=a.kv_type,
                          lookup=a.lookup, qat=_qat(a), weight_cache=a.weight_cache)
        out["model"] = eng.info()
    print(json.dumps(out, indent=2))
    return 0


def _human(n: float, units=("B", "KB", "MB", "GB", "TB")) -> str:
    for u in units:
        if n < 1000 or u == units[-1]:
            return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
        n /= 1000


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _cmd_cache(a: argparse.Namespace) -> int:
    """Inspect the disk checkpoint directory (no model needed; nothing is removed unless asked)."""
    import os
    import time

    from zen5.checkpoints import CheckpointStore

    if not os.path.isdir(os.path.expanduser(a.dir)):
        raise ValueError(f"no checkpoint directory {a.dir}")
    store = CheckpointStore(a.dir)
    if a.action in ("show", "rm") and not a.key:
        raise ValueError(f"cache {a.action} needs a KEY (a unique prefix is enough)")
    if a.action == "ls":
        now = time.time()
        print(f"{'KEY':12}  {'TOKENS':>7}  {'REASON':9}  {'HITS':>4}  {'SIZE':>9}  {'AGE':>5}  TEXT (end)")
        for e in store.entries():
            tail = e.text[-48:].replace("\n", "\\n")
            print(f"{e.key[:12]}  {e.n_tokens:>7}  {e.reason:9}  {e.hits:>4}  {_human(e.size):>9}  "
                  f"{_age(now - e.created):>5}  ...{tail}")
        for key, why in store.problems.items():
            print(f"{key[:12]}  unusable: {why}")
        print(f"{len(store.entries())} checkpoint(s), {_human(store.nbytes)} in {store.dir}")
        return 0
    if a.action == "clear":
        print(f"removed {store.clear()} file(s) from {store.dir}")
        return 0
    e = store.get(a.key)
    if e is None:
        raise ValueError(f"no single checkpoint with a key starting {a.key!r} in {a.dir}")
    if a.action == "rm":
        store.remove(e.key)
        print(f"removed {e.key}")
        return 0
    info = {"key": e.key, "path": str(e.path), "model_fingerprint": f"{e.fingerprint:016x}",
            "tokens": e.n_tokens, "context": e.n_ctx, "vocab": e.n_vocab, "reason": e.reason,
            "hits": e.hits, "bytes": e.size, "created": time.ctime(e.created),
            "last_used": time.ctime(e.last_used), "tool_ids": [r.id for r in e.tools]}
    print(json.dumps(info, indent=2))
    print("--- text ---")
    print(e.text)
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    from zen5.server import ServerConfig, serve

    return serve(ServerConfig(model=a.model, host=a.host, port=a.port, threads=a.threads, n_ctx=a.n_ctx,
                              api_key=a.api_key, cors=a.cors, trace=a.trace, queue=a.queue,
                              state_dir=a.state_dir, max_output=a.max_output, keepalive=a.keepalive,
                              matmul=a.matmul, kv_type=a.kv_type, lookup=a.lookup, qat=_qat(a),
                              weight_cache=a.weight_cache, shutdown_timeout=a.shutdown_timeout,
                              allowed_hosts=a.allowed_hosts, max_connections=a.max_connections,
                              read_timeout=a.read_timeout))


def _add_serve(sub) -> None:
    from zen5.server import ServerConfig

    d = ServerConfig()
    s = sub.add_parser("serve", help="serve the OpenAI and Anthropic APIs over HTTP")
    _add_model_args(s, required=True)
    s.add_argument("--host", default=d.host, help=f"address to bind (default {d.host}: this machine only)")
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument("--api-key", default=d.api_key,
                   help="require this key (x-api-key or Authorization: Bearer) on every path but /health")
    s.add_argument("--cors", action="store_true",
                   help="allow cross-origin requests from any origin (browsers); without it a foreign Origin is a 403")
    s.add_argument("--allowed-hosts", metavar="NAMES", default=d.allowed_hosts,
                   help="more names the Host header may carry, comma-separated, or '*' (default: the bound "
                        "address, and the loopback names when bound to loopback; any when bound to 0.0.0.0)")
    s.add_argument("--trace", metavar="FILE", default=d.trace,
                   help="append one JSON line per request: rendered prompt, cache decision, parsed output")
    s.add_argument("--queue", type=int, default=d.queue,
                   help=f"requests that may wait while one runs; more get an overload error (default {d.queue})")
    s.add_argument("--state-dir", metavar="DIR", default=d.state_dir,
                   help="where the thinking-signature key and checkpoints live (default ~/.cache/zen5)")
    s.add_argument("--max-output", type=int, default=d.max_output,
                   help="cap on tokens generated per request (default: the context)")
    s.add_argument("--keepalive", type=float, default=d.keepalive,
                   help=f"seconds between SSE keep-alives while a stream is quiet (default {d.keepalive:g})")
    s.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds running requests get to finish on SIGINT/SIGTERM; a request still running "
                        f"is then cut short with an error event and its state saved (default {d.shutdown_timeout:g})")
    s.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections at once; more are answered 503 (default {d.max_connections})")
    s.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help="seconds a client may take to send its headers, or between body bytes "
                        f"(default {d.read_timeout:g})")
    s.set_defaults(fn=_cmd_serve)


def _cmd_bench(a: argparse.Namespace) -> int:
    """Delegate to the benchmark harness, bench/harness.py in the checkout: it drives peer builds
    and C helpers and writes bench/results, so it lives with the repository, not in the package."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "harness.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: `zen5 bench` runs from a source checkout")
    spec = importlib.util.spec_from_file_location("zen5_bench_harness", path)
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness  # dataclasses look the module up while building classes
    spec.loader.exec_module(harness)
    return harness.main(a.args)


def _add_bench(sub) -> None:
    # The harness owns its flags (see `zen5 bench -h`); '+' as prefix makes argparse pass every
    # '-'/'--' flag through to it untouched.
    b = sub.add_parser("bench", prefix_chars="+", add_help=False,
                       help="benchmark zen5 against llama.cpp, PyTorch and the hardware roofs (bench/harness.py)")
    b.add_argument("args", nargs="*")
    b.set_defaults(fn=_cmd_bench)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zen5", description="CPU-native LLM inference")
    sub = ap.add_subparsers(dest="cmd", required=True)

    _add_serve(sub)

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

    from zen5.checkpoints import default_dir

    c = sub.add_parser("cache", help="list, show or remove disk KV checkpoints")
    c.add_argument("action", choices=("ls", "show", "rm", "clear"))
    c.add_argument("key", nargs="?", help="checkpoint key (or a unique prefix) for show / rm")
    c.add_argument("--dir", default=str(default_dir()), help="checkpoint directory (default: %(default)s)")
    c.set_defaults(fn=_cmd_cache)

    _add_bench(sub)

    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"zen5: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
