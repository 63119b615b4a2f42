"""ChatSession: one live model state, the cache ladder, exact replay and thinking fidelity.

An agent's tool loop must never re-prefill what the model already holds. For each request the
session decides what it can keep, cheapest first, and reports the rung (`cache_source`):

1. live     the previous turn ended in tool calls we issued, the request's trailing tool
            results answer exactly that ID set, and the cache is still where that turn left
            it: append only the suffix (end of turn, the results, the next assistant prefix).
            The client's copy of the history is not re-rendered at all.
2. token_prefix / text_prefix
            render the whole request; keep the longest part of the cache it agrees with: all
            live tokens when the live text is a byte prefix of the prompt (then only the rest of
            the text is tokenized: BPE merges across a string boundary, so tokens cut out of a
            full-prompt tokenization are never reused), else the common token prefix.
3. disk     the longest disk checkpoint (checkpoints.py) whose text is a byte prefix of the
            prompt, when it holds more than the live rungs keep: restore its exact tokens and
            KV rows, tokenize and prefill only the remaining text.
4. cold     prefill everything.

Checkpoints are written (when a CheckpointStore is given) at a fresh prompt's trimmed, aligned
boundary, at aligned frontiers during long prefill or generation (not inside a tool call),
before a request discards a long live state, and at `close()`. The live state is never rolled
back to write one: a boundary inside the prompt is saved by prefilling in two parts.

Replayed history is rendered exactly when we can prove it is what the model produced: tool
calls through tool memory (ID -> sampled block), thinking through signatures or our encrypted
blobs. Anything unproven degrades that one message to canonical rendering, with a diagnostic;
the request still succeeds.

A request that demands structure (tool_choice "required" / named / "none", a JSON response
format, custom tools with a grammar, a thinking budget) is decoded under a per-request token
mask built from the dialect's own output syntax (constraints.py); malformed demands are 400s.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from zen5 import _native
from zen5.chat_types import (
    ChatError,
    ChatEvent,
    ChatRequest,
    Finish,
    Message,
    Planned,
    RedactedThinkingBlock,
    SampledToken,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDone,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from zen5.checkpoints import CheckpointStore, Entry
from zen5.constraints import ConstraintError, TokenConstraint, demand_of
from zen5.dialects import base as d
from zen5.dialects import detect_dialect, get_dialect
from zen5.engine import Engine
from zen5.lookup import DraftFeed
from zen5.sampling import Sampler, token_logprob
from zen5.signatures import ThinkingSigner, load_or_create_secret
from zen5.stop_strings import first_stop, partial_stop_len
from zen5.tokenizer import StreamDecoder
from zen5.tool_memory import ToolMemory, ToolRecord, new_tool_id

# Stands in for the live assistant turn when rendering the continuation suffix: everything the
# dialect writes after it (end of turn, tool results, next assistant prefix) is the suffix.
_SENTINEL = "\x00zen5-live-frontier\x00"

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """What the cache holds after our last turn, and how it ended."""
    text: str                      # decoded text of exactly the cached tokens
    state_id: int                  # Engine.state_id when this was recorded
    pending: tuple[str, ...] = ()  # IDs of the tool calls the turn ended with (complete ones)
    thinking_mode: str = "chat"


@dataclass
class _Plan:
    source: str
    keep: int                      # cached tokens to keep
    new_tokens: list[int]          # tokens to prefill after them
    text: str                      # the full prompt text once prefilled
    state_id: int = -1             # Engine.state_id the plan was made against
    live_keep: int = 0             # live tokens this plan keeps (the rest is discarded)
    checkpoint: Entry | None = None           # disk rung: the checkpoint to restore
    segments: list[d.Segment] | None = None   # disk rung: the prompt, to re-plan if it fails


def _usage(plan: _Plan, completion_tokens: int, **more) -> Usage:
    return Usage(prompt_tokens=plan.keep + len(plan.new_tokens), completion_tokens=completion_tokens,
                 reused_tokens=plan.keep, prefilled_tokens=len(plan.new_tokens), cache_source=plan.source,
                 **more)


def prompt_response_format(request: ChatRequest) -> dict | None:
    """The response format as a prompt states it (OpenAI Chat form, which DeepSeek V4 renders in
    its system message; ChatML has no place for it): None for free text."""
    fmt = request.response_format
    if fmt is None or fmt.get("type") not in ("json_object", "json_schema"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {k: fmt[k] for k in ("name", "strict", "schema") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _thinking_secret(state: Path) -> bytes | None:
    """The per-install thinking key from the state directory, or None where the directory cannot
    hold one (read-only, not a directory). That is no reason to refuse to serve: the session then
    keeps a key in memory and runs without disk state, said in one line."""
    try:
        return load_or_create_secret(state)
    except OSError as e:
        log.warning("state directory %s cannot hold the thinking key (%s): running with a key held "
                    "in memory (thinking signatures and encrypted reasoning will not verify after a "
                    "restart) and without disk checkpoints", state, e.strerror or e)
        return None


class ChatSession:
    def __init__(self, engine: Engine, dialect: str | None = None, *,
                 state_dir: str | Path | None = None, tool_memory: ToolMemory | None = None,
                 syntax_greedy: bool = True, checkpoints: CheckpointStore | None = None):
        self.engine = engine
        tok = engine.tokenizer
        self.dialect = get_dialect(detect_dialect(tok, engine.chat_template, override=dialect))
        self.memory = tool_memory or ToolMemory()
        state = Path(state_dir) if state_dir else Path.home() / ".cache" / "zen5"
        model_id = f"{engine.native.fingerprint:016x}"
        secret = _thinking_secret(state)
        self.keeps_state = secret is not None      # False: no disk state at all (no checkpoints)
        self.signer = ThinkingSigner(secret or os.urandom(32), model_id)
        self.syntax_greedy = syntax_greedy
        self._live: _Live | None = None
        self.checkpoints: CheckpointStore | None = None   # None: no disk cache
        if checkpoints is not None:
            self.use_checkpoints(checkpoints)

    def use_checkpoints(self, store: CheckpointStore | None) -> None:
        """Serve from and save to this disk cache (bound to the model here); ignored without
        disk state (see `_thinking_secret`)."""
        if store is not None and self.keeps_state:
            store.attach(self.engine.native.fingerprint)
            self.checkpoints = store

    # ---- public -----------------------------------------------------------------------------
    def chat(self, request: ChatRequest) -> Planned:
        """Serve one request: validate and plan (errors raise ChatError before any event), then
        stream events; the last one is Finish. The result also carries the planned usage."""
        thinking_mode = self._thinking_mode(request)
        constraint = self._constraint(request, thinking_mode)
        self._load_disk_tools(request)
        messages, diagnostics = self._dialect_messages(request, thinking_mode)
        plan = self._plan(request, messages, thinking_mode)
        return Planned(self._run(request, plan, thinking_mode, diagnostics, constraint), _usage(plan, 0))

    def count_prompt_tokens(self, request: ChatRequest) -> int:
        """The tokens of the prompt `chat` would render for this request (what a cold prefill
        reads), through the same path: adjacent assistant messages merged into one turn, replay
        from tool memory and verified thinking. A count is not a turn, so the protocol's tool-ID
        rules (400/409) are not applied, and nothing runs on the engine."""
        thinking_mode = self._thinking_mode(request)
        self._load_disk_tools(request)
        messages, _ = self._dialect_messages(request, thinking_mode, check_ids=False)
        segments = self._render_segments(request, messages, thinking_mode)
        return len(self.engine.tokenizer.encode_segments(segments))

    @property
    def live_tool_ids(self) -> tuple[str, ...]:
        return self._live.pending if self._live_valid() else ()

    def close(self) -> str:
        """Clean shutdown (a server calls this): save the live state to disk ("shutdown") so a
        restarted process resumes it. The session stays usable. Returns what it did, in words
        (for the server's log)."""
        if not self._live_valid():
            return "no live state to save (the last request stopped during its prefill, or none ran)"
        return self._save("shutdown", self._live.text, exact=True)

    def _constraint(self, request: ChatRequest, thinking_mode: str) -> TokenConstraint | None:
        """The token mask a request needs (forced or forbidden calls, JSON answers, custom tool
        grammars, a thinking budget: constraints.py), or None."""
        tok = self.engine.tokenizer
        try:
            if thinking_mode != "thinking":
                request = replace(request, thinking_budget=None)  # no open reasoning to cap
            demand = demand_of(request)
            if demand is None:
                return None
            grammar = self.dialect.grammar(demand, tok.token_to_id, thinking_mode=thinking_mode)
            return TokenConstraint(tok, grammar)
        except ConstraintError as e:
            raise ChatError(400, str(e)) from None
        except (TypeError, ValueError) as e:  # a schema of an unexpected shape (e.g. required: 5)
            raise ChatError(400, f"cannot constrain this request: {e}") from None

    def _load_disk_tools(self, request: ChatRequest) -> None:
        """Tool-ID maps stored in checkpoint files, for the IDs this request mentions and tool
        memory lacks (after a restart): exact replay, and the 409 rule, survive the restart."""
        if self.checkpoints is None:
            return
        ids = {b.id if isinstance(b, ToolUseBlock) else b.tool_use_id
               for m in request.messages for b in m.blocks if isinstance(b, (ToolUseBlock, ToolResultBlock))}
        missing = [i for i in ids if i not in self.memory]
        for rec in self.checkpoints.tool_records(missing) if missing else ():
            self.memory.remember(rec)

    # ---- request -> dialect messages --------------------------------------------------------
    def _thinking_mode(self, request: ChatRequest) -> str:
        return self.dialect.thinking_mode(request.thinking)

    def _dialect_messages(self, request: ChatRequest, thinking_mode: str,
                          check_ids: bool = True) -> tuple[list[dict], list[str]]:
        """Neutral messages -> the dialect's OpenAI-style dicts, with exact replay where proven.
        Also enforces the protocol ID rules (400 unknown, 409 live state gone) unless told not
        to."""
        diags: list[str] = []
        merged = _merge_assistant_runs(request.messages)
        replayed = {b.id for m in merged if m.role == "assistant" for b in m.blocks if isinstance(b, ToolUseBlock)}
        live_ids = set(self.live_tool_ids)
        out: list[dict] = []
        for m in merged:
            if m.role == "assistant":
                out.append(self._assistant(m, thinking_mode, diags))
                continue
            for b in m.blocks:
                if isinstance(b, ToolResultBlock):
                    if check_ids:
                        self._check_result_id(b.tool_use_id, replayed, live_ids)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.content})
            text = "".join(b.text for b in m.blocks if isinstance(b, TextBlock))
            if text or not any(isinstance(b, ToolResultBlock) for b in m.blocks):
                out.append({"role": "user" if m.role == "tool" else m.role, "content": text})
        return out, diags

    def _check_result_id(self, tool_id: str, replayed: set[str], live: set[str]) -> None:
        if tool_id in replayed or tool_id in live:
            return
        if tool_id in self.memory:
            raise ChatError(409, f"tool result {tool_id} answers a call whose live state is gone; "
                                 "replay the full history, including the assistant tool call")
        raise ChatError(400, f"unknown tool_use_id {tool_id}: it is neither live nor answered by "
                             "an assistant tool call in this request; replay the full history")

    def _assistant(self, m: Message, thinking_mode: str, diags: list[str]) -> dict:
        reasoning, content, calls = [], [], []
        for b in m.blocks:
            if isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
                text = self.signer.proven_text(b)
                if text is not None:
                    reasoning.append(text)
                elif isinstance(b, ThinkingBlock):
                    diags.append("thinking block without a valid signature: rendered without it")
                else:
                    diags.append("redacted thinking that is not ours or was altered: dropped")
            elif isinstance(b, TextBlock):
                content.append(b.text)
            elif isinstance(b, ToolUseBlock):
                calls.append(b)
        msg: dict = {"role": "assistant", "content": "".join(content)}
        if reasoning and thinking_mode == "thinking":
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            raw = self.memory.exact_block([c.id for c in calls])
            if raw is not None:
                msg[d.RAW_TOOL_BLOCK] = raw
            else:
                diags.append(f"tool calls {[c.id for c in calls]} rendered canonically "
                             "(not all found in tool memory as one sampled block)")
        return msg

    def _render_segments(self, request: ChatRequest, messages: list[dict], thinking_mode: str):
        tools = [t.openai() for t in request.tools] or None
        return self.dialect.render_segments(messages, tools, thinking_mode=thinking_mode,
                                            reasoning_effort=request.reasoning_effort,
                                            response_format=prompt_response_format(request))

    # ---- the cache ladder -------------------------------------------------------------------
    def _live_valid(self) -> bool:
        return self._live is not None and self._live.state_id == self.engine.state_id

    def _plan(self, request: ChatRequest, messages: list[dict], thinking_mode: str) -> _Plan:
        plan = self._plan_live(request, messages, thinking_mode)
        if plan is None:
            plan = self._plan_rendered(request, messages, thinking_mode)
        plan.state_id = self.engine.state_id
        total = plan.keep + len(plan.new_tokens)
        if total > self.engine.n_ctx:
            raise ChatError(400, f"the prompt is {total} tokens, over the context of "
                                 f"{self.engine.n_ctx} tokens; shorten the conversation")
        return plan

    def _plan_live(self, request: ChatRequest, messages: list[dict], thinking_mode: str) -> _Plan | None:
        live = self._live
        if not self._live_valid() or not live.pending or live.thinking_mode != thinking_mode:
            return None
        tail = _trailing_turn(messages)
        answered = sorted(m["tool_call_id"] for m in tail if m.get("role") == "tool")
        if answered != sorted(live.pending):
            return None  # a partial or different set of results is not a continuation
        head = messages[: len(messages) - len(tail)]
        recs = [self.memory.get(i) for i in live.pending]
        if any(r is None for r in recs):
            return None
        calls = [{"id": r.id, "type": "function", "function": {"name": r.name, "arguments": r.arguments}}
                 for r in recs]
        stand_in = {"role": "assistant", "content": "", "tool_calls": calls, d.RAW_TOOL_BLOCK: _SENTINEL}
        if head and head[-1].get("role") == "assistant":
            head = head[:-1]
        segs = self._render_segments(request, head + [stand_in] + tail, thinking_mode)
        suffix = _segments_after(segs, _SENTINEL)
        if suffix is None:
            return None
        tokens = self.engine.tokenizer.encode_segments(suffix)
        n = self.engine.n_tokens
        return _Plan("live", n, tokens, live.text + "".join(s.text for s in suffix), live_keep=n)

    def _plan_rendered(self, request: ChatRequest, messages: list[dict], thinking_mode: str) -> _Plan:
        segments = self._render_segments(request, messages, thinking_mode)
        plan = self._plan_prefix(segments)
        return self._plan_disk(segments, plan) or plan

    def _plan_disk(self, segments: list[d.Segment], prefix: _Plan) -> _Plan | None:
        """The disk rung: the longest checkpoint whose text is a prefix of the prompt, if it
        holds more tokens than the live rungs keep. Only the index is consulted here; the file
        is read and verified when the request runs."""
        if self.checkpoints is None:
            return None
        for entry in self.checkpoints.lookup(prefix.text, max_tokens=self.engine.n_ctx):
            if entry.n_tokens <= prefix.keep:
                continue
            rest = _segments_from(segments, len(entry.text))
            if rest is None:
                continue  # the stored text ends inside a control marker
            more = self.engine.tokenizer.encode_segments(rest)
            return _Plan("disk", entry.n_tokens, more, prefix.text, live_keep=prefix.keep,
                         checkpoint=entry, segments=segments)
        return None

    def _plan_prefix(self, segments: list[d.Segment]) -> _Plan:
        text = "".join(s.text for s in segments)
        tokens = self.engine.tokenizer.encode_segments(segments)
        cached = self.engine.tokens
        common = 0
        limit = min(len(cached), len(tokens) - 1)  # leave one token to compute fresh logits
        while common < limit and cached[common] == tokens[common]:
            common += 1
        if self._live_valid() and common < len(cached) and text.startswith(self._live.text):
            rest = _segments_from(segments, len(self._live.text))
            if rest is not None:
                more = self.engine.tokenizer.encode_segments(rest)
                if more:
                    return _Plan("text_prefix", len(cached), more, text, live_keep=len(cached))
        source = "token_prefix" if common else "cold"
        return _Plan(source, common, tokens[common:], text, live_keep=common)

    # ---- generation -------------------------------------------------------------------------
    def _run(self, request: ChatRequest, plan: _Plan, thinking_mode: str,
             diagnostics: list[str], constraint: TokenConstraint | None = None) -> Iterator[ChatEvent]:
        eng, tok = self.engine, self.engine.tokenizer
        if plan.state_id != eng.state_id:
            # another request ran between acceptance and execution
            if plan.source == "live":
                raise ChatError(409, "the live state this request continues is gone; replay the full history")
            messages, _ = self._dialect_messages(request, thinking_mode)
            plan = self._plan_rendered(request, messages, thinking_mode)
        diagnostics = list(diagnostics)
        t0 = time.perf_counter()
        self._save_before_evict(plan)
        if plan.source == "disk":
            plan = self._restore(plan, diagnostics)
        self._live = None  # the cache is about to change; re-established at the end
        eng.rewind(plan.keep)
        try:
            self._prefill(plan)
        except _native.ContextOverflow as e:
            raise ChatError(400, str(e)) from None
        t1 = time.perf_counter()
        gen = _Generation(self, request, thinking_mode, plan.text, constraint)
        try:
            yield from gen.run()
        except BaseException:
            # Stopped mid-reply (client gone, server shutting down) or failed: the cache holds
            # the prompt and the tokens sampled so far, exactly. Keep that as the live state, so
            # a later request can reuse it and close() can save it; it continues no tool call.
            self._live = _Live(plan.text + tok.decode(gen.evaluated), eng.state_id, (), thinking_mode)
            raise
        t2 = time.perf_counter()

        calls = gen.finished_calls()
        self._remember_calls(calls, gen, thinking_mode)
        self._live = _Live(plan.text + tok.decode(gen.evaluated), eng.state_id,
                           tuple(c[0] for c in calls) if gen.reason == "tool_calls" else (),
                           thinking_mode)
        usage = _usage(plan, gen.n_sampled, prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
                       guessed_tokens=gen.feed.stats.drafted, kept_tokens=gen.feed.stats.accepted)
        yield Finish(gen.reason, usage, tuple(diagnostics + gen.diagnostics), gen.stop_sequence)

    # ---- disk checkpoints -------------------------------------------------------------------
    def _restore(self, plan: _Plan, diagnostics: list[str]) -> _Plan:
        """Load the plan's checkpoint into the engine. A file that vanished or fails a check
        (the store removes it) or that the engine refuses degrades to the prefix rungs / cold,
        with a diagnostic; the request still succeeds."""
        store, entry = self.checkpoints, plan.checkpoint
        ck = store.load(entry)
        why = "missing or failed its checks"
        if ck is not None:
            try:
                self.engine.restore(ck.tokens, ck.kv)
                store.touch(entry)
                return plan
            except (_native.BadSnapshot, _native.ModelMismatch, _native.ContextOverflow) as e:
                store.discard(entry, f"refused by the engine: {e}")
                why = str(e)
        diagnostics.append(f"disk checkpoint {entry.key[:12]} not used ({why}); prefilled instead")
        return self._plan_prefix(plan.segments)

    def _save_before_evict(self, plan: _Plan) -> None:
        """A request that discards a long part of the live state saves the state first."""
        if self.checkpoints is None or not self._live_valid():
            return
        if self.engine.n_tokens - plan.live_keep >= self.checkpoints.config.min_tokens:
            self._save("evict", self._live.text, exact=True)

    def _prefill(self, plan: _Plan) -> None:
        """Prefill the plan's new tokens, pausing at save points to checkpoint the state there
        (the computation is the same split or not: the kernels are batch-invariant)."""
        eng, new, keep = self.engine, plan.new_tokens, plan.keep
        for pos, reason in self._save_points(plan):
            eng.append(new[eng.n_tokens - keep: pos - keep])
            self._save(reason, plan.text)
        eng.append(new[eng.n_tokens - keep:])

    def _save_points(self, plan: _Plan) -> list[tuple[int, str]]:
        """Aligned frontiers inside this prefill, and for a fresh prompt (not a continuation of
        the live state) its trimmed, aligned boundary."""
        store = self.checkpoints
        if store is None or not plan.new_tokens or not store.writable:
            return []
        cfg, end = store.config, plan.keep + len(plan.new_tokens)
        points = {f: "continued" for f in cfg.frontiers(plan.keep, end)}
        if plan.source not in ("live", "text_prefix"):
            b = cfg.cold_boundary(end)
            if b is not None and b > plan.keep:
                points[b] = "cold"
        return sorted(points.items())

    def _save_generation_frontier(self, gen: "_Generation") -> None:
        """During decode: a checkpoint when the state reaches an aligned frontier, unless the
        model has opened a tool-call section."""
        step = self.checkpoints.config.frontier_step if self.checkpoints is not None else 0
        if not step or gen.feed.pending or self.engine.n_tokens % step:
            return
        sampled = self.engine.tokenizer.decode(gen.evaluated)
        # a state ending inside a tool call is not a prefix any later request will render
        if gen._calls or any(o in sampled for o in self.dialect.tool_openers):
            return
        self._save("continued", gen.prompt_text + sampled, exact=True)

    def _save(self, reason: str, expected: str, exact: bool = False) -> str:
        """Checkpoint the engine's current state as it is (never rolled back for this). The
        stored text is the decoded stored tokens; it must equal (`exact`) or be a prefix of the
        text the caller knows the state renders, else (a boundary that splits a character, a
        lossy decode) nothing is saved. Returns what happened, in words."""
        store, eng = self.checkpoints, self.engine
        if store is None or not store.writable:
            return "checkpoints are off; nothing saved"
        if eng.n_tokens < store.config.min_tokens:
            return f"{eng.n_tokens} tokens, under the {store.config.min_tokens} a checkpoint needs; nothing saved"
        text = eng.tokenizer.decode(eng.tokens)
        if (text != expected if exact else not expected.startswith(text)) or text.endswith("\ufffd"):
            log.debug("no %s checkpoint at %d tokens: decoded text does not match", reason, eng.n_tokens)
            return f"the {eng.n_tokens} tokens do not decode to their text exactly; nothing saved"
        if store.has(text):
            return f"the state ({eng.n_tokens} tokens) is already on disk"
        inside: dict[str, bool] = {}
        tools = [r for r in self.memory.records()
                 if inside.setdefault(r.block_id, bool(r.block_raw) and r.block_raw in text)]
        entry = store.save(text, eng.tokens, eng.native_ctx.logits(), eng.snapshot(), eng.n_ctx, reason, tools)
        if entry is None:
            return f"the state ({eng.n_tokens} tokens) could not be written (see the log)"
        return f"saved {eng.n_tokens} tokens as checkpoint {entry.key[:12]} ({reason})"

    def _remember_calls(self, calls, gen: "_Generation", thinking_mode: str) -> None:
        if not calls:
            return
        parsed = self.dialect.parse(gen.text, lenient=True, thinking_mode=thinking_mode)
        if len(parsed.tool_calls) != len(calls):
            gen.diagnostics.append("tool calls not remembered: stream and one-shot parse disagree")
            return
        block_id = calls[0][0]
        for i, ((cid, _name, _args), call) in enumerate(zip(calls, parsed.tool_calls)):
            self.memory.remember(ToolRecord(cid, call.name, call.arguments, call.raw,
                                            parsed.tool_block_raw, block_id, i, len(calls)))


class _Generation:
    """The sampling loop of one request: mask the logits to what the request's grammar allows
    (when it has one), sample (structure greedy, payload at the request's settings), feed the
    dialect's stream parser, translate its events, stop on EOS, stop strings or the token
    limit."""

    def __init__(self, session: ChatSession, request: ChatRequest, thinking_mode: str,
                 prompt_text: str = "", constraint: TokenConstraint | None = None):
        self.s, self.req = session, request
        self.prompt_text = prompt_text   # decoded text of the cache when sampling starts
        self.constraint = constraint
        self._custom = {t.name for t in request.tools if t.kind == "custom"}
        opts = {"thinking_mode": thinking_mode}
        self.parser = session.dialect.stream_parser(lenient=True, **opts)
        self.tracker = session.dialect.syntax_tracker(**opts) if session.syntax_greedy else None
        self.sampler = Sampler(request.sampling)
        self.decoder = StreamDecoder(session.engine.tokenizer)
        store = session.checkpoints
        # guesses from prompt lookup (lookup.py); batches stop at checkpoint frontiers
        self.feed = DraftFeed(session.engine, max_draft=session.engine.lookup,
                              align=store.config.frontier_step if store is not None else 0)
        self.evaluated: list[int] = []   # sampled tokens now in the cache
        self.n_sampled = 0
        self.text = ""                   # sampled text fed to the parser
        self.reason = "length"
        self.stop_sequence: str | None = None  # the stop string that ended the reply
        self.diagnostics: list[str] = []
        self._thinking: list[str] = []
        self._thinking_open = thinking_mode == "thinking"
        self._calls: dict[int, list] = {}   # index -> [id, name, arguments | None]

    def finished_calls(self) -> list[tuple[str, str, str]]:
        return [(c[0], c[1], c[2]) for _, c in sorted(self._calls.items()) if c[2] is not None]

    def run(self) -> Iterator[ChatEvent]:
        eng, req = self.s.engine, self.req
        eos = eng.tokenizer.eos_ids
        stops = tuple(req.stop)
        pending = ""  # decoded text held back: it may be the start of a stop string
        feed = self.feed
        try:
            for _ in range(req.max_tokens):
                logits = feed.logits()
                tok = self._sample(self._masked(logits))
                self.n_sampled += 1
                if tok in eos:
                    self.reason = "stop"
                    break
                if req.logprobs is not None:
                    yield self._sampled_token(logits, tok)
                if feed.n_tokens >= eng.n_ctx:
                    break  # context full: finish "length"
                self._advance(tok)  # the next mask is computed while the engine evaluates tok
                feed.push(tok)
                self.evaluated.append(tok)
                self.s._save_generation_frontier(self)
                pending += self.decoder.push(tok)
                hit = first_stop(pending, stops)
                if hit is not None:
                    yield from self._feed(pending[:hit[0]])
                    pending, self.reason, self.stop_sequence = "", "stop", hit[1]
                    break
                keep = partial_stop_len(pending, stops)
                yield from self._feed(pending[: len(pending) - keep])
                pending = pending[len(pending) - keep:]
            else:
                pending += self.decoder.flush()
        finally:
            feed.close()  # the cache ends at the reply, however the loop ended (a disconnect too)
        if self.reason == "length" or pending:
            yield from self._feed(pending)
        yield from self._translate(self.parser.finish())
        yield from self._close_thinking()
        if self.finished_calls() and self.reason == "stop":
            self.reason, self.stop_sequence = "tool_calls", None

    def _sampled_token(self, logits: np.ndarray, tok: int) -> SampledToken:
        lp, tk = token_logprob(logits, tok, self.req.logprobs), self.s.engine.tokenizer
        return SampledToken(tk.decode([tok]), tk.token_bytes(tok), lp.logprob,
                            tuple((tk.decode([i]), tk.token_bytes(i), v) for i, v in lp.top))

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        return logits if self.constraint is None else self.constraint.mask(logits)

    def _advance(self, tok: int) -> None:
        if self.constraint is not None and not self.constraint.advance(tok):
            self.diagnostics.append(f"constraint dropped: {self.constraint.error.splitlines()[0]}")
            self.constraint = None

    def _sample(self, logits: np.ndarray) -> int:
        if self.tracker is not None and self.tracker.next_kind() == d.STRUCTURE:
            return int(np.argmax(logits))
        return self.sampler.sample(logits)

    def _feed(self, text: str) -> Iterator[ChatEvent]:
        if not text:
            return
        self.text += text
        if self.tracker is not None:
            self.tracker.feed(text)
        yield from self._translate(self.parser.feed(text))

    def _translate(self, events: list[d.Event]) -> Iterator[ChatEvent]:
        for e in events:
            if isinstance(e, d.ParsedReasoning):
                self._thinking.append(e.text)
                if not self.req.redact_thinking:
                    yield ThinkingDelta(e.text)
                continue
            yield from self._close_thinking()
            if isinstance(e, d.ParsedText):
                yield TextDelta(e.text)
            elif isinstance(e, d.ParsedCallStart):
                cid = new_tool_id(self.req.id_prefix)
                self._calls[e.index] = [cid, e.name, None]
                yield ToolCallStart(cid, e.name, e.index, self._kind(e.name))
            elif isinstance(e, d.ParsedCallArgs) and e.index in self._calls:
                yield ToolCallDelta(self._calls[e.index][0], e.json_fragment, e.index)
            elif isinstance(e, d.ParsedCallEnd) and e.index in self._calls:
                c = self._calls[e.index]
                c[2] = e.arguments
                yield ToolCallDone(c[0], e.name, e.arguments, e.index, self._kind(e.name))
            elif isinstance(e, d.ErrorEvent):
                self.diagnostics.append(f"model output not executable: {e.message}")

    def _kind(self, name: str) -> str:
        return "custom" if name in self._custom else "function"

    def _close_thinking(self) -> Iterator[ChatEvent]:
        if not self._thinking_open:
            return
        self._thinking_open = False
        text = "".join(self._thinking)
        signer = self.s.signer
        yield ThinkingDone(text, signer.sign(text), signer.encrypt(text) if self.req.redact_thinking else None)


# ---- helpers ------------------------------------------------------------------------------
def _merge_assistant_runs(messages) -> list[Message]:
    """Adjacent assistant messages are one turn split by the client (thinking, text and
    tool_use sent as separate messages): bundle them so they render like the original turn."""
    out: list[Message] = []
    for m in messages:
        if out and m.role == "assistant" and out[-1].role == "assistant":
            out[-1] = Message("assistant", out[-1].blocks + m.blocks)
        else:
            out.append(m)
    return out


def _trailing_turn(messages: list[dict]) -> list[dict]:
    """The messages after the last assistant message (tool results, and any text the client
    adds beside them, such as Claude Code's reminders)."""
    i = len(messages)
    while i > 0 and messages[i - 1].get("role") != "assistant":
        i -= 1
    return messages[i:]


def _segments_after(segments: list[d.Segment], marker: str) -> list[d.Segment] | None:
    """The segments after the first occurrence of `marker` (which must lie in plain text)."""
    for k, s in enumerate(segments):
        pos = s.text.find(marker)
        if pos >= 0:
            if s.control:
                return None
            rest = s.text[pos + len(marker):]
            return ([d.Segment(rest)] if rest else []) + list(segments[k + 1:])
    return None


def _segments_from(segments: list[d.Segment], offset: int) -> list[d.Segment] | None:
    """The segments from character `offset` on; None if the offset splits a control marker."""
    pos = 0
    for k, s in enumerate(segments):
        end = pos + len(s.text)
        if offset < end or (offset == end and k == len(segments) - 1):
            if offset == pos:
                return list(segments[k:])
            if s.control:
                return None
            return [d.Segment(s.text[offset - pos:])] + list(segments[k + 1:])
        pos = end
    return [] if offset == pos else None
