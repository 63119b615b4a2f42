"""Llama-architecture GGUFs at real model widths with random weights, for the real-size benchmark
(`python -m zen5 bench --model-size 1.7b|8b`, bench/real_bench.py; issue 21).

Why random weights: prefill and decode speed do not depend on the weights' values (every kernel
reads every byte of every matrix and does the same arithmetic whatever the numbers are), so a
file with the widths, layer count, types and vocabulary of a real model measures what the real
model would, without a download. The values are kept sane so the model runs without NaN/inf:
fp16 block scales around 1/sqrt(cols)/8 (Q4_0/Q4_1), /128 (Q8_0), BF16 values of about that
size, RMSNorm weights 1.0; the output is gibberish, which does not matter here.

Shapes (SHAPES; a test passes its own small `Shape`):
  1.7b  SmolLM2-1.7B-like: hidden 2048, 24 layers, FFN 8192, 32 heads, 32 KV heads, head_dim 64,
        vocab 49152, tied embeddings, the "smollm" pre-tokenizer (about 1.7 G parameters);
  8b    Llama-3-8B-like: hidden 4096, 32 layers, FFN 14336, 32 heads, 8 KV heads, head_dim 128,
        vocab 128256, untied output, the "llama-bpe" pre-tokenizer (about 8.0 G parameters);
  tiny  hidden 256, 2 layers: for smoke runs of the bench code only (never a recorded row).
Every matrix, the token embedding and the output head have the file's type (Q4_0, Q4_1, Q8_0 or
BF16; real Q4 files often keep the head in Q6_K, these do not), the norms are F32.
File sizes: 1.7b Q4_0 0.96 GB, Q4_1 1.07, Q8_0 1.82, BF16 3.42 (7.3 GB for all four);
8b Q4_0 4.5 GB, Q4_1 5.0, Q8_0 8.5, BF16 16.1 (34 GB for all four).

Tokenizer: a byte-level BPE (the 256 byte tokens, three specials, a few merges) padded with
unreachable normal tokens `[pad<i>]` to the real vocabulary size, so token_embd / output have the
real number of rows; llama.cpp (llama-bench, llama-cli) and zen5 both load it.

Files are written straight from random bytes (quantized blocks with their scales patched in),
tensor by tensor in chunks of rows, with a small GGUF v3 writer of our own: gguf.GGUFWriter keeps
every tensor in memory until it writes, and an 8B BF16 file is 16 GB. They are cached outside the
repository (default ~/.cache/zen5/bench-models, or ZEN5_BENCH_MODELS, or the `root` argument;
never committed) and reused when the file's size and its `.json` marker (shape, type, seed,
writer version) match. Same seed, same bytes.

    python bench/real_models.py --size 1.7b [--types Q4_0,BF16] [--dir DIR]   # prints the paths
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from zen5.tokenizer import byte_chars

WRITER_VERSION = 1
SPEED_NOTE = "random weights: speed does not depend on the weights' values"
TYPES = ("Q4_0", "Q4_1", "Q8_0", "BF16")
ALIGN = 32
CHUNK_BYTES = 32 << 20  # rows generated and written at a time

# ggml type id, block size (values), bytes per block
GGML = {"F32": (0, 1, 4), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "BF16": (30, 1, 2)}
FILE_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}  # general.file_type (llama_ftype)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    pre: str = "smollm"
    ctx: int = 8192
    rope_base: float = 10000.0

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape as rows x cols) in file order; 1-D tensors are norms."""
        e, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        out = [("token_embd.weight", (self.vocab, e))]
        for i in range(self.layers):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", (e,)), (p + "attn_q.weight", (q, e)), (p + "attn_k.weight", (kv, e)),
                    (p + "attn_v.weight", (kv, e)), (p + "attn_output.weight", (e, q)),
                    (p + "ffn_norm.weight", (e,)), (p + "ffn_gate.weight", (f, e)), (p + "ffn_up.weight", (f, e)),
                    (p + "ffn_down.weight", (e, f))]
        out.append(("output_norm.weight", (e,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, e)))
        return out

    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors())


SHAPES = {
    "1.7b": Shape("1.7b", hidden=2048, layers=24, ffn=8192, heads=32, kv_heads=32, head_dim=64, vocab=49152,
                  tied=True, pre="smollm", ctx=8192, rope_base=130000.0),
    "8b": Shape("8b", hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                tied=False, pre="llama-bpe", ctx=8192, rope_base=500000.0),
    "tiny": Shape("tiny", hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=1024,
                  tied=True, pre="smollm", ctx=2048),
}


def default_root() -> Path:
    return Path(os.environ.get("ZEN5_BENCH_MODELS") or Path.home() / ".cache" / "zen5" / "bench-models")


def tensor_bytes(shape: tuple[int, ...], qtype: str) -> int:
    _, block, size = GGML[qtype]
    return math.prod(shape) // block * size


def file_name(shape: Shape, qtype: str) -> str:
    if SHAPES.get(shape.name) == shape:
        return f"llama-{shape.name}-random.{qtype}.gguf"
    digest = hashlib.sha256(json.dumps(asdict(shape), sort_keys=True).encode()).hexdigest()[:10]
    return f"llama-{shape.name}-{digest}-random.{qtype}.gguf"


# ---------------------------------------------------------------- the tokenizer
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("Ġ", "t"), ("Ġ", "a"), ("t", "h"), ("i", "n")]


def vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials (type 3), the byte tokens and the merges' results
    (type 1), padded with unreachable normal tokens to n_vocab."""
    tokens = SPECIALS + byte_chars() + ["".join(m) for m in MERGES]
    if n_vocab < len(tokens):
        raise ValueError(f"vocab {n_vocab} is smaller than the {len(tokens)} base tokens")
    tokens += [f"[pad{i}]" for i in range(n_vocab - len(tokens))]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


# ---------------------------------------------------------------- a streaming GGUF v3 writer
_U32, _I32, _F32, _BOOL, _STR, _ARR, _U64 = 4, 5, 6, 7, 8, 9, 10


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value) -> bytes:
    out = _str(key)
    if isinstance(value, bool):
        return out + struct.pack("<IB", _BOOL, value)
    if isinstance(value, int):
        return out + struct.pack("<II", _U32, value)
    if isinstance(value, float):
        return out + struct.pack("<If", _F32, value)
    if isinstance(value, str):
        return out + struct.pack("<I", _STR) + _str(value)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return out + struct.pack("<IIQ", _ARR, _STR, len(value)) + b"".join(_str(v) for v in value)
    if isinstance(value, list):
        return out + struct.pack("<IIQ", _ARR, _I32, len(value)) + np.asarray(value, "<i4").tobytes()
    raise TypeError(f"{key}: unsupported metadata value {value!r}")


def metadata(shape: Shape, qtype: str) -> list[tuple[str, object]]:
    tokens, types, merges = vocab(shape.vocab)
    a = "llama"
    return [("general.architecture", a), ("general.name", f"zen5 random {shape.name} ({qtype})"),
            ("general.file_type", FILE_TYPE[qtype]), ("general.alignment", ALIGN),
            ("general.description", SPEED_NOTE),
            (f"{a}.context_length", shape.ctx), (f"{a}.embedding_length", shape.hidden),
            (f"{a}.block_count", shape.layers), (f"{a}.feed_forward_length", shape.ffn),
            (f"{a}.attention.head_count", shape.heads), (f"{a}.attention.head_count_kv", shape.kv_heads),
            (f"{a}.attention.key_length", shape.head_dim), (f"{a}.attention.value_length", shape.head_dim),
            (f"{a}.rope.dimension_count", shape.head_dim), (f"{a}.rope.freq_base", float(shape.rope_base)),
            (f"{a}.attention.layer_norm_rms_epsilon", 1e-5), (f"{a}.vocab_size", shape.vocab),
            ("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", shape.pre),
            ("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.token_type", types),
            ("tokenizer.ggml.merges", merges), ("tokenizer.ggml.bos_token_id", 1),
            ("tokenizer.ggml.eos_token_id", 0), ("tokenizer.ggml.add_bos_token", False)]


def _pad(n: int) -> int:
    return (ALIGN - n % ALIGN) % ALIGN


def _scale_table(base: float) -> np.ndarray:
    """256 fp16 scales between 0.75 and 1.25 x base, indexed by a random byte."""
    return (base * (0.75 + 0.5 * np.arange(256) / 255)).astype("<f2")


def _random_bytes(rng: np.random.PCG64, n: int) -> np.ndarray:
    """n random bytes (a writable array), straight from the bit generator (rng.bytes is 5x slower)."""
    return rng.random_raw(-(-n // 8)).view(np.uint8)[:n]


def random_rows(rng: np.random.PCG64, rows: int, cols: int, qtype: str) -> bytes:
    """`rows` rows of `cols` values in `qtype` from random bytes, finite and of sane size
    (x ~ 0.6/sqrt(cols)), so matmul outputs keep about their input's scale."""
    base = 1.0 / math.sqrt(cols) / 8
    if qtype == "BF16":  # random sign and mantissa, the exponent one of two octaves around the target
        r = _random_bytes(rng, rows * cols * 2).view("<u2")
        e = r >> np.uint16(7)
        e &= np.uint16(1)
        e += np.uint16(127 + int(math.floor(math.log2(4.6 * base))) - 1)
        e <<= np.uint16(7)
        r &= np.uint16(0x807F)
        r |= e
        return r.tobytes()
    _, block, size = GGML[qtype]
    nb = rows * cols // block
    raw = _random_bytes(rng, nb * size).reshape(nb, size)
    if qtype == "Q8_0":
        raw[:, :2] = _scale_table(base / 16)[raw[:, 0]].view(np.uint8).reshape(nb, 2)
    elif qtype == "Q4_0":
        raw[:, :2] = _scale_table(base)[raw[:, 0]].view(np.uint8).reshape(nb, 2)
    else:  # Q4_1: x = d * q + m with m = -8 d, centred like Q4_0
        d = _scale_table(base)[raw[:, 0]]
        raw[:, :2] = d.view(np.uint8).reshape(nb, 2)
        raw[:, 2:4] = (-8 * d.astype(np.float32)).astype("<f2").view(np.uint8).reshape(nb, 2)
    return raw.tobytes()


def write_gguf(path: Path, shape: Shape, qtype: str, seed: int = 0) -> None:
    """Write the whole file, tensor by tensor (memory stays about CHUNK_BYTES)."""
    if qtype not in TYPES:
        raise ValueError(f"unknown type {qtype!r}: one of {', '.join(TYPES)}")
    tensors = shape.tensors()
    kv = metadata(shape, qtype)
    infos, offset = [], 0
    for name, dims in tensors:
        t = "F32" if len(dims) == 1 else qtype
        if len(dims) == 2 and dims[1] % GGML[t][1]:
            raise ValueError(f"{name}: {dims[1]} columns is not a multiple of the {t} block")
        infos.append((name, dims, t, offset))
        offset += tensor_bytes(dims, t) + _pad(tensor_bytes(dims, t))
    with open(path, "wb") as fh:
        head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(_kv(k, v) for k, v in kv)
        for name, dims, t, off in infos:  # dims innermost first, as ggml's ne[]
            head += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims[::-1]) \
                + struct.pack("<IQ", GGML[t][0], off)
        fh.write(head + b"\0" * _pad(len(head)))
        for i, (name, dims, t, _) in enumerate(infos):
            n = tensor_bytes(dims, t)
            if len(dims) == 1:
                fh.write(np.ones(dims, "<f4").tobytes())
            else:
                rng = np.random.PCG64([seed, i])
                rows, cols = dims
                step = max(1, CHUNK_BYTES // max(1, tensor_bytes((1, cols), t)))
                for r0 in range(0, rows, step):
                    fh.write(random_rows(rng, min(step, rows - r0), cols, t))
            fh.write(b"\0" * _pad(n))


def ensure(shape: Shape | str, qtype: str, root: Path | str | None = None, seed: int = 0, log=None) -> Path:
    """The cached file for (shape, type, seed), written first if missing or stale."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    root = Path(root) if root else default_root()
    path = root / file_name(shape, qtype)
    marker = path.with_name(path.name + ".json")
    want = {"writer": WRITER_VERSION, "shape": asdict(shape), "type": qtype, "seed": seed, "note": SPEED_NOTE}
    try:
        have = json.loads(marker.read_text())
        if have.get("bytes") == path.stat().st_size and {k: have.get(k) for k in want} == want:
            return path
    except (OSError, ValueError):
        pass
    root.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"writing {path} ({shape.n_params() / 1e9:.2f} G parameters, {qtype}; {SPEED_NOTE})")
    marker.unlink(missing_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        write_gguf(tmp, shape, qtype, seed)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    marker.write_text(json.dumps(dict(want, bytes=path.stat().st_size), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SHAPES), required=True)
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma list of {','.join(TYPES)}")
    ap.add_argument("--dir", type=Path, help=f"cache directory (default {default_root()})")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for t in (x.strip() for x in a.types.split(",") if x.strip()):
        print(ensure(a.size, t, a.dir, a.seed, log=lambda m: print(m, file=sys.stderr, flush=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
