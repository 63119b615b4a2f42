"""What every chat dialect provides, and the typed events its streaming parser emits.

A dialect turns neutral chat messages into the exact prompt text a model family was trained on,
and turns sampled text back into reasoning, content and tool calls. Each dialect module
(`deepseek_v4.py`, `chatml.py`) exposes one class implementing `Dialect`; the session layer
never looks inside the text itself. Everything a caller needs to know of a dialect's syntax
(its tool-call openers, whether it reasons before answering, the grammar that forces its tool
calls, which sampled positions are structure) is asked of the `Dialect`, so adding a dialect
touches this folder only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Union

if TYPE_CHECKING:
    from zen5.grammar import Demand


# An assistant message dict may carry this key (set by the session from tool memory): the exact
# sampled tool-call section (ParsedMessage.tool_block_raw of that dialect). The renderer then
# writes those bytes instead of a canonical rendering of `tool_calls`, so a replayed turn is
# byte-identical to what the model produced and every cache prefix after it stays valid.
RAW_TOOL_BLOCK = "_raw_tool_block"


# ---- one-shot parse results -------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str            # JSON object text, built exactly as the dialect's spec says
    raw: str                  # the exact sampled text of this call (one invoke / <tool_call> block)


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    # the exact sampled text of the whole tool-call section (DSML block / all <tool_call> blocks
    # with their separators), "" when there are no calls
    tool_block_raw: str = ""
    # leniencies applied (lenient mode only), e.g. "missing_blank_line_before_tool_block"
    notes: tuple[str, ...] = ()


class ParseError(ValueError):
    """Strict parse failure: the text is not well-formed output of this dialect."""


# ---- streaming events ---------------------------------------------------------------------
# Named Parsed* so they never read as the chat events of chat_types (TextDelta, ToolCallStart,
# ...), which the session translates them into, adding tool-call IDs and thinking signatures.
@dataclass(frozen=True)
class ParsedReasoning:
    text: str


@dataclass(frozen=True)
class ParsedText:
    text: str


@dataclass(frozen=True)
class ParsedCallStart:
    index: int                # 0-based position of the call within this message
    name: str


@dataclass(frozen=True)
class ParsedCallArgs:
    index: int
    json_fragment: str        # concatenated fragments of one call == its final `arguments`


@dataclass(frozen=True)
class ParsedCallEnd:
    index: int
    name: str
    arguments: str
    raw: str                  # exact sampled text of the call block


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    raw: str = ""             # the text that could not be parsed (emitted as nothing else)


Event = Union[ParsedReasoning, ParsedText, ParsedCallStart, ParsedCallArgs, ParsedCallEnd, ErrorEvent]


class StreamParser(Protocol):
    def feed(self, delta: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...   # end of generation (EOS or limit): flush or report


# ---- prompt segments (control-string policy) ----------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A piece of rendered prompt. `control` pieces are the template's own markers and may be
    tokenized as special tokens; all other text (user, tool, assistant content) is tokenized as
    plain text, so a user typing a marker can never forge a turn boundary."""
    text: str
    control: bool = False


# ---- syntax tracking ------------------------------------------------------------------------
# What the next sampled position of an assistant message is: protocol structure (tags, JSON
# punctuation and keys: decoded greedily, so a small model at temperature 1 still writes a call
# that parses) or payload (content, argument values: decoded with the request's settings).
STRUCTURE, PAYLOAD = "structure", "payload"


class SyntaxTracker(Protocol):
    def feed(self, delta: str) -> str: ...   # advance by sampled text; the next position's kind
    def next_kind(self) -> str: ...          # STRUCTURE | PAYLOAD


class Dialect(Protocol):
    name: str
    # Text that opens a tool-call section in sampled output. A state whose sampled text holds
    # one is inside (or past) a call, which no later request renders as a prefix.
    tool_openers: tuple[str, ...]

    def thinking_mode(self, thinking: bool | None) -> str:
        """The rendering mode for a request's thinking switch (None: the client did not say):
        "thinking" (the model reasons before answering) or "chat"; the value to pass as the
        `thinking_mode` option of every method below."""

    def render(self, messages: list[dict], tools: list[dict] | None = None, **options) -> str: ...
    def render_segments(self, messages: list[dict], tools: list[dict] | None = None,
                        **options) -> list[Segment]: ...
    def parse(self, text: str, lenient: bool = False, **options) -> ParsedMessage: ...
    def stream_parser(self, lenient: bool = True, **options) -> StreamParser: ...
    def syntax_tracker(self, **options) -> SyntaxTracker: ...
    def render_tool_calls(self, calls: Iterable[tuple[str, str]]) -> str: ...  # canonical (name, args JSON)

    def grammar(self, demand: Demand, token_id: Callable[[str], int | None] | None = None,
                **options) -> str:
        """The llguidance grammar (JSON text) of an assistant message meeting `demand` (forced
        or forbidden calls, a JSON answer, custom tool inputs, a thinking budget) in this
        dialect's output syntax; `token_id(text)` maps its special tokens to ids. Raises
        grammar.ConstraintError when the demand cannot be written."""

    @property
    def stop_strings(self) -> tuple[str, ...]: ...
