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


# ---- V4 Flash's real inventory, without the weights ------------------------------------------------

# The official config.json's keys for V4 Flash (spec 1.1), less what the loader does not read.
V4_FLASH_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "num_nextn_predict_layers": 1,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "routed_scaling_factor": 1.5,
    "norm_topk_prob": True, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def real_inventory(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the official checkpoint for `cfg` (no MTP): name -> (dtype, shape), the
    dtypes of spec 4.3: FP8 dense projections and MXFP4 routed experts with their E8M0 scales, BF16
    embed / head / norms / compressors / router / indexer head weights, F32 hc_* / ape / sinks /
    router bias, I64 tid2eid."""
    import dsv4_checkpoint as ck

    out = {}
    for name, (shape, kind) in ck.tensor_specs(cfg).items():
        f = _format_of(name)
        if kind == "tid2eid":
            out[name] = ("I64", shape)
        elif kind in ("hc_fn", "hc_base", "hc_scale", "sink", "ape", "bias"):
            out[name] = ("F32", shape)
        elif f == "fp8":
            out[name] = ("F8_E4M3", shape)
            out[name[:-7] + ".scale"] = ("F8_E8M0", (-(-shape[0] // 128), -(-shape[1] // 128)))
        elif f == "mxfp4":
            out[name] = ("I8", (shape[0], shape[1] // 2))
            out[name[:-7] + ".scale"] = ("F8_E8M0", (shape[0], shape[1] // 32))
        else:
            out[name] = ("BF16", shape)
    return out


_SIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}


def write_inventory(out_dir: Path, cfg: dict, shards: int = 46, random: bool = False, seed: int = 0) -> int:
    """The official inventory for `cfg` in `shards` safetensors files, with config.json and
    model.safetensors.index.json; returns the total bytes the files claim.

    random=False: the data are holes (each file is extended to its full size with truncate), so
    the files read as zeros and take no disk: the real headers (names, dtypes, shapes, offsets)
    of a model larger than RAM. random=True: real values, tensor by tensor (peak memory one
    tensor): FP8 projections quantized from tests/dsv4_checkpoint.py's draws, MXFP4 experts as
    uniform random codes with scale 2^-7 (about that recipe's N(0, 1/sqrt(in)) magnitude, and far
    faster to make at 256 experts), everything else as that file draws it."""
    import dsv4_checkpoint as ck

    inventory = real_inventory(cfg)
    kinds = {name: kind for name, (_, kind) in ck.tensor_specs(cfg).items()}
    tensors = list(inventory.items())
    total = sum(_SIZE[dt] * int(np.prod(shape)) for _, (dt, shape) in tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map, i, claimed = {}, 0, 0
    pending_scale: dict[str, np.ndarray] = {}

    def data(name: str, dt: str, shape: tuple[int, ...]) -> np.ndarray:
        if dt == "F8_E8M0":
            return pending_scale.pop(name)
        if dt == "I8":  # packed e2m1 codes
            pending_scale[name[:-7] + ".scale"] = np.full((shape[0], shape[1] * 2 // 32), 120, np.uint8)
            return rng.integers(0, 256, shape, np.uint8)
        val = ck._draw(rng, shape, kinds[name], cfg)
        if dt == "F8_E4M3":
            q, pending_scale[name[:-7] + ".scale"] = to_fp8(val)
            return q
        return ck._to_bf16_bits(val) if dt == "BF16" else val

    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, off, members = {"__metadata__": {"format": "pt"}}, 0, []
        while i < len(tensors) and (s == shards - 1 or claimed + off < total * (s + 1) // shards):
            name, (dt, shape) = tensors[i]
            n = _SIZE[dt] * int(np.prod(shape))
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            weight_map[name] = fname
            members.append((name, dt, shape))
            off, i = off + n, i + 1
        claimed += off
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        with open(out_dir / fname, "wb") as fh:
            fh.write(len(h).to_bytes(8, "little"))
            fh.write(h)
            if random:
                for name, dt, shape in members:
                    fh.write(np.ascontiguousarray(data(name, dt, shape)).tobytes())
            fh.truncate(8 + len(h) + off)  # holes, unless written
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}) + "\n")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return total
