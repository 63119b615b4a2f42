"""The official DeepSeek V4 weight formats, written and read with numpy + ml_dtypes (independent of
zen5; spec deepseek-v4-architecture.md 4.3):

  FP8    e4m3 bytes, shape (out, in), one E8M0 scale per 128 x 128 block: (ceil(out/128), ceil(in/128))
  MXFP4  packed e2m1 pairs as I8, shape (out, in / 2), the even element in the low nibble, one
         E8M0 scale per 32 inputs: (out, in / 32)

An E8M0 byte s is 2^(s - 127). `to_fp8` / `to_mxfp4` quantize a float matrix the way the official
converter does (scale = the block's absmax over the format's max, rounded up to a power of two);
`from_fp8` / `from_mxfp4` give the exact values, which a BF16 twin holds exactly (3 or 1 mantissa
bits times a power of two). `packed_twin` turns a plain checkpoint (tests/dsv4_checkpoint.py) into
the packed variant and its dequantized BF16 twin.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

FP8_MAX, FP4_MAX = 448.0, 6.0
# the official checkpoint's choice per matrix (spec 4.3): FP8 dense projections, MXFP4 experts
FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
                "shared_experts.w3.weight")


def _pow2_scale(amax: np.ndarray, fmax: float) -> np.ndarray:
    """E8M0 bytes of 2^ceil(log2(amax / fmax)) (amax 0: the smallest scale that is not 0)."""
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / fmax))
    return np.clip(e + 127, 2, 254).astype(np.uint8)


def e8m0(s: np.ndarray) -> np.ndarray:
    return np.exp2(s.astype(np.float64) - 127).astype(np.float32)


def to_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bytes (out, in), E8M0 scales per 128 x 128 block)."""
    out, inp = w.shape
    bo, bi = -(-out // 128), -(-inp // 128)
    pad = np.zeros((bo * 128, bi * 128), np.float32)
    pad[:out, :inp] = w
    amax = np.abs(pad.reshape(bo, 128, bi, 128)).max(axis=(1, 3))
    s = _pow2_scale(amax, FP8_MAX)
    scaled = w / np.repeat(np.repeat(e8m0(s), 128, 0), 128, 1)[:out, :inp]
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), s


def from_fp8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    out, inp = q.shape
    vals = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return vals * np.repeat(np.repeat(e8m0(s), 128, 0), 128, 1)[:out, :inp]


def to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed pairs as int8 (out, in / 2), E8M0 scales (out, in / 32))."""
    out, inp = w.shape
    amax = np.abs(w.reshape(out, inp // 32, 32)).max(axis=2)
    s = _pow2_scale(amax, FP4_MAX)
    scaled = w / np.repeat(e8m0(s), 32, 1)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # the even element in the low nibble
    return packed.astype(np.uint8).view(np.int8), s


def from_mxfp4(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    p = packed.view(np.uint8)
    codes = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = p & 15, p >> 4
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return vals * np.repeat(e8m0(s), 32, 1)


def _format_of(name: str) -> str | None:
    if ".experts." in name and name.endswith(".weight"):
        return "mxfp4"
    return "fp8" if name.endswith(FP8_SUFFIXES) else None


def packed_twin(plain: Path, packed_dir: Path, twin_dir: Path, swap_nibbles: bool = False) -> tuple[Path, Path]:
    """From a plain checkpoint directory: the packed variant (official formats, a `.scale` per
    quantized matrix, quantization_config set) and its twin holding exactly the packed variant's
    values in BF16. Both keep plain's other files (config, tokenizer). `swap_nibbles`: the packed
    variant's e2m1 pairs in the wrong order (a mis-wired file, for a test that must notice)."""
    import dsv4_checkpoint as ck

    tensors = ck.read_checkpoint(plain)
    packed, twin = {}, {}
    for name, (dt, arr) in tensors.items():
        fmt = _format_of(name)
        if fmt is None:
            val = (dt, ck._to_bf16_bits(arr)) if dt == "BF16" else (dt, arr)
            packed[name] = twin[name] = val
            continue
        w = np.asarray(arr, np.float32)
        if fmt == "fp8":
            q, s = to_fp8(w)
            packed[name], exact = ("F8_E4M3", q), from_fp8(q, s)
        else:
            q, s = to_mxfp4(w)
            packed[name], exact = ("I8", q), from_mxfp4(q, s)
            if swap_nibbles:
                u = q.view(np.uint8)
                packed[name] = ("I8", ((u >> 4) | (u << 4)).astype(np.uint8).view(np.int8))
        packed[name[:-len(".weight")] + ".scale"] = ("F8_E8M0", s)
        bits = ck._to_bf16_bits(exact)
        assert np.array_equal(ck.bf16_bits_to_f32(bits), exact), name  # the twin is exact
        twin[name] = ("BF16", bits)
    for d, tens in ((packed_dir, packed), (twin_dir, twin)):
        d.mkdir(parents=True, exist_ok=True)
        for f in plain.iterdir():
            if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copyfile(f, d / f.name)
        ck._write_safetensors(d / "model.safetensors", tens)
    cfg = json.loads((packed_dir / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    (packed_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return packed_dir, twin_dir
