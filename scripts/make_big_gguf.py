"""Write a Llama GGUF of random weights at real widths (for load-memory measurements; speed and
memory do not depend on the values). Usage: python scripts/make_big_gguf.py OUT.gguf [TYPE] [GB]"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tiny_gguf import write_gguf  # noqa: E402

out = sys.argv[1]
qtype = Q[sys.argv[2] if len(sys.argv) > 2 else "Q8_0"]
# hidden 2048, FFN 5632, 8 heads of 256 / 4 kv heads: ~59 M parameters a layer
per_layer = 2048 * 2048 * 2 + 2048 * 1024 * 2 + 3 * 2048 * 5632
gb = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
bpe = {Q.Q8_0: 34 / 32, Q.Q4_1: 20 / 32, Q.Q4_0: 18 / 32, Q.BF16: 2.0}[qtype]
layers = max(1, round(gb * 1e9 / (per_layer * bpe)))
write_gguf(out, matrix_type=qtype, fast=True, n_layer=layers, n_embd=2048, n_ff=5632, n_head=8,
           n_head_kv=4, head_dim=256)
print(out, layers, "layers", os.path.getsize(out) / 1e9, "GB")
