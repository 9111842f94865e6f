"""Per-request sampling parameters (vLLM-shaped) and the per-token logprob record.

`SamplingParams` is user input: every field is checked in `__post_init__` and a bad value
raises `ValueError` naming it. Checks that need the model (vocabulary size) live in
`for_model`, called by the engine when it accepts a request. Every field is bounded, so no
value a user can pass reaches a step and fails there (a failing step ends its requests).

Deliberate differences from vLLM, written down so nobody "fixes" them by accident:
- `max_tokens` must be >= 1 (or None = up to the context): every scheduled prefill samples a
  token, so a request that asks for none would need its own path through the engine.
- `top_k=-1` is normalised to 0; both mean "off", and consumers test one value.
- `greedy` is `temperature < GREEDY_BELOW` (vLLM's 1e-5): dividing fp32 logits by a smaller
  temperature overflows to inf and the softmax to NaN.
- `top_k` above the vocabulary keeps the whole vocabulary (vLLM clamps it too): `for_model`.
- `logprobs` is at most `MAX_LOGPROBS`: ranking the top k costs O(k^2) per row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 100


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the raw model distribution; rank 1 = most likely."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite int or float (not a bool, not NaN, not inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. After construction `stop` and `stop_token_ids` are tuples."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalise()
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")

    def _normalise(self) -> None:
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    def _check_counts(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        max_tokens = self.max_tokens
        _require(
            max_tokens is None or (_is_int(max_tokens) and max_tokens >= 1),
            f"max_tokens must be an int >= 1 or None, got {max_tokens!r}",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an int >= 0, got {self.min_tokens!r}",
        )
        _require(
            max_tokens is None or self.min_tokens <= max_tokens,
            f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={max_tokens}",
        )
        _require(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}",
        )
        _require(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed <= 2**63 - 1 - self.n),
                 f"seed must be an int in [-2**63, 2**63 - 1 - n] or None, got {self.seed!r}")

    def _check_distribution(self) -> None:
        t = self.temperature
        _require(_is_real(t) and t >= 0, f"temperature must be finite and >= 0, got {t!r}")
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= -1, got {self.top_k!r}")
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")

    def _check_penalties(self) -> None:
        r = self.repetition_penalty
        _require(_is_real(r) and r > 0, f"repetition_penalty must be finite and > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")

    def _check_stops(self) -> None:
        for s in self.stop or ():  # a tuple by now (_normalise)
            _require(isinstance(s, str) and s != "", f"stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            _require(_is_int(t), f"stop_token_ids must be ints, got {t!r}")

    def for_model(self, vocab_size: int) -> SamplingParams:
        """Checks that need the model (every stop token id in [0, vocab_size)); -> these params
        with `top_k` clamped to the vocabulary (0: off)."""
        for t in self.stop_token_ids:
            _require(0 <= t < vocab_size, f"stop_token_ids must be in [0, {vocab_size}), got {t}")
        return dataclasses.replace(self, top_k=0) if self.top_k >= vocab_size else self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
