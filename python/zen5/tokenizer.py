"""Tokenizer: one wrapper over Hugging Face `tokenizers` for GGUF vocabularies and tokenizer.json.

GGUF files carry a byte-level BPE as plain arrays (tokens, merges, token types) plus the name of
llama.cpp's pre-tokenizer; we rebuild the equivalent HF pipeline from those so both formats share
one fast Rust implementation. `encode` recognises special tokens (chat templates write them as
text) and never adds an automatic BOS: the chat template decides. `encode_segments` is the
control-string policy: only the template's own markers become special tokens, all message text
is tokenized as plain text, so a user typing `<|im_start|>` cannot forge a turn boundary.
`StreamDecoder` turns a stream of ids into text without ever emitting half a UTF-8 character.
"""
from __future__ import annotations

import functools
import json
import logging
import os

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from zen5.config import UnsupportedModelError

__all__ = ["Tokenizer", "StreamDecoder"]

log = logging.getLogger("zen5.tokenizer")

# Tokens that end an assistant turn in the chat formats zen5 knows.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
               "<｜end▁of▁sentence｜>")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), as used by the HF tokenizer.json files.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_byte_table() -> dict[str, int]:
    """Byte-level BPE's alphabet: the printable character that stands for each byte (GPT-2's
    bytes_to_unicode), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _gpt2_byte_table()


def byte_chars() -> list[str]:
    """The 256 single-byte tokens of a byte-level BPE, in byte order (GPT-2's bytes_to_unicode);
    the tests' and the benchmarks' synthetic vocabularies start with them."""
    return [c for c, _ in sorted(_BYTE_OF.items(), key=lambda kv: kv[1])]


def _byte_level(use_regex=True):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        _byte_level(use_regex=False)])


def _pre_tokenizer(pre: str | None):
    """The HF pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre` name."""
    if pre in (None, "default", "gpt2", "gpt-2"):
        return _byte_level()
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        _byte_level()])
    if pre == "qwen2":
        return _split_then_bytes(QWEN2_REGEX)
    if pre == "llama-bpe":
        return _split_then_bytes(LLAMA3_REGEX)
    log.warning("unknown GGUF pre-tokenizer %r; using plain byte-level splitting, "
                "tokenization may differ from the model's training", pre)
    return _byte_level()


class Tokenizer:
    """Encode/decode text; `eos_ids` are every id that ends generation."""

    def __init__(self, hf: HFTokenizer, bos_id: int | None = None, eos_id: int | None = None,
                 vocab_size: int | None = None):
        self._hf = hf
        self._bos = bos_id
        self._vocab_size = max(vocab_size or 0, hf.get_vocab_size(with_added_tokens=True))
        self._added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
        eos = {eos_id} if eos_id is not None else set()
        eos |= {self._added[t] for t in END_OF_TURN if t in self._added}
        self._eos = frozenset(eos)
        self._plain_hf: HFTokenizer | None = None  # added-token matching off; built on demand

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, fields: dict) -> "Tokenizer":
        """Rebuild the byte-level BPE stored in a GGUF file's tokenizer.* metadata (arrays as
        lists: zen5.loader.gguf.tokenizer_fields)."""
        model = fields.get("tokenizer.ggml.model", "gpt2")
        if model != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (zen5 reads byte-level BPE, "
                "'gpt2'; SentencePiece 'llama' vocabularies are not supported)")
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("missing tokenizer.ggml.tokens")
        types = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
        hf = HFTokenizer(models.BPE(
            vocab=_vocab(tokens), merges=_merges(fields.get("tokenizer.ggml.merges", [])),
            ignore_merges=fields.get("tokenizer.ggml.pre") == "llama-bpe"))
        hf.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"))
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, k in zip(tokens, types) if k == _TOKEN_CONTROL])
        hf.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED])
        return cls(hf, fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id"),
                   len(tokens))

    @classmethod
    def from_files(cls, tokenizer_json, tokenizer_config_json=None,
                   config_json=None) -> "Tokenizer":
        """A Hugging Face tokenizer.json; BOS/EOS from tokenizer_config.json, else config.json."""
        hf = HFTokenizer.from_file(os.fspath(tokenizer_json))
        folder = os.path.dirname(os.fspath(tokenizer_json))
        if tokenizer_config_json is None:
            tokenizer_config_json = _sibling(folder, "tokenizer_config.json")
        if config_json is None:
            config_json = _sibling(folder, "config.json")
        tcfg, mcfg = _read_json(tokenizer_config_json), _read_json(config_json)
        return cls(hf, _special_id(hf, tcfg.get("bos_token"), mcfg.get("bos_token_id")),
                   _special_id(hf, tcfg.get("eos_token"), mcfg.get("eos_token_id")))

    # --- use ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return _encode(self._hf, text)

    def encode_segments(self, segments) -> list[int]:
        """Encode prompt segments (objects with `.text` and `.control`, e.g. dialects.base.Segment).

        Control segments are encoded like `encode` (special tokens recognised); all other text
        with no added token matched at all, so user or tool text containing a control string
        becomes ordinary text tokens. Adjacent segments of one kind are encoded together, so a
        prompt without look-alikes encodes exactly as `encode("".join(texts))`.
        """
        ids: list[int] = []
        for control, text in _runs(segments):
            ids += self.encode(text) if control else self._encode_plain(text)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain_hf is None:
            self._plain_hf = _without_added_token_matching(self._hf)
        return _encode(self._plain_hf, text)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level token may hold part of a UTF-8 character
        (decode() shows it as U+FFFD); an added token, or a vocabulary that is not byte-level,
        gives its decoded text."""
        piece = self._hf.id_to_token(token_id)
        if piece is not None and piece not in self._added and isinstance(self._hf.decoder, decoders.ByteLevel):
            try:
                return bytes(_BYTE_OF[c] for c in piece)
            except KeyError:
                pass
        return self.decode([token_id]).encode()

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for. A text of B UTF-8 bytes is at least
        ceil(B / max_token_bytes) tokens (no normalizer shrinks text in the byte-level
        vocabularies zen5 reads): the server refuses an over-long prompt by this bound before
        spending time on tokenizing it."""
        return max(1, max(len(self.token_bytes(i)) for i in range(self.vocab_size)))

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every added token (content -> id); each is matched as one token wherever it appears."""
        return dict(self._added)

    @property
    def hf(self) -> HFTokenizer:
        return self._hf


def _encode(hf: HFTokenizer, text: str) -> list[int]:
    """`encode_batch` releases the GIL while the Rust side works (`encode` holds it: seconds for
    a long prompt, during which a server's event loop could not answer anyone)."""
    return hf.encode_batch([text], add_special_tokens=False)[0].ids


def _runs(segments) -> list[tuple[bool, str]]:
    """(control, text) runs: adjacent segments of one kind joined, empty ones dropped."""
    runs: list[tuple[bool, str]] = []
    for seg in segments:
        if not seg.text:
            continue
        if runs and runs[-1][0] == bool(seg.control):
            runs[-1] = (runs[-1][0], runs[-1][1] + seg.text)
        else:
            runs.append((bool(seg.control), seg.text))
    return runs


def _without_added_token_matching(hf: HFTokenizer) -> HFTokenizer:
    """A copy of `hf` that matches no added token in text. HF's `encode_special_tokens` only
    turns off tokens flagged special, and DeepSeek's markers (`<｜User｜>`, `｜DSML｜`) are not,
    so the copy flags every added token special first."""
    spec = json.loads(hf.to_str())
    for tok in spec.get("added_tokens", []):
        tok["special"] = True
    clone = HFTokenizer.from_str(json.dumps(spec))
    clone.encode_special_tokens = True
    return clone


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != len(tokens):
        log.warning("GGUF vocabulary has %d duplicate tokens", len(tokens) - len(vocab))
    return vocab


def _merges(merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"bad merge {m!r}")
        out.append((a, b))
    return out


def _sibling(folder, name):
    p = os.path.join(folder, name)
    return p if os.path.exists(p) else None


def _read_json(path) -> dict:
    if path is None:
        return {}
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    return d if isinstance(d, dict) else {}


def _special_id(hf: HFTokenizer, token, fallback_id) -> int | None:
    """An id from a tokenizer_config token (str or AddedToken dict), else config.json's id(s)."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and hf.token_to_id(token) is not None:
        return hf.token_to_id(token)
    if isinstance(fallback_id, list):
        fallback_id = fallback_id[0] if fallback_id else None
    return fallback_id if isinstance(fallback_id, int) else None


class StreamDecoder:
    """Incremental detokenization: the text of pushed ids, never half a UTF-8 character.

    Decodes a small window (the previously emitted token(s) plus the new ones) and emits the
    growth once it doesn't end in U+FFFD, the mark of an incomplete byte sequence. The window's
    leading context keeps decoders that strip or merge at token boundaries exact, so that
    ''.join(pushes) + flush() == tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok, self._skip = tokenizer, skip_special
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        dec = lambda ids: self._tok.decode(ids, self._skip)  # noqa: E731
        before = dec(self._ids[self._prefix:self._read])
        now = dec(self._ids[self._prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]
