"""Thinking fidelity: signatures and opt-in encryption for the reasoning we return.

Clients replay our thinking blocks on the next request. To render them back byte-exactly (and
keep the KV prefix valid) we must know the text is really what this model produced: each block
carries a signature, an HMAC-SHA256 over (model identity, exact text) keyed by a per-install
secret stored beside the cache. A missing, altered or foreign signature degrades only that
message to canonical rendering. In redaction mode the thinking is returned as an opaque blob,
AES-GCM authenticated encryption (from `cryptography`) of the text with the model identity as
associated data, and decrypted on replay. A block that proves nothing (forged, foreign, or
opaque bytes we never issued) is dropped from the prompt, and so from what the server stores
(`drop_unproven_thinking`).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from zen5.chat_types import Message, RedactedThinkingBlock, ThinkingBlock
from zen5.private_files import PRIVATE_FILE, make_private_dir

SECRET_FILE = "thinking.key"
_SIG_PREFIX = "z5s1."   # format marker: lets a future key rotation or scheme change be detected
_BLOB_PREFIX = "z5e1."


def load_or_create_secret(directory: str | os.PathLike) -> bytes:
    """32 random bytes kept in DIR/thinking.key (mode 0600, DIR 0700 when created here), created
    atomically on first use. Raises OSError when DIR cannot hold a new key (read-only, not a
    directory): the session then keeps one in memory."""
    d = make_private_dir(directory)
    path = d / SECRET_FILE
    try:
        data = path.read_bytes()
        if len(data) == 32:
            return data
    except FileNotFoundError:
        pass
    tmp = d / f".{SECRET_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    try:
        os.link(tmp, path)          # first writer wins; a concurrent one reads the winner's key
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    data = path.read_bytes()
    if len(data) != 32:
        raise ValueError(f"{path} is not a 32-byte key; delete it to create a new one")
    return data


class ThinkingSigner:
    def __init__(self, secret: bytes, model_id: str):
        if len(secret) != 32:
            raise ValueError("secret must be 32 bytes")
        self.model_id = model_id
        self._mac_key = hashlib.sha256(b"zen5 thinking mac\0" + secret).digest()
        self._aead = AESGCM(hashlib.sha256(b"zen5 thinking aead\0" + secret).digest())

    def _mac(self, text: str) -> bytes:
        msg = self.model_id.encode() + b"\0" + text.encode()
        return hmac.new(self._mac_key, msg, hashlib.sha256).digest()

    def sign(self, text: str) -> str:
        return _SIG_PREFIX + base64.urlsafe_b64encode(self._mac(text)).decode().rstrip("=")

    def verify(self, text: str, signature: str | None) -> bool:
        if not signature or not signature.startswith(_SIG_PREFIX):
            return False
        return hmac.compare_digest(self.sign(text), signature)

    def encrypt(self, text: str) -> str:
        nonce = os.urandom(12)
        ct = self._aead.encrypt(nonce, text.encode(), self.model_id.encode())
        return _BLOB_PREFIX + base64.urlsafe_b64encode(nonce + ct).decode()

    def decrypt(self, blob: str | None) -> str | None:
        """The original text, or None if the blob is not ours, altered, or for another model."""
        if not blob or not blob.startswith(_BLOB_PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(blob[len(_BLOB_PREFIX):].encode())
            return self._aead.decrypt(raw[:12], raw[12:], self.model_id.encode()).decode()
        except (ValueError, InvalidTag, UnicodeDecodeError):
            return None

    def proven_text(self, block: ThinkingBlock | RedactedThinkingBlock) -> str | None:
        """The thinking text a replayed block proves we produced (its signature verifies, or its
        blob decrypts), or None: the prompt is rendered without that block."""
        if isinstance(block, RedactedThinkingBlock):
            return self.decrypt(block.data)
        return block.text if self.verify(block.text, block.signature) else None


def drop_unproven_thinking(messages: tuple[Message, ...], signer: ThinkingSigner) -> tuple[Message, ...]:
    """The messages without the thinking blocks their prompt drops: what a conversation store
    keeps. A client may send up to a whole request body of opaque `encrypted_content` per request;
    the prompt never reads it, so holding it past its request would only grow the store. The
    rendering is unchanged: a message emptied this way renders as it did with the dropped block."""
    out = []
    for m in messages:
        kept = tuple(b for b in m.blocks if not isinstance(b, (ThinkingBlock, RedactedThinkingBlock))
                     or signer.proven_text(b) is not None)
        out.append(m if len(kept) == len(m.blocks) else Message(m.role, kept))
    return tuple(out)
