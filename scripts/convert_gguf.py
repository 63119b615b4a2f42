"""Convert a GGUF file's weight matrices to Q8_0 or BF16 with the `gguf` package (the benchmark's
other weight formats; issue 7).

Why this exists: the benchmark compares zen5 and its peers on SmolLM2-135M in Q4_1 (the shipped
file), Q8_0 and BF16, but only the Q4_1 file ships. The two others are derived from it, so every
engine reads exactly the same numbers: each 2-D weight is dequantized with
`gguf.quants.dequantize` and requantized with `gguf.quants.quantize` (Q8_0: 32-value blocks, one
f16 scale; BF16: the top half of each f32). 1-D tensors (the RMSNorm weights, F32) are copied as
they are; so are all metadata keys and the tokenizer (the same copy `gguf_new_metadata.py` does),
except `general.file_type`, which is set to the new type. Requantizing a Q4_1 file to Q8_0 keeps
its values to within Q8_0's rounding; the derived files are benchmark inputs, not better models.

Outputs go to the model cache (`zen5.registry.cache_dir()`, i.e. $ZEN5_CACHE or
~/.cache/zen5/models) as `<stem>.<TYPE>.gguf`, written to a temporary name and renamed, so an
existing output means a finished conversion and a rerun does nothing (idempotent).

Usage: python scripts/convert_gguf.py [--model smollm2] [--types Q8_0,BF16] [--out DIR] [--force]
Prints one output path per type.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np

TYPES = {"Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
         "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16)}


def output_path(src: Path, qtype: str, out_dir: Path) -> Path:
    stem = src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.name
    base = stem.rsplit(".", 1)[0] if "." in stem else stem  # drop the source's own type suffix
    return out_dir / f"{base}.{qtype}.gguf"


def convert(src: Path, dst: Path, qtype: str) -> Path:
    """Write `src` with its 2-D weights in `qtype` to `dst` (atomically). Returns dst."""
    ggml_type, file_type = TYPES[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(int(file_type))
    for field in reader.fields.values():
        # GGUF.* are virtual (header) fields; the writer adds general.architecture itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(int(file_type))
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: [rows, cols]
        if len(shape) < 2:  # norms (F32) and any other vectors: copied as they are
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        if t.tensor_type == ggml_type:  # already in the target type (Q4_1 file's Q8_0 embedding)
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=ggml_type)
            continue
        f32 = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)  # [rows, cols]
        q = gguf.quants.quantize(f32.astype(np.float32), ggml_type)                      # byte rows
        writer.add_tensor(t.name, q, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from zen5.registry import cache_dir, resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="model name or GGUF path (default smollm2)")
    ap.add_argument("--types", default="Q8_0,BF16", help="comma-separated: Q8_0, BF16")
    ap.add_argument("--out", default=None, help="output directory (default: the zen5 model cache)")
    ap.add_argument("--force", action="store_true", help="convert again even if the output exists")
    a = ap.parse_args(argv)
    src = Path(resolve_model(a.model))
    out_dir = Path(a.out) if a.out else cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    for qtype in [s.strip().upper() for s in a.types.split(",") if s.strip()]:
        if qtype not in TYPES:
            raise SystemExit(f"convert_gguf: unknown type {qtype}; choose from {', '.join(TYPES)}")
        dst = output_path(src, qtype, out_dir)
        if a.force or not dst.exists():
            convert(src, dst, qtype)
        print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
