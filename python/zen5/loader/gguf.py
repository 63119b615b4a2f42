"""GGUF loader: metadata -> ModelConfig, tensors -> memory-mapped GGML blocks, plus the tokenizer.

We walk the whole header ourselves with bounds checks (`read_header`): `gguf.GGUFReader` trusts
the file (a corrupted array length makes it loop for hours; it never checks that tensor data lies
inside the file), and it is slow: it builds a numpy view per metadata item, about 10 s for a
128k-token vocabulary. The header walk records where each array starts, so the tokenizer's
arrays are read straight from the mapped file (`read_array`), and the tensors are slices of one
`np.memmap`. Anything that goes wrong is a `BadModelFile` with the path and the reason.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from zen5.config import SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError
from zen5.loader.tensors import BadModelFile, LoadedWeights, Tensor, prepare_tensors, validate_tensors

__all__ = ["BadModelFile", "load_gguf", "read_header", "read_array", "read_tokenizer", "config_from_metadata",
           "GGUFHeader"]

_STRING, _ARRAY = 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_MAX_DIMS, _MAX_ARRAY_NESTING, _MAX_LAYERS = 4, 2, 4096

@dataclass(frozen=True)
class ArrayInfo:
    """An array value in the header: its item type, length and where its items start (read them
    with `read_array`)."""
    item_type: int
    count: int
    offset: int = 0


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # numpy order
    offset: int              # absolute, in the file
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    metadata: dict           # key -> scalar, str or ArrayInfo
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            raise BadModelFile(self.path, f"file ends inside {what} at offset {self.pos} "
                                          f"(needs {n} bytes, file has {self.size})")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, decode=True):
        n = self.unpack("<Q", what)
        self.need(n, what)
        self.pos += n
        if not decode:
            return None
        raw = self.buf[self.pos - n:self.pos]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadModelFile(self.path, f"{what} at offset {self.pos - n} is not UTF-8") from None


def read_header(path) -> GGUFHeader:
    """Parse and bounds-check the whole GGUF header; never trusts a length it hasn't checked."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 24:
        raise BadModelFile(path, f"file too small for a GGUF header ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse_header(_Cursor(buf, path))


def _parse_header(cur: _Cursor) -> GGUFHeader:
    if cur.buf[:4] != b"GGUF":
        raise BadModelFile(cur.path, "not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version & 0xFFFF == 0 and version:
        raise UnsupportedModelError(f"{cur.path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise BadModelFile(cur.path, f"unsupported GGUF version {version} (zen5 reads 2 and 3)")
    n_tensors, n_kv = cur.unpack("<Q", "tensor count"), cur.unpack("<Q", "metadata count")
    metadata = _parse_metadata(cur, n_kv)
    alignment = _alignment(cur.path, metadata)
    infos = _parse_tensor_infos(cur, n_tensors)
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, ggml_type, shape, rel, nbytes in infos:
        if rel % alignment:
            raise BadModelFile(cur.path, f"tensor {name} offset {rel} is not {alignment}-aligned")
        start = data_offset + rel
        if start + nbytes > cur.size:
            raise BadModelFile(cur.path, f"tensor {name} data [{start}, {start + nbytes}) lies "
                                         f"beyond the end of the file ({cur.size} bytes); "
                                         f"truncated download?")
        tensors[name] = TensorInfo(name, ggml_type, shape, start, nbytes)
    return GGUFHeader(version, metadata, tensors, data_offset, cur.size)


def _parse_metadata(cur: _Cursor, count: int) -> dict:
    out: dict = {}
    for i in range(count):
        if cur.pos >= cur.size:
            raise BadModelFile(cur.path, f"file ends after {i} of {count} metadata entries")
        key = cur.string("metadata key")
        vtype = cur.unpack("<I", f"type of {key}")
        if key in out:
            raise BadModelFile(cur.path, f"duplicate metadata key {key!r}")
        out[key] = _parse_value(cur, vtype, key, 0)
    return out


def _parse_value(cur: _Cursor, vtype: int, key: str, depth: int):
    if vtype in _SCALAR:
        return cur.unpack(_SCALAR[vtype], f"value of {key}")
    if vtype == _STRING:
        return cur.string(f"value of {key}", decode=depth == 0)
    if vtype != _ARRAY or depth >= _MAX_ARRAY_NESTING:
        raise BadModelFile(cur.path, f"metadata {key!r} has invalid value type {vtype}")
    item_type = cur.unpack("<I", f"array type of {key}")
    count = cur.unpack("<Q", f"length of {key}")
    start = cur.pos
    if item_type in _SCALAR:
        cur.need(count * struct.calcsize(_SCALAR[item_type]), f"array {key}")
        cur.pos += count * struct.calcsize(_SCALAR[item_type])
    elif item_type == _STRING:  # a vocabulary: 50-150k items, walked without a call per item
        cur.need(count * 8, f"array {key}")  # every item is at least a u64 length
        unpack, buf, pos, size = struct.Struct("<Q").unpack_from, cur.buf, cur.pos, cur.size
        for _ in range(count):
            if pos + 8 > size or pos + 8 + unpack(buf, pos)[0] > size:
                cur.pos = pos
                cur.string(f"value of {key}", decode=False)  # raises with the item's offset
            pos += 8 + unpack(buf, pos)[0]
        cur.pos = pos
    elif item_type == _ARRAY:
        cur.need(count * 8, f"array {key}")  # every item is at least a u64 length
        for _ in range(count):
            _parse_value(cur, item_type, key, depth + 1)
    else:
        raise BadModelFile(cur.path, f"metadata {key!r} has invalid array item type {item_type}")
    return ArrayInfo(item_type, count, start)


def read_array(buf, info: ArrayInfo, path=None) -> list:
    """The items of a flat array of scalars or strings found by `read_header` (whose walk already
    checked that every length lies inside the file)."""
    if info.item_type in _SCALAR:
        dtype = np.dtype(_SCALAR[info.item_type])
        return np.frombuffer(buf, dtype, info.count, info.offset).tolist()
    if info.item_type != _STRING:
        raise BadModelFile(path, f"array of item type {info.item_type} where scalars or strings were expected")
    # through a memoryview: slicing an np.memmap builds an array object per item (a 49k-token
    # vocabulary took 0.25 s)
    out, pos, unpack, view = [], info.offset, struct.Struct("<Q").unpack_from, memoryview(buf)
    for _ in range(info.count):
        (n,) = unpack(view, pos)
        raw = view[pos + 8:pos + 8 + n].tobytes()
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadModelFile(path, f"string at offset {pos + 8} is not UTF-8") from None
        pos += 8 + n
    return out


def _alignment(path, metadata) -> int:
    a = metadata.get("general.alignment", 32)
    if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1):
        raise BadModelFile(path, f"general.alignment {a!r} is not a positive power of two")
    return a


def _parse_tensor_infos(cur: _Cursor, count: int) -> list:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    cur.need(count * 24, "tensor infos")  # name length + n_dims + type + offset, at least
    infos, seen = [], set()
    for _ in range(count):
        name = cur.string("tensor name")
        n_dims = cur.unpack("<I", f"dimension count of {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise BadModelFile(cur.path, f"tensor {name} has {n_dims} dimensions")
        dims = [cur.unpack("<Q", f"dimensions of {name}") for _ in range(n_dims)]
        raw_type, rel = cur.unpack("<I", f"type of {name}"), cur.unpack("<Q", f"offset of {name}")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise BadModelFile(cur.path, f"tensor {name} has unknown type id {raw_type}") from None
        if name in seen:
            raise BadModelFile(cur.path, f"duplicate tensor {name}")
        seen.add(name)
        n = _element_count(cur.path, name, dims)
        if dims[0] % block:
            raise BadModelFile(cur.path, f"tensor {name}: {dims[0]} columns is not a multiple "
                                         f"of its block size {block}")
        infos.append((name, raw_type, tuple(reversed(dims)), rel, n // block * type_size))
    return infos


def _element_count(path, name, dims) -> int:
    n = 1
    for d in dims:
        if d == 0 or d > 1 << 40:
            raise BadModelFile(path, f"tensor {name} has dimension {d}")
        n *= d
    if n > 1 << 44:
        raise BadModelFile(path, f"tensor {name} claims {n} elements")
    return n


def _meta(path, md: dict, key: str, kind, default=None):
    """A typed metadata value; missing -> default (or BadModelFile when there is none)."""
    if key not in md:
        if default is None:
            raise BadModelFile(path, f"missing metadata key {key}")
        return default
    v = md[key]
    ok = (isinstance(v, str) if kind is str else
          isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
          isinstance(v, int) and not isinstance(v, bool))
    if not ok or (kind is float and not math.isfinite(v)):
        raise BadModelFile(path, f"metadata {key} = {v!r} is not a {kind.__name__}")
    return kind(v)


def config_from_metadata(md: dict, tensor_shapes: dict, path=None) -> ModelConfig:
    """Map llama/qwen2/qwen3 GGUF metadata (+ tensor shapes) to a ModelConfig."""
    arch = _meta(path, md, "general.architecture", str)
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"{path}: architecture {arch!r} is not supported; zen5 runs "
                                    f"{', '.join(SUPPORTED_ARCHS)}")
    if _meta(path, md, f"{arch}.expert_count", int, 0):
        raise UnsupportedModelError(f"{path}: mixture-of-experts models are not supported")
    if "rope_freqs.weight" in tensor_shapes:
        raise UnsupportedModelError(
            f"{path}: this GGUF bakes llama3-style RoPE scaling into a rope_freqs.weight tensor, "
            "which zen5 does not support yet (load the Hugging Face safetensors instead)")
    dims = _dims(path, md, arch, tensor_shapes)
    if "token_embd.weight" not in tensor_shapes or len(tensor_shapes["token_embd.weight"]) != 2:
        raise BadModelFile(path, "missing or malformed tensor token_embd.weight")
    fields = dict(
        arch=arch, **dims, vocab_size=tensor_shapes["token_embd.weight"][0],
        n_ctx_train=_meta(path, md, f"{arch}.context_length", int),
        rms_eps=_meta(path, md, f"{arch}.attention.layer_norm_rms_epsilon", float),
        rope_theta=_meta(path, md, f"{arch}.rope.freq_base", float, 10000.0),
        rope_neox=arch != "llama", qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        tied_output="output.weight" not in tensor_shapes,
        rope_scaling=_rope_scaling(path, md, arch))
    try:
        return ModelConfig(**fields)
    except UnsupportedModelError as e:  # ModelConfig's own checks don't know the file
        raise UnsupportedModelError(f"{path}: {e}") from None


def _dims(path, md, arch, tensor_shapes) -> dict:
    n_layer = _meta(path, md, f"{arch}.block_count", int)
    if not 0 < n_layer <= min(_MAX_LAYERS, len(tensor_shapes)):
        raise BadModelFile(path, f"{arch}.block_count {n_layer} is impossible for a file with "
                                 f"{len(tensor_shapes)} tensors")
    n_embd = _meta(path, md, f"{arch}.embedding_length", int)
    n_head = _meta(path, md, f"{arch}.attention.head_count", int)
    if n_head <= 0 or n_embd <= 0:
        raise BadModelFile(path, f"bad head_count {n_head} / embedding_length {n_embd}")
    head_dim = _meta(path, md, f"{arch}.attention.key_length", int, n_embd // n_head)
    rot = _meta(path, md, f"{arch}.rope.dimension_count", int, head_dim)
    if rot != head_dim:
        raise UnsupportedModelError(f"{path}: partial rotary embeddings ({rot} of {head_dim} "
                                    "dimensions) are not supported")
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, head_dim=head_dim,
                n_ff=_meta(path, md, f"{arch}.feed_forward_length", int),
                n_head_kv=_meta(path, md, f"{arch}.attention.head_count_kv", int, n_head))


def _rope_scaling(path, md, arch) -> dict | None:
    kind = _meta(path, md, f"{arch}.rope.scaling.type", str, "none")
    if kind == "linear":
        factor = _meta(path, md, f"{arch}.rope.scaling.factor", float)
    elif kind == "none":
        factor = _meta(path, md, f"{arch}.rope.scale_linear", float, 1.0)  # older files
    else:
        raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported")
    if factor <= 0:
        raise BadModelFile(path, f"RoPE scaling factor {factor} must be positive")
    return None if factor == 1.0 else {"type": "linear", "factor": factor}


def load_gguf(path) -> LoadedWeights:
    path = os.fspath(path)
    header = read_header(path)
    shapes = {n: t.shape for n, t in header.tensors.items()}
    config = config_from_metadata(header.metadata, shapes, path)
    validate_tensors(config, {n: (t.ggml_type, t.shape, t.nbytes)
                              for n, t in header.tensors.items()}, path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors, ignored = prepare_tensors(config, {n: Tensor(n, t.ggml_type, t.shape, data[t.offset:t.offset + t.nbytes])
                                                for n, t in header.tensors.items()}, path)
    tokenizer = _tokenizer(data, header, path)
    _release(data)  # norms copied to F32, tokenizer built: none of the file needs to stay resident
    if tokenizer.vocab_size > config.vocab_size:
        raise BadModelFile(path, f"tokenizer has {tokenizer.vocab_size} tokens but the embedding "
                                 f"only {config.vocab_size} rows")
    template = header.metadata.get("tokenizer.chat_template")
    name = header.metadata.get("general.name")
    return LoadedWeights(
        config=config, tensors=tensors, tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        metadata={"format": "gguf", "path": path,
                  "name": name if isinstance(name, str) else os.path.basename(path),
                  "ignored_tensors": ignored})


def _release(data: np.memmap) -> None:
    """Drop the mapping's pages from this process (a read-only shared file mapping: a later read
    faults them back in from the page cache). Reading the norms and the vocabulary mapped their
    neighbours too (the kernel maps 64 KiB around a fault), megabytes of matrices before the
    native load (which releases what it packs itself: model.cpp, FileMaps)."""
    mm = getattr(data, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def tokenizer_fields(buf, header: GGUFHeader, path=None) -> dict:
    """The tokenizer.* metadata with its arrays read (what Tokenizer.from_gguf takes)."""
    return {k: read_array(buf, v, path) if isinstance(v, ArrayInfo) else v
            for k, v in header.metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}


def read_tokenizer(path):
    """The tokenizer of a GGUF file, on its own (tests, tools)."""
    path = os.fspath(path)
    return _tokenizer(np.memmap(path, dtype=np.uint8, mode="r"), read_header(path), path)


def _tokenizer(buf, header: GGUFHeader, path):
    from zen5.tokenizer import Tokenizer
    try:
        return Tokenizer.from_gguf(tokenizer_fields(buf, header, path))
    except UnsupportedModelError:
        raise
    except Exception as e:  # the tokenizers library raises bare Exception on bad vocabularies
        raise BadModelFile(path, f"bad tokenizer metadata: {e}") from e
