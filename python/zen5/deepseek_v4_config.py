"""Validated DeepSeek V4 configuration, parsed from the official Hugging Face `config.json`.

DeepSeek V4 differs from the Llama-style decoders `ModelConfig` describes (hyper-connections,
one shared K=V head, per-layer KV compression, a lightning indexer, hash-routed MoE), so it has
its own frozen dataclass. It also answers the attribute names the rest of zen5 reads from a
`ModelConfig` (`arch`, `n_layer`, `n_embd`, `n_head`, ...), and gives the native engine a plain
dict (`to_native`) and its two RoPE frequency tables (`rope_tables`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zen5.config import UnsupportedModelError

ARCH = "deepseek_v4"
ALLOWED_RATIOS = (0, 4, 128)  # window only, CSA (overlapping windows + indexer), HCA


@dataclass(frozen=True)
class DeepSeekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int        # RoPE acts on the last qk_rope_head_dim dims of each head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per layer (MTP's entry dropped): 0, 4 or 128
    rope_theta: float            # plain RoPE of the ratio-0 layers
    compress_rope_theta: float   # RoPE (YaRN when yarn_factor is set) of the compressed layers
    yarn_factor: float | None    # None: the compressed layers use plain RoPE too
    yarn_original_max_position_embeddings: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int         # the first num_hash_layers layers route by token id (tid2eid)
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"

    def __post_init__(self):
        _validate(self)

    # --- parsing ----------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict, source=None) -> "DeepSeekV4Config":
        """Parse (and validate) an official DeepSeek V4 `config.json` dict."""
        return _from_hf(cls, cfg, source)

    # --- what the rest of zen5 reads from a ModelConfig ---------------------------------------

    arch = ARCH
    n_head_kv = 1          # one shared K=V head (validated)
    tied_output = False    # embed and head are separate tensors
    rope_neox = False      # pairs are interleaved (x[2i], x[2i+1]) on the tail of each head
    qkv_bias = False
    qk_norm = False
    rope_scaling = None    # the main (ratio-0) RoPE is unscaled; YaRN is only for compressed layers

    @property
    def n_layer(self) -> int:
        return self.num_hidden_layers

    @property
    def n_embd(self) -> int:
        return self.hidden_size

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @property
    def n_ff(self) -> int:
        return self.moe_intermediate_size

    @property
    def n_ctx_train(self) -> int:
        return self.max_position_embeddings

    @property
    def rms_eps(self) -> float:
        return self.rms_norm_eps

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    # --- for the native engine ----------------------------------------------------------------

    def to_native(self) -> dict:
        return {
            "vocab_size": self.vocab_size, "hidden": self.hidden_size, "n_layers": self.num_hidden_layers,
            "n_heads": self.num_attention_heads, "head_dim": self.head_dim, "rope_dim": self.qk_rope_head_dim,
            "q_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_rank": self.o_lora_rank,
            "window": self.sliding_window, "ratios": [int(r) for r in self.compress_ratios],
            "index_heads": self.index_n_heads, "index_dim": self.index_head_dim, "index_topk": self.index_topk,
            "n_experts": self.n_routed_experts, "top_k": self.num_experts_per_tok,
            "moe_inter": self.moe_intermediate_size, "n_hash_layers": self.num_hash_layers,
            "route_scale": float(self.routed_scaling_factor), "swiglu_limit": float(self.swiglu_limit),
            "hc_mult": self.hc_mult, "hc_iters": self.hc_sinkhorn_iters, "hc_eps": float(self.hc_eps),
            "rms_eps": float(self.rms_norm_eps), "n_ctx_train": self.max_position_embeddings,
        }

    def rope_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(main, compress) inverse frequencies, float32, rope_dim/2 entries each.

        main: 1/rope_theta^(2i/rope_dim) (ratio-0 layers). compress: YaRN with compress_rope_theta,
        exactly as transformers' `_compute_yarn_parameters` (truncated correction range, linear
        ramp over rope_dim/2 pairs, no mscale: DeepSeek V4 never scales cos/sin), computed in
        float64 and cast once.
        """
        d = self.qk_rope_head_dim
        exps = np.arange(0, d, 2, dtype=np.float64) / d
        main = 1.0 / (float(self.rope_theta) ** exps)
        base = float(self.compress_rope_theta)
        extra = 1.0 / (base ** exps)
        if self.yarn_factor is None:
            return main.astype(np.float32), extra.astype(np.float32)
        inter = extra / float(self.yarn_factor)
        orig = float(self.yarn_original_max_position_embeddings)

        def correction_dim(rotations):
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.yarn_beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.yarn_beta_slow)), d - 1)
        if low == high:
            high += 0.001  # as transformers: avoid dividing by zero
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolation = 1.0 - ramp
        compress = inter * (1.0 - extrapolation) + extra * extrapolation
        return main.astype(np.float32), compress.astype(np.float32)

    def rope_inv_freq(self) -> np.ndarray:
        """The main (ratio-0 layer) table; `rope_tables` has both."""
        return self.rope_tables()[0]


# --- parsing helpers ----------------------------------------------------------------------------

def _err(source, msg: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: config.json: {msg}" if source else f"config.json: {msg}")


def _int(cfg, key, source, default=None):
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _err(source, f"{key} missing or not an integer ({v!r})")
    return v


def _num(cfg, key, source, default=None):
    v = cfg.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise _err(source, f"{key} missing or not a number ({v!r})")
    return float(v)


def _token_id(cfg, key, source):
    v = cfg.get(key)
    if isinstance(v, list):  # some configs list several eos ids; the first is the primary one
        v = v[0] if v else None
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise _err(source, f"{key} is not an integer ({v!r})")
    return v


def _rope_params(cfg, source) -> tuple[float, dict | None]:
    """(rope_theta, YaRN dict or None) from `rope_scaling` or transformers-style `rope_parameters`
    (flat, or nested {"main": ..., "compress": ...})."""
    rp = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        main = rp.get("main") if isinstance(rp.get("main"), dict) else {}
        if (main.get("rope_type") or main.get("type") or "default") != "default":
            raise _err(source, f"rope_parameters.main must be plain RoPE, got {main}")
        theta = theta if theta is not None else main.get("rope_theta")
        scaling = scaling if isinstance(scaling, dict) else rp["compress"]
    elif isinstance(rp, dict):
        theta = theta if theta is not None else rp.get("rope_theta")
        scaling = scaling if isinstance(scaling, dict) else rp
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise _err(source, f"rope_theta is not a number ({theta!r})")
    if not isinstance(scaling, dict):
        return float(theta), None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise _err(source, f"RoPE scaling type {kind!r} is not supported for DeepSeek V4 (only yarn)")
    return float(theta), scaling


# transformers' `save_pretrained` writes layer_types / compress_rates / mlp_layer_types instead of the
# official compress_ratios / num_hash_layers: both spellings load.
_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _compress_theta(cfg, source) -> float:
    rp = cfg.get("rope_parameters")
    if "compress_rope_theta" not in cfg and isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        return _num(rp["compress"], "rope_theta", source)
    return _num(cfg, "compress_rope_theta", source)


def _ratios_from_layer_types(cfg, source) -> list[int]:
    rates = cfg.get("compress_rates") if isinstance(cfg.get("compress_rates"), dict) else {}
    out = []
    for i, t in enumerate(cfg["layer_types"]):
        if t not in _LAYER_TYPES:
            raise _err(source, f"layer_types[{i}] is {t!r}; expected one of {', '.join(_LAYER_TYPES)}")
        out.append(0 if _LAYER_TYPES[t] is None else rates.get(t, _LAYER_TYPES[t]))
    return out


def _hash_layers(cfg, source) -> int:
    types = cfg.get("mlp_layer_types")
    if "num_hash_layers" in cfg or not isinstance(types, list):
        return _int(cfg, "num_hash_layers", source, 0)
    n = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
    if any(t != "moe" for t in types[n:]):
        raise _err(source, f"mlp_layer_types must be 'hash_moe' layers followed by 'moe' layers, got {types}")
    return n


def _from_hf(cls, cfg: dict, source) -> DeepSeekV4Config:
    if cfg.get("model_type") != ARCH:
        raise _err(source, f"model_type {cfg.get('model_type')!r} is not {ARCH!r}")
    q = cfg.get("quantization_config")
    if q is not None and (not isinstance(q, dict) or q.get("quant_method") != "fp8"
                          or list(q.get("weight_block_size") or [128, 128]) != [128, 128]):
        # the official checkpoint: FP8 blocks of 128 x 128 (and MXFP4 experts); the tensors' own
        # dtypes say which matrix is in which format (loader/deepseek_v4.py)
        raise _err(source, f"quantization_config {q!r} is not the official one (quant_method fp8, "
                           f"weight_block_size [128, 128])")
    n_layer = _int(cfg, "num_hidden_layers", source)
    ratios = cfg.get("compress_ratios")
    if ratios is None and isinstance(cfg.get("layer_types"), list):
        ratios = _ratios_from_layer_types(cfg, source)
    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
        raise _err(source, f"compress_ratios missing or not a list of integers ({ratios!r})")
    if len(ratios) < n_layer:
        raise _err(source, f"compress_ratios has {len(ratios)} entries for {n_layer} layers")
    # The official list also holds the MTP layers' ratios (num_nextn_predict_layers entries at the
    # end); zen5 runs the main layers only.
    ratios = tuple(ratios[:n_layer])
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise _err(source, f"scoring_func {scoring!r} is not supported (DeepSeek V4 uses 'sqrtsoftplus')")
    theta, yarn = _rope_params(cfg, source)
    if yarn is not None:
        if yarn.get("attention_factor", 1.0) != 1.0 or yarn.get("mscale") not in (None, 0, 1, 1.0):
            raise _err(source, f"YaRN with an attention factor / mscale is not DeepSeek V4's RoPE ({yarn})")
        factor = yarn.get("factor")
        if factor is None:  # transformers' fallback
            factor = _int(cfg, "max_position_embeddings", source) / _num(yarn, "original_max_position_embeddings",
                                                                          source)
        yarn_fields = dict(
            yarn_factor=_num({"factor": factor}, "factor", source),
            yarn_original_max_position_embeddings=_int(yarn, "original_max_position_embeddings", source),
            # `or`: transformers treats 0/None as the paper's defaults
            yarn_beta_fast=_num({"b": yarn.get("beta_fast") or 32}, "b", source),
            yarn_beta_slow=_num({"b": yarn.get("beta_slow") or 1}, "b", source))
    else:
        yarn_fields = dict(yarn_factor=None, yarn_original_max_position_embeddings=0,
                           yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    norm_topk = cfg.get("norm_topk_prob", True)
    if not isinstance(norm_topk, bool):
        raise _err(source, f"norm_topk_prob is not a boolean ({norm_topk!r})")
    try:
        return cls(
            vocab_size=_int(cfg, "vocab_size", source), hidden_size=_int(cfg, "hidden_size", source),
            num_hidden_layers=n_layer, num_attention_heads=_int(cfg, "num_attention_heads", source),
            num_key_value_heads=_int(cfg, "num_key_value_heads", source, 1),
            head_dim=_int(cfg, "head_dim", source), qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", source),
            q_lora_rank=_int(cfg, "q_lora_rank", source), o_groups=_int(cfg, "o_groups", source),
            o_lora_rank=_int(cfg, "o_lora_rank", source), sliding_window=_int(cfg, "sliding_window", source),
            compress_ratios=ratios, rope_theta=theta,
            compress_rope_theta=_compress_theta(cfg, source), **yarn_fields,
            index_n_heads=_int(cfg, "index_n_heads", source), index_head_dim=_int(cfg, "index_head_dim", source),
            index_topk=_int(cfg, "index_topk", source),
            n_routed_experts=_int(cfg, "n_routed_experts", source),
            num_experts_per_tok=_int(cfg, "num_experts_per_tok", source),
            n_shared_experts=_int(cfg, "n_shared_experts", source, 1),
            moe_intermediate_size=_int(cfg, "moe_intermediate_size", source),
            num_hash_layers=_hash_layers(cfg, source), scoring_func=scoring,
            routed_scaling_factor=_num(cfg, "routed_scaling_factor", source, 1.0), norm_topk_prob=norm_topk,
            swiglu_limit=_num(cfg, "swiglu_limit", source), hc_mult=_int(cfg, "hc_mult", source),
            hc_sinkhorn_iters=_int(cfg, "hc_sinkhorn_iters", source), hc_eps=_num(cfg, "hc_eps", source),
            rms_norm_eps=_num(cfg, "rms_norm_eps", source),
            max_position_embeddings=_int(cfg, "max_position_embeddings", source),
            bos_token_id=_token_id(cfg, "bos_token_id", source), eos_token_id=_token_id(cfg, "eos_token_id", source))
    except UnsupportedModelError as e:  # the dataclass's checks don't know the file
        raise _err(source, str(e)) from None


def _validate(c: DeepSeekV4Config) -> None:
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                 "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"):
        if getattr(c, name) <= 0:
            raise UnsupportedModelError(f"{name} must be positive, got {getattr(c, name)}")
    if c.num_key_value_heads != 1:
        raise UnsupportedModelError(f"num_key_value_heads must be 1 (DeepSeek V4 has one shared K=V head), "
                                    f"got {c.num_key_value_heads}")
    if c.n_shared_experts != 1:
        raise UnsupportedModelError(f"n_shared_experts must be 1, got {c.n_shared_experts}")
    if c.scoring_func != "sqrtsoftplus":
        raise UnsupportedModelError(f"scoring_func {c.scoring_func!r} is not supported (only 'sqrtsoftplus')")
    if len(c.compress_ratios) != c.num_hidden_layers:
        raise UnsupportedModelError(f"{len(c.compress_ratios)} compress_ratios for {c.num_hidden_layers} layers")
    bad = [(i, r) for i, r in enumerate(c.compress_ratios) if r not in ALLOWED_RATIOS]
    if bad:
        i, r = bad[0]
        raise UnsupportedModelError(f"compress_ratios[{i}] is {r}; each layer's ratio must be 0, 4 or 128")
    if c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.head_dim:
        raise UnsupportedModelError(f"qk_rope_head_dim {c.qk_rope_head_dim} must be even and at most "
                                    f"head_dim {c.head_dim}")
    if (c.num_attention_heads * c.head_dim) % c.o_groups:
        raise UnsupportedModelError(f"num_attention_heads*head_dim = {c.num_attention_heads * c.head_dim} is not "
                                    f"divisible by o_groups {c.o_groups}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise UnsupportedModelError(f"num_experts_per_tok {c.num_experts_per_tok} exceeds n_routed_experts "
                                    f"{c.n_routed_experts}")
    if not 0 <= c.num_hash_layers <= c.num_hidden_layers:
        raise UnsupportedModelError(f"num_hash_layers {c.num_hash_layers} is not in [0, {c.num_hidden_layers}]")
    for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps", "hc_eps", "swiglu_limit",
                 "routed_scaling_factor"):
        if not getattr(c, name) > 0:
            raise UnsupportedModelError(f"{name} must be positive, got {getattr(c, name)}")
    if c.yarn_factor is not None:
        if not (c.yarn_factor > 0 and c.yarn_original_max_position_embeddings > 0
                and c.yarn_beta_fast > 0 and c.yarn_beta_slow > 0):
            raise UnsupportedModelError(
                f"yarn rope_scaling needs positive factor, original_max_position_embeddings, beta_fast and "
                f"beta_slow (got {c.yarn_factor}, {c.yarn_original_max_position_embeddings}, "
                f"{c.yarn_beta_fast}, {c.yarn_beta_slow})")
    for name in ("bos_token_id", "eos_token_id"):
        v = getattr(c, name)
        if v is not None and not 0 <= v < c.vocab_size:
            raise UnsupportedModelError(f"{name} {v} is outside the vocabulary [0, {c.vocab_size})")
