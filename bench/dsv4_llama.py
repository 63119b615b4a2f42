"""A zen5 DeepSeek V4 checkpoint as a GGUF that the pinned llama.cpp runs (its `deepseek4` arch).

`to_gguf` runs the pinned converter (vendor/llama.cpp/convert_hf_to_gguf.py, class
DeepseekV4Model in conversion/deepseek.py) with its vendored gguf-py in a child process, on a
checkpoint in the official layout (tests/dsv4_checkpoint.py, tests/dsv4_formats.py). The converter
fixes the tensor types itself, whatever `outtype` says:

  routed experts   MXFP4, a lossless repack of the official I8 pairs + per-32 E8M0 `.scale`
  FP8 projections  dequantized and requantized to Q8_0 (wq_a/b, wkv, wo_a/b, indexer wq_b, shared experts)
  other BF16 mats  BF16 (embed, head, router gate, compressors, indexer weights_proj)
  F32 / 1-D        F32 (mHC, ape, sinks, router bias, norms); tid2eid as I32

so these match zen5's own formats (MXFP4 experts, FP8 as Q8_0). `outtype` (the converter's
--outtype) only reaches tensors the class does not force, none in these checkpoints.

Limits found:
- The checkpoint must be the packed variant (`quantization_config` set, experts with `.scale`):
  the converter only writes routed experts by repacking MXFP4 and raises
  KeyError 'Missing routed expert tensors ...' on plain BF16 experts (conversion/deepseek.py:730).
  Make one with tests/dsv4_formats.py `packed_twin`.
- Without tokenizer.json (the 512-token test vocabularies) the converter cannot build a vocab, so
  this module replaces DeepseekV4Model.set_vocab by a placeholder ("none" tokenizer with
  `vocab_size` dummy tokens: enough for llama-bench, which feeds random ids, not for text).
  With make_checkpoint(tokenizer=True) the converter writes the real DeepSeek V4 BPE vocab.
- MTP (mtp.*) tensors are skipped by the converter unless asked (zen5 test checkpoints have none).

Usage:  .venv/bin/python bench/dsv4_llama.py CHECKPOINT_DIR OUT.gguf [outtype]
then    llama-bench -m OUT.gguf -p 16 -n 4 -r 1 -t 2
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LLAMA_CPP = Path(os.environ.get(
    "ZEN5_LLAMA_CPP", Path.home() / ".cache/zen5/peers/llama_cpp_python-0.3.36/vendor/llama.cpp"))

# runs in the child: the vendored gguf-py must win over any installed `gguf`
_BOOT = r"""
import sys
llama, ckpt, out, outtype, placeholder = sys.argv[1:6]
sys.path[:0] = [llama, llama + "/gguf-py"]
if placeholder == "1":
    from conversion.deepseek import DeepseekV4Model

    def set_vocab(self):
        self.gguf_writer.add_tokenizer_model("none")
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    DeepseekV4Model.set_vocab = set_vocab
import convert_hf_to_gguf as conv
sys.argv = [conv.__file__, ckpt, "--outfile", out, "--outtype", outtype]
conv.main()
"""


def to_gguf(checkpoint_dir: Path, out: Path, outtype: str = "auto") -> Path:
    """Convert the packed DeepSeek V4 checkpoint at checkpoint_dir to the GGUF file out."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    cfg = json.loads((checkpoint_dir / "config.json").read_text())
    if cfg.get("architectures") != ["DeepseekV4ForCausalLM"]:
        raise ValueError(f"{checkpoint_dir}: not a DeepseekV4ForCausalLM checkpoint")
    if "quantization_config" not in cfg:
        raise ValueError(f"{checkpoint_dir}: plain checkpoint; llama.cpp's converter needs MXFP4-packed "
                         "experts (tests/dsv4_formats.py packed_twin writes them)")
    placeholder = not (checkpoint_dir / "tokenizer.json").is_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", _BOOT, str(LLAMA_CPP), str(checkpoint_dir), str(out), outtype,
                    "1" if placeholder else "0"], check=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__.split("Usage:")[1])
    print(to_gguf(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]))
