"""OpenAI legacy Completions (`POST /v1/completions`): raw text in, raw text out.

No chat template, no session ladder: the prompt goes to `Engine.generate`, which keeps the
longest common token prefix of whatever the cache holds (reported as cached tokens). It runs on
the worker like every other request, so it never races the chat session for the KV cache; the
session notices the cache changed (`Engine.state_id`) and re-plans its next request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from zen5.api import ApiContext, new_id, sampling, sse
from zen5.api.errors import ApiError, bad_request, openai_body
from zen5.api.fields import get_bool, get_int, get_num, get_obj, get_stop, get_str
from zen5.chat_types import ChatError

STYLE = "openai"
DEFAULT_MAX_TOKENS = 16   # the API's own default


@dataclass(frozen=True)
class Piece:
    """One streamed piece, with what the wire needs already decoded on the worker."""
    text: str
    logprob: dict | None = None        # {"token", "logprob", "top": {token: logprob}}
    finish_reason: str | None = None
    usage: object = None               # engine.GenerationUsage on the last piece


@dataclass
class Turn:
    id: str
    model: str
    stream: bool
    include_usage: bool
    prompt: str | list[int]
    echo: bool
    max_tokens: int
    stop: tuple[str, ...]
    logprobs: int
    sampling: dict
    created: int = field(default_factory=lambda: int(time.time()))

    def start(self, session):
        """Tokenize and check the length here, before the first piece, so an over-long prompt is a
        400 rather than an error in the middle of a stream."""
        eng = session.engine
        ids = eng.tokenizer.encode(self.prompt) if isinstance(self.prompt, str) else list(self.prompt)
        if not ids:
            raise ChatError(400, "prompt: the prompt is empty")
        if max(ids) >= eng.config.vocab_size:
            raise ChatError(400, f"prompt: token id {max(ids)} is outside the vocabulary "
                                 f"({eng.config.vocab_size} tokens)")
        if len(ids) >= eng.n_ctx:
            raise ChatError(400, f"prompt: {len(ids)} tokens do not fit the context of {eng.n_ctx} tokens "
                                 "with room to generate; shorten the prompt")
        chunks = eng.generate(ids, max_tokens=min(self.max_tokens, eng.n_ctx - len(ids)), stream=True,
                              stop=list(self.stop) or None, logprobs=self.logprobs, **self.sampling)
        return _pieces(chunks, eng.tokenizer)


def _pieces(chunks, tok):
    for c in chunks:
        lp = None
        if c.logprob is not None:
            lp = {"token": tok.decode([c.token_id]), "logprob": c.logprob.logprob,
                  "top": {tok.decode([i]): v for i, v in c.logprob.top}}
        yield Piece(c.text, lp, c.finish_reason, c.usage)


def parse(body: dict, api_ctx: ApiContext) -> Turn:
    model = get_str(body, "model", required=True)
    if get_int(body, "n", default=1, minimum=1) != 1 or get_int(body, "best_of", default=1, minimum=1) != 1:
        raise bad_request("n and best_of: only 1 is supported", param="n")
    if get_str(body, "suffix"):
        raise bad_request("suffix: insertion (fill-in-the-middle) is not supported", param="suffix")
    logprobs = get_int(body, "logprobs", default=0, minimum=0)
    if logprobs > 20:
        raise bad_request("logprobs: at most 20", param="logprobs")
    s = sampling(get_num(body, "temperature", low=0, high=2), get_num(body, "top_p", low=0, high=1),
                 None, get_int(body, "seed"))
    prompt = _prompt(body.get("prompt"))
    if isinstance(prompt, str):
        api_ctx.check_prompt_bytes(len(prompt.encode()), "prompt")
    return Turn(new_id("cmpl-"), model, get_bool(body, "stream"),
                get_bool(get_obj(body, "stream_options"), "include_usage", "stream_options"),
                prompt, get_bool(body, "echo"),
                api_ctx.max_tokens(get_int(body, "max_tokens", default=DEFAULT_MAX_TOKENS, minimum=1)),
                get_stop(body, "stop"), logprobs,
                {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                 "seed": s.seed})


def _prompt(p) -> str | list[int]:
    """A string, a list holding one string, or token ids (a list of ints, or a list holding one)."""
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p):
        return p
    raise bad_request("prompt: expected a string or an array of token ids (one prompt per request)",
                      param="prompt")


class CompletionReply:
    """A completion's pieces as they arrive (the chat adapters build a conversations.Reply)."""

    def __init__(self):
        self.pieces: list[Piece] = []
        self.finish: Piece | None = None

    def add(self, piece) -> None:
        self.pieces.append(piece)
        if piece.finish_reason is not None:
            self.finish = piece

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def summary(self) -> dict:
        return {"text": self.text}


new_reply = CompletionReply


def _logprobs(pieces: list[Piece], offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in pieces:
        if p.logprob is not None:
            out["tokens"].append(p.logprob["token"])
            out["token_logprobs"].append(p.logprob["logprob"])
            out["top_logprobs"].append(p.logprob["top"])
            out["text_offset"].append(offset)
        offset += len(p.text)
    return out


def usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.reused_tokens}}


def _echo(turn: Turn) -> str:
    return turn.prompt if turn.echo and isinstance(turn.prompt, str) else ""


def body(turn: Turn, reply: CompletionReply, api_ctx: ApiContext) -> dict:
    lead = _echo(turn)
    choice = {"text": lead + reply.text, "index": 0, "finish_reason": reply.finish.finish_reason,
              "logprobs": _logprobs(reply.pieces, len(lead)) if turn.logprobs else None}
    return {"id": turn.id, "object": "text_completion", "created": turn.created, "model": turn.model,
            "choices": [choice], "usage": usage(reply.finish.usage)}


def remember(turn: Turn, reply: CompletionReply, api_ctx: ApiContext) -> None:
    pass


class Stream:
    def __init__(self, turn: Turn, api_ctx: ApiContext):
        self.turn = turn
        self.offset = 0

    def _chunk(self, text: str, logprobs, finish: str | None) -> str:
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        return sse({"id": self.turn.id, "object": "text_completion", "created": self.turn.created,
                    "model": self.turn.model, "choices": [choice]})

    def start(self, planned=None) -> str:
        lead = _echo(self.turn)
        self.offset = len(lead)
        return self._chunk(lead, None, None) if lead else ""

    def keepalive(self) -> str:
        return ": keep-alive\n\n"

    def error(self, err: ApiError) -> str:
        return sse(openai_body(err))

    def event(self, piece: Piece) -> str:
        lp = _logprobs([piece], self.offset) if self.turn.logprobs else None
        self.offset += len(piece.text)
        out = self._chunk(piece.text, lp, piece.finish_reason) if piece.text or piece.finish_reason else ""
        if piece.finish_reason is not None:
            if self.turn.include_usage:
                out += sse({"id": self.turn.id, "object": "text_completion", "created": self.turn.created,
                            "model": self.turn.model, "choices": [], "usage": usage(piece.usage)})
            out += "data: [DONE]\n\n"
        return out
