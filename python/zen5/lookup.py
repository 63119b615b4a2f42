"""Prompt-lookup speculative decoding: guess the next tokens by finding where the last few
tokens occurred earlier in the context (the prompt or the reply so far) and copying what
followed them; evaluate the guesses in the same batch as the sampled token; keep each guess
only if the sampler, run on the row before it, picks that very token.

Why: a decoded token reads every weight and the whole KV cache. A batch of a few tokens reads
them once, so when guesses are right several tokens cost little more than one. That is where a
coding agent's replies spend their tokens: tool arguments and edits that repeat paths, names and
code the context already holds (the same idea as llama.cpp's lookup decoding and vLLM's
`ngram` speculator).

Exactness: the kernels are batch-invariant (a batch's logits equal the tokens evaluated one by
one, bit for bit), every row is sampled with the same code and the same random draws in the same
order as without lookup, and a guess is used only when it equals the sampled token. So a reply is
the same token sequence with lookup on or off, greedy or seeded. A mismatch ends the batch: the
remaining guesses are rewound out of the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NGRAM_MAX = 3   # longest tail looked up; the longest match wins
NGRAM_MIN = 2   # a single-token tail matches too often to pay for its failed guesses
MAX_DRAFT = 5   # guesses per batch: a batch of 6 is one prefill tile of the int8 matmul (5 measured
                # equal or better than 7 over copying and non-copying replies, 2 rounds)
FIRST_DRAFT = 3  # the first batch's guesses; then +2 after a batch whose guesses were all kept, -1
                 # after one with a rejection (a failed guess costs ~20% of a decode step at 512
                 # positions and less deeper, so the length follows how well guessing goes)


class Lookup:
    """The context's tokens and the lookup of their tail's latest earlier occurrence."""

    def __init__(self, tokens, capacity: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN):
        self._t = np.empty(max(capacity, len(tokens)), dtype=np.int32)
        self._t[:len(tokens)] = tokens
        self._n = len(tokens)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def __len__(self) -> int:
        return self._n

    def push(self, tok: int) -> None:
        if self._n == len(self._t):
            self._t = np.concatenate([self._t, np.empty(max(len(self._t), 16), np.int32)])
        self._t[self._n] = tok
        self._n += 1

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        matching tail (NGRAM_MAX down to NGRAM_MIN tokens), or [] when none occurred."""
        t, n = self._t, self._n
        if limit <= 0:
            return []
        for m in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            tail = t[n - m:n]
            # starts c < n - m of earlier occurrences (they may overlap the tail's own start)
            c = np.flatnonzero(t[:n - m] == tail[0])
            for j in range(1, m):
                if not len(c):
                    break
                c = c[t[c + j] == tail[j]]
            if len(c):
                start = int(c[-1]) + m
                return t[start:min(start + limit, n)].tolist()
        return []


@dataclass
class LookupStats:
    drafted: int = 0     # guesses evaluated
    accepted: int = 0    # guesses the sampler picked (tokens that cost no evaluation of their own)


class DraftFeed:
    """Gives the decode loop the logits of its next position and takes the sampled token,
    evaluating guesses alongside it. The engine then holds the accepted tokens plus pending
    guesses; `n_tokens` counts only the accepted ones, and `close()` rewinds the guesses (keeping
    the last accepted token's logits current) so the cache ends exactly at the reply.

    `align`: batches never run past a multiple of it, so a checkpoint taken when the accepted
    count reaches one finds no guesses in the cache."""

    def __init__(self, engine, max_draft: int = MAX_DRAFT, align: int = 0):
        self.eng = engine
        self.lookup = Lookup(engine.tokens, engine.n_ctx) if max_draft > 0 else None  # 0: off
        self.max_draft, self.align = max_draft, align
        self._k = min(FIRST_DRAFT, max_draft)  # the next batch's guess limit
        self.stats = LookupStats()
        self._rows: np.ndarray | None = None   # the last batch's logits
        self._i = 0                            # row of the next position
        self._guesses: list[int] = []          # evaluated, not yet sampled

    @property
    def n_tokens(self) -> int:
        return self.eng.n_tokens - len(self._guesses)

    @property
    def pending(self) -> bool:
        return bool(self._guesses)

    def logits(self) -> np.ndarray:
        return self._rows[self._i] if self._rows is not None else self.eng.native_ctx.logits()

    def push(self, tok: int) -> None:
        """Make `tok` the next token of the cache."""
        if self.lookup is None:
            self.eng.append([tok])
            return
        self.lookup.push(tok)
        if self._guesses and self._guesses[0] == tok:
            self._guesses.pop(0)
            self._i += 1
            self.stats.accepted += 1
            return
        if self._guesses:  # (the last kept token's logits stay current if the next eval fails)
            self._drop_guesses()
            self._k = max(1, self._k - 1)
        elif self._rows is not None:  # every guess of the last batch was kept
            self._k = min(self.max_draft, self._k + 2)
        n = self.eng.n_tokens + 1
        limit = min(self._k, self.eng.n_ctx - n)
        if self.align:
            limit = min(limit, (n - 1) // self.align * self.align + self.align - n)
        guesses = self.lookup.draft(limit)
        if not guesses:
            self._rows = None
            self.eng.append([tok])
            return
        self._rows = self.eng.append([tok] + guesses, all_logits=True)
        self._i, self._guesses = 0, guesses
        self.stats.drafted += len(guesses)

    def close(self) -> None:
        """Rewind the pending guesses; the logits of the last accepted token stay current."""
        if self._guesses:
            self._drop_guesses()
        self._rows = None

    def _drop_guesses(self) -> None:
        # the row of the next position holds the last accepted token's logits: no re-evaluation
        self.eng.rewind(self.n_tokens, self._rows[self._i])
        self._guesses = []
