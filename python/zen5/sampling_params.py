"""SamplingParams: a request's sampling settings, validated once.

Why a module of its own, below the engine: the settings are a plain value that the protocol
adapters build from wire JSON, the neutral chat request carries, and the engine's sampler
consumes. The adapters and the chat types must not import the sampler (and through it the native
module) to name a value type.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8   # 0 means greedy
    top_k: int = 40            # 0 disables
    top_p: float = 0.95        # 1 disables
    min_p: float = 0.05        # 0 disables
    seed: int | None = None    # None: a fresh random seed per call
    logprobs: int = 0          # how many top alternatives to report per token (0: none)

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
