"""Independent PyTorch reference forward pass: the oracle the native engine is checked against.

Why this file exists: the C++ engine (quantized kernels, KV cache, threads) can only be trusted if
its logits match a second implementation that shares none of its code. This one is plain fp32
eager PyTorch, written straight from the architecture definitions (Llama, Qwen2 = Llama + q/k/v
biases, Qwen3 = Llama + per-head RMSNorm on q and k). It deliberately does NOT use the engine's
loader or `ModelConfig.rope_inv_freq`: `load_for_reference` reads GGUF / HF files itself and
`rope_inv_freq` below recomputes the frequencies, so a bug in the shared code cannot hide in both.
Only the ModelConfig dataclass (plain fields) is borrowed, loaded by file path so the native
extension is never imported.

Tensors follow docs/internal-interfaces.md: name -> (ggml_type, numpy shape, raw uint8 bytes).
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

_CONFIG_PY = Path(__file__).resolve().parents[2] / "python" / "zen5" / "config.py"
_spec = importlib.util.spec_from_file_location("zen5_config_for_reference", _CONFIG_PY)
_cfgmod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _cfgmod  # dataclasses look the module up while building the class
_spec.loader.exec_module(_cfgmod)
ModelConfig = _cfgmod.ModelConfig

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30


# ----------------------------------------------------------------------------- dequantization
def dequantize(ggml_type: int, raw: np.ndarray, shape: tuple) -> torch.Tensor:
    """Raw GGML bytes (rows contiguous, GGUF block layout) -> float32 tensor of `shape`."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if ggml_type == F32:
        x = raw.view(np.float32).copy()
    elif ggml_type == F16:
        x = raw.view(np.float16).astype(np.float32)
    elif ggml_type == BF16:  # bf16 is the top half of an f32
        x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif ggml_type == Q8_0:  # block of 32: {f16 d; i8 qs[32]}
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)            # [n_blocks, 1]
        x = (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)
    elif ggml_type in (Q4_0, Q4_1):  # block of 32: {f16 d; [f16 m;] u8 qs[16]}
        bs = 18 if ggml_type == Q4_0 else 20
        b = raw.reshape(-1, bs)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)            # [n_blocks, 1]
        qs = b[:, bs - 16:]                                                 # [n_blocks, 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)  # [n_blocks, 32]
        if ggml_type == Q4_0:
            x = ((q - 8) * d).reshape(-1)
        else:
            m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
            x = (q * d + m).reshape(-1)
    else:
        raise NotImplementedError(f"ggml type {ggml_type}")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(shape)


# ----------------------------------------------------------------------------- model
def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequency of each rotated pair [head_dim/2], recomputed here on purpose."""
    d = cfg.head_dim
    inv = [1.0 / cfg.rope_theta ** (2 * i / d) for i in range(d // 2)]
    sc = cfg.rope_scaling or {}
    kind = sc.get("type", sc.get("rope_type", "none"))
    if kind == "linear":
        inv = [f / sc["factor"] for f in inv]
    elif kind == "llama3":  # Llama 3.1: stretch low frequencies, keep high, blend in between
        factor, old = sc["factor"], sc.get("original_max_position_embeddings", 8192)
        lo, hi = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        inv = out
    elif kind not in ("none", "default"):
        raise NotImplementedError(f"rope scaling {kind}")
    return torch.tensor(inv, dtype=torch.float64)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [heads, n, head_dim]; cos/sin [n, head_dim/2]. Rotates pair i by angle pos*inv_freq[i]."""
    half = x.shape[-1] // 2
    if neox:   # pairs (x[i], x[i + d/2])
        a, b = x[..., :half], x[..., half:]
    else:      # pairs (x[2i], x[2i+1])
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos            # [heads, n, d/2] each
    if neox:
        return torch.cat([ra, rb], dim=-1)
    return torch.stack([ra, rb], dim=-1).flatten(-2)          # re-interleave


def q8_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_0 of x [..., hd] per vector: (round(x / d) half to even, d = max|x| / 127), both float."""
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.where(d > 0, torch.round(x / torch.where(d > 0, d, 1)).clamp(-127, 127), 0.0), d


def q8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What a q8_0 KV cache keeps of x: the values round(x / d) * d."""
    q, d = q8_split(x)
    return q * d


def q8_attention(q, k, v, split: int = 512, block: int = 32) -> torch.Tensor:
    """Causal attention the way the engine runs it over a q8_0 cache (kernels.h), written
    plainly: K and V as int8 x a scale per position and head; each query int8 too (its own
    scale); scores softmaxed per split of `split` positions (max and sum per split, merged at
    the end); the weights p x (V's scale) rounded to u8 steps of (their max / 255) per block of
    `block` positions and multiplied with V's integers. q, k, v: [heads, n, hd] (k, v repeated
    per query head)."""
    h, n, hd = q.shape
    qi, qd = q8_split(q)
    ki, kd = q8_split(k)
    vi, vd = q8_split(v)
    scores = (qi @ ki.transpose(1, 2)) * qd * kd.transpose(1, 2) / math.sqrt(hd)   # [h, n, n]
    pad = -n % split
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    causal = torch.ones(n, n + pad, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf")).view(h, n, -1, split)      # [h, n, S, split]
    m = scores.amax(-1, keepdim=True)
    e = torch.where(torch.isfinite(scores), torch.exp(scores - torch.where(torch.isfinite(m), m, 0)), 0.0)
    w = e * torch.nn.functional.pad(vd[..., 0], (0, pad)).view(h, 1, -1, split)
    wb = w.view(h, n, -1, split // block, block)
    step = wb.amax(-1, keepdim=True) / 255
    wq = (torch.where(step > 0, torch.round(wb / torch.where(step > 0, step, 1)), 0.0) * step).view(h, n, -1, split)
    vs = torch.nn.functional.pad(vi, (0, 0, 0, pad)).view(h, -1, split, hd)         # [h, S, split, hd]
    out = torch.einsum("hnsp,hspd->hnsd", wq, vs)                                    # per split
    live = torch.isfinite(m[..., 0])                                                 # [h, n, S]
    big = torch.where(live, m[..., 0], float("-inf")).amax(-1, keepdim=True)
    f = torch.where(live, torch.exp(m[..., 0] - big), 0.0)
    return (out * f[..., None]).sum(2) / (e.sum(-1) * f).sum(-1, keepdim=True)


class TorchRef:
    def __init__(self, config, tensors: dict, kv_type: str = "f32"):
        """kv_type "q8_0": attention as over a q8_0 cache (q8_attention)."""
        self.cfg = config
        self.kv_q8 = kv_type == "q8_0"
        self.w = {}
        for name, t in tensors.items():
            if hasattr(t, "ggml_type"):  # zen5.loader.Tensor also accepted
                t = (t.ggml_type, t.shape, t.data)
            ggml_type, shape, raw = t
            self.w[name] = dequantize(ggml_type, raw, tuple(shape))
        self.head = self.w["token_embd.weight" if config.tied_output else "output.weight"]
        self.inv_freq = rope_inv_freq(config)                  # [head_dim/2] float64

    def _attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"blk.{i}."
        n, hd = x.shape[0], c.head_dim
        q, k, v = (x @ w[p + f"attn_{s}.weight"].T for s in "qkv")  # [n, heads*hd]
        if c.qkv_bias:
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        q = q.view(n, c.n_head, hd).transpose(0, 1)               # [n_head, n, hd]
        k = k.view(n, c.n_head_kv, hd).transpose(0, 1)            # [n_head_kv, n, hd]
        v = v.view(n, c.n_head_kv, hd).transpose(0, 1)            # [n_head_kv, n, hd]
        if c.qk_norm:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], c.rms_eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], c.rms_eps)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # [n, hd/2]
        cos, sin = ang.cos().float(), ang.sin().float()
        q, k = apply_rope(q, cos, sin, c.rope_neox), apply_rope(k, cos, sin, c.rope_neox)
        group = c.n_head // c.n_head_kv                           # query heads per kv head
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [n_head, n, hd]
        if self.kv_q8:
            out = q8_attention(q, k, v)
        else:
            scores = q @ k.transpose(1, 2) / math.sqrt(hd)        # [n_head, n, n]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v               # [n_head, n, hd]
        out = out.transpose(0, 1).reshape(n, c.n_head * hd)       # [n, n_head*hd]
        return out @ w[p + "attn_output.weight"].T                # [n, n_embd]

    def hidden(self, tokens: list[int]) -> torch.Tensor:
        """Final-normed hidden states [n_tokens, n_embd]."""
        c, w = self.cfg, self.w
        x = w["token_embd.weight"][torch.tensor(tokens, dtype=torch.long)]  # [n, n_embd]
        for i in range(c.n_layer):
            p = f"blk.{i}."
            x = x + self._attention(i, rms_norm(x, w[p + "attn_norm.weight"], c.rms_eps))
            h = rms_norm(x, w[p + "ffn_norm.weight"], c.rms_eps)
            gate = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T)  # [n, n_ff]
            x = x + (gate * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        return rms_norm(x, w["output_norm.weight"], c.rms_eps)

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Logits [n_tokens, vocab] float32 for every position (full sequence, no cache)."""
        return self.hidden(tokens) @ self.head.T

    @torch.no_grad()
    def greedy(self, tokens: list[int], n: int, stop: set[int] | None = None) -> list[int]:
        """n greedy tokens; recomputes the whole sequence each step (slow, obviously correct)."""
        seq, out = list(tokens), []
        for _ in range(n):
            nxt = int(torch.argmax(self.hidden(seq)[-1] @ self.head.T))
            out.append(nxt)
            seq.append(nxt)
            if stop and nxt in stop:
                break
        return out


# ----------------------------------------------------------------------------- loading
_HF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
             "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight":
             "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
_TORCH_TYPES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


def _load_gguf(path: Path):
    import gguf
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    tensors = {}
    for t in r.tensors:  # GGUF lists dims fastest-first; numpy order is the reverse
        tensors[t.name] = (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)),
                           np.ascontiguousarray(t.data).view(np.uint8).reshape(-1))
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError("GGUF rope_freqs (llama3 scaling) not handled by the reference")
    n_embd, n_head = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type", "none") == "linear":
        scaling = {"type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    cfg = ModelConfig(
        arch=arch, n_layer=meta[f"{arch}.block_count"], n_embd=n_embd,
        n_ff=meta[f"{arch}.feed_forward_length"], n_head=n_head,
        n_head_kv=meta.get(f"{arch}.attention.head_count_kv", n_head),
        head_dim=meta.get(f"{arch}.attention.key_length", n_embd // n_head),
        vocab_size=tensors["token_embd.weight"][1][0],
        n_ctx_train=meta[f"{arch}.context_length"],
        rms_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_neox=arch != "llama",  # llama.cpp's convert permutes llama q/k rows to interleaved
        qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tied_output="output.weight" not in tensors, rope_scaling=scaling)
    return cfg, tensors


def _load_hf(path: Path):
    from safetensors import safe_open
    hf = json.loads((path / "config.json").read_text())
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key == "model.embed_tokens.weight":
                    name = "token_embd.weight"
                elif key == "model.norm.weight":
                    name = "output_norm.weight"
                elif key == "lm_head.weight":
                    name = "output.weight"
                else:  # model.layers.{i}.<rest>
                    _, _, i, rest = key.split(".", 3)
                    name = f"blk.{i}.{_HF_NAMES[rest]}"
                raw = t.contiguous().view(torch.uint8).numpy().reshape(-1)
                tensors[name] = (_TORCH_TYPES[t.dtype], tuple(t.shape), raw)
    tied = bool(hf.get("tie_word_embeddings", False))
    if tied:
        tensors.pop("output.weight", None)
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 keeps theta and scaling here
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scaling = None if kind == "default" else dict(scaling, type=kind)
    n_head = hf["num_attention_heads"]
    cfg = ModelConfig(
        arch=hf["model_type"], n_layer=hf["num_hidden_layers"], n_embd=hf["hidden_size"],
        n_ff=hf["intermediate_size"], n_head=n_head,
        n_head_kv=hf.get("num_key_value_heads", n_head),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, vocab_size=hf["vocab_size"],
        n_ctx_train=hf["max_position_embeddings"], rms_eps=float(hf["rms_norm_eps"]),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_neox=True,
        qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tied_output=tied, rope_scaling=scaling)
    return cfg, tensors


def load_for_reference(path) -> tuple:
    """GGUF file or HF directory -> (ModelConfig, {name: (ggml_type, shape, raw uint8)})."""
    path = Path(path)
    return _load_hf(path) if path.is_dir() else _load_gguf(path)
