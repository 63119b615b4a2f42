"""The PyTorch peer: SmolLM2 (llama) in eager PyTorch, fp32 or bf16, with a KV cache.

Why a separate forward from tests/reference/torch_ref.py: the reference recomputes the whole
sequence per token (obviously correct, useless for decode speed). This one keeps K/V per layer
and runs attention through `scaled_dot_product_attention`, as a user of PyTorch would; bf16
weights make oneDNN use AMX on this Xeon (the fastest prefill peer here). The weights come from
the same GGUF file, dequantized by the reference's `load_for_reference` (shared with none of
zen5's kernels) and cast to the peer's dtype. `check_against_reference` pins this forward to the
reference's logits so a fast-but-wrong peer cannot win.

It runs as a worker process (`python bench/torch_peer.py MODEL`), driven by JSON lines on stdin,
so torch's OpenMP threads never share a process with zen5's thread pool while either is timed:
  {"cmd": "run", "dtype": "bf16", "threads": 2, "tokens": [...], "tests": ["pp128", "tg128"]}
  -> {"pp128": seconds, "tg128": seconds}
A test "ppN" is a prefill of the first N tokens into an empty cache; "tgN" is N greedy tokens
(EOS suppressed) after a 1-token prompt, like llama-bench's tg test.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))
from torch_ref import TorchRef, load_for_reference, rope_inv_freq  # noqa: E402


class TorchPeer:
    def __init__(self, cfg, dense: dict[str, torch.Tensor], dtype: torch.dtype, max_ctx: int):
        if cfg.qkv_bias or cfg.qk_norm or cfg.rope_neox:
            raise NotImplementedError("the PyTorch peer covers plain llama (SmolLM2) only")
        self.cfg, self.dtype = cfg, dtype
        self.w = {k: v.to(dtype).contiguous() for k, v in dense.items()}
        self.head = self.w["token_embd.weight" if cfg.tied_output else "output.weight"]
        ang = torch.arange(max_ctx, dtype=torch.float64)[:, None] * rope_inv_freq(cfg)[None, :]
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)   # [max_ctx, head_dim/2]
        kv = (cfg.n_layer, cfg.n_head_kv, max_ctx, cfg.head_dim)
        self.k, self.v = torch.zeros(kv, dtype=dtype), torch.zeros(kv, dtype=dtype)
        self.n_past = 0

    def _rope(self, x: torch.Tensor, pos: slice) -> torch.Tensor:
        """x [heads, n, hd]; llama GGUF rotates interleaved pairs (x[2i], x[2i+1])."""
        cos, sin = self.cos[pos], self.sin[pos]                  # [n, hd/2]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    @torch.inference_mode()
    def eval(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache; returns the last token's logits [vocab] (float32)."""
        c, w, n, p0 = self.cfg, self.w, len(tokens), self.n_past
        pos, hd, group = slice(p0, p0 + n), c.head_dim, c.n_head // c.n_head_kv
        x = w["token_embd.weight"][torch.tensor(tokens, dtype=torch.long)]   # [n, n_embd]
        for i in range(c.n_layer):
            p = f"blk.{i}."
            h = F.rms_norm(x, (c.n_embd,), w[p + "attn_norm.weight"], c.rms_eps)
            q = F.linear(h, w[p + "attn_q.weight"]).view(n, c.n_head, hd).transpose(0, 1)
            k = F.linear(h, w[p + "attn_k.weight"]).view(n, c.n_head_kv, hd).transpose(0, 1)
            v = F.linear(h, w[p + "attn_v.weight"]).view(n, c.n_head_kv, hd).transpose(0, 1)
            self.k[i, :, pos], self.v[i, :, pos] = self._rope(k, pos), v
            q = self._rope(q, pos)                                       # [n_head, n, hd]
            keys = self.k[i, :, :p0 + n].repeat_interleave(group, 0)     # [n_head, ctx, hd]
            vals = self.v[i, :, :p0 + n].repeat_interleave(group, 0)
            if p0 == 0:
                att = F.scaled_dot_product_attention(q, keys, vals, is_causal=True)
            elif n == 1:
                att = F.scaled_dot_product_attention(q, keys, vals)
            else:  # a chunk after cached tokens: causal within the chunk, all of the past
                mask = torch.ones(n, p0 + n, dtype=torch.bool).tril(p0)
                att = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
            x = x + F.linear(att.transpose(0, 1).reshape(n, c.n_head * hd), w[p + "attn_output.weight"])
            h = F.rms_norm(x, (c.n_embd,), w[p + "ffn_norm.weight"], c.rms_eps)
            x = x + F.linear(F.silu(F.linear(h, w[p + "ffn_gate.weight"])) * F.linear(h, w[p + "ffn_up.weight"]),
                             w[p + "ffn_down.weight"])
        self.n_past += n
        h = F.rms_norm(x[-1:], (c.n_embd,), w["output_norm.weight"], c.rms_eps)
        return F.linear(h, self.head)[0].float()

    def reset(self) -> None:
        self.n_past = 0


def load(model_path: str, max_ctx: int) -> tuple:
    """(cfg, dense fp32 tensors) from a GGUF file via the reference loader."""
    cfg, tensors = load_for_reference(model_path)
    dense = TorchRef(cfg, tensors).w
    return cfg, dense


def check_against_reference(model_path: str, tokens: list[int]) -> float:
    """Worst |logit difference| of the fp32 peer (prefill + 3 decode steps) vs. the reference."""
    cfg, tensors = load_for_reference(model_path)
    ref = TorchRef(cfg, tensors)
    peer = TorchPeer(cfg, ref.w, torch.float32, len(tokens) + 8)
    want = ref.forward(tokens)                                   # [n, vocab]
    worst = float((peer.eval(tokens[:-3]) - want[-4]).abs().max())
    for j in range(3, 0, -1):
        worst = max(worst, float((peer.eval([tokens[-j]]) - want[-j]).abs().max()))
    return worst


@torch.inference_mode()
def run_tests(peer: TorchPeer, tokens: list[int], tests: list[str], eos: list[int]) -> dict:
    out = {}
    for test in tests:
        n = int(test[2:])
        peer.reset()
        if test.startswith("pp"):
            t0 = time.perf_counter()
            peer.eval(tokens[:n])
            out[test] = time.perf_counter() - t0
        else:
            logits = peer.eval(tokens[:1])
            t0 = time.perf_counter()
            for _ in range(n):
                logits[eos] = -math.inf
                logits = peer.eval([int(torch.argmax(logits))])
            out[test] = time.perf_counter() - t0
        peer.reset()
    return out


def worker(model_path: str, max_ctx: int) -> None:
    """Serve run commands on stdin until EOF; peers per dtype are built on first use."""
    cfg, dense = load(model_path, max_ctx)
    peers: dict[str, TorchPeer] = {}
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] != "run":
            raise ValueError(f"unknown command {cmd['cmd']}")
        dtype = cmd["dtype"]
        if dtype not in peers:
            peers[dtype] = TorchPeer(cfg, dense, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], max_ctx)
        torch.set_num_threads(int(cmd["threads"]))
        res = run_tests(peers[dtype], cmd["tokens"], cmd["tests"], cmd.get("eos", []))
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2304)
