"""Stop strings in streamed text: where one occurs, and how much of a tail must be held back.

Why a module of its own, below both the engine and the dialects: every generation loop (the
engine's raw `generate`, the session's chat loop) ends on the request's stop strings, and every
streaming parser holds back a tail that may still become a marker (`<tool_call>`, `<|im_end|>`,
a DSML tag). It is one question about text either way, answered in one place, and a dialect
that needs it must not reach into the engine's sampler for it.
"""
from __future__ import annotations

__all__ = ["find_stop", "first_stop", "partial_stop_len"]


def first_stop(text: str, stops) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text` (the first listed on a tie),
    or None."""
    hits = [(i, n, s) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    return min(hits)[::2] if hits else None


def find_stop(text: str, stops) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hit = first_stop(text, stops)
    return hit[0] if hit else None


def partial_stop_len(text: str, stops) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string: that
    much must be held back from streaming until the next token decides."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
