"""zen5: a CPU-native LLM inference engine for AVX-512 x86 CPUs.

    import zen5
    model = zen5.load("smollm2")
    print(model.generate("The capital of France is", max_tokens=16).text)
"""
from zen5._native import BadModel, BadSnapshot, ContextOverflow, ModelMismatch, ZenError
from zen5._native import isa as _isa

__version__ = "0.1.0"
ISA = _isa


def load(name_or_path: str = "smollm2", threads: int | None = None, n_ctx: int | None = None,
         matmul: str | None = None, kv_type: str | None = None, lookup: int | None = None,
         qat: bool | None = None, weight_cache: str | None = None):
    """Load a model by name (``smollm2``) or path (GGUF file or HF safetensors directory).
    ``kv_type="q8_0"`` halves the KV cache; ``lookup=0`` turns off prompt-lookup speculative
    decoding; ``qat=False`` turns off DeepSeek V4's QAT simulations; ``weight_cache="off"`` loads
    without the packed-weight cache (Engine documents the options)."""
    from zen5.engine import Engine

    return Engine.load(name_or_path, threads=threads, n_ctx=n_ctx, matmul=matmul, kv_type=kv_type,
                       lookup=lookup, qat=qat, weight_cache=weight_cache)


__all__ = ["load", "ISA", "ZenError", "ContextOverflow", "BadSnapshot", "ModelMismatch", "BadModel",
           "__version__"]
