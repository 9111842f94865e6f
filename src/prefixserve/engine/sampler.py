"""One step's logits -> one token per row, plus logprobs where a row asks for them.

Pipeline, per row; each stage runs vectorised over the rows that need it and is skipped
when none does:

    raw logits ──> logprobs: log_softmax of the raw logits (vLLM v1's default)
        │ (a copy where the next two stages write; the caller's tensor is never written)
        ├─ min_tokens: stop_token_ids, and eos unless ignore_eos, -> -inf while the output is short
        ├─ repetition penalty over prompt + output; presence / frequency penalty over output
        ├─ greedy rows: argmax (ties -> lowest token id, as torch.argmax)
        └─ random rows: / temperature -> top_k -> top_p -> softmax -> min_p -> exponential race

Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks token i with
probability p_i / sum(p) (the Gumbel-max trick without logs), so the probabilities need no
renormalising after top_k / top_p / min_p. A seeded row's noise is a counter-based hash of
(its seed, its output length, the token id), raced for all seeded rows in one call (`race`:
a fused kernel on CUDA), independent of what else is in the batch, and the same again when a
preempted sequence is recomputed. Unseeded rows draw from torch's default generator.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from prefixserve.engine import race
from prefixserve.sampling_params import Logprob, SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads of one request (`sample_seed`: None = unseeded)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def sample_seed(self) -> int | None: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...  # may end in pending tokens (counted, not read)


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]  # [B]
    logprobs: list[dict[int, Logprob] | None]  # [B]; None where the row's params.logprobs is None


class DeviceSample:
    """A step's sampled tokens while still on the device. `token_ids` can feed the next step
    at once; `result()` waits for this step's copies to the host only, not for work queued
    after them (a blocking `.tolist()` would wait for that too)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: _LogprobTensors | None):
        self.token_ids = token_ids  # [B] int64
        self._logprobs = logprobs
        tensors = [token_ids, *(logprobs.tensors if logprobs else ())]
        self._event: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       for t in tensors]
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's Event.__new__ is unannotated
            self._event.record()
        self._host = tensors

    def result(self) -> SampleOutput:
        if self._event is not None:
            self._event.synchronize()
        token_ids, *lp = (t.tolist() for t in self._host)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(token_ids)
        if self._logprobs:
            logprobs = self._logprobs.entries(lp)
        return SampleOutput(token_ids, logprobs)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], deterministic: bool = False) -> None:
        """deterministic: every row's result independent of the other rows (top-k / top-p over
        the whole vocabulary, not the batch's largest k; the engine seeds every request)."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.deterministic = deterministic

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
        """logits: [B, V] fp32, row b belongs to rows[b]."""
        return self.sample_on_device(logits, rows).result()

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        """As `sample`, without waiting for the device. Needs the values of the rows' output
        tokens only where a row has a penalty (none may then be pending)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        assert logits.dtype == torch.float32, logits.dtype
        # a copy only where a row's logits are written (min_tokens, penalties): 128 MB at 1,024 x
        # 32,000, 50 ms on the CPU; every later stage makes new tensors
        writes = any(len(row.output_token_ids) < row.params.min_tokens or has_penalty(row.params) for row in rows)
        processed = logits.clone() if writes else logits
        self._mask_early_stops(processed, rows)
        _apply_penalties(processed, rows)
        token_ids = _choose(processed, rows, self.deterministic)  # [B] int64
        return DeviceSample(token_ids, _LogprobTensors.of(logits, token_ids, rows, self.deterministic))

    def _mask_early_stops(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """Forbid every token that would end a row before it has min_tokens output tokens."""
        row_idx: list[int] = []
        token_idx: list[int] = []
        for b, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) >= p.min_tokens:
                continue
            stops = p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *self.eos_token_ids)
            row_idx += [b] * len(stops)
            token_idx += stops
        if row_idx:
            index = _to_device([row_idx, token_idx], logits.device)
            logits[index[0], index[1]] = float("-inf")


def _to_device(values: Sequence[float] | Sequence[Sequence[int]], device: torch.device,
               dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list as a device tensor without a sync: a copy from pageable memory (what
    `torch.tensor(..., device=)` and indexing with a list do) waits for the device's queue,
    which would stall overlapped scheduling on the step still running."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _rows(x: torch.Tensor, sel: list[int]) -> torch.Tensor:
    """x[sel] along dim 0, without an index when sel is every row in order."""
    return x if len(sel) == x.shape[0] else x[_to_device(sel, x.device)]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """[R, 1] fp32: one per-row parameter, shaped to broadcast against [R, V]."""
    return _to_device(values, device, torch.float32).unsqueeze(1)


def _token_counts(seqs: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[S, V] fp32: how many times each token id occurs in each of the S sequences."""
    lengths = _to_device([len(s) for s in seqs], device)
    tokens = _to_device(list(itertools.chain.from_iterable(seqs)), device)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths,
                                           output_size=len(tokens))
    counts = torch.bincount(seq_of_token * vocab_size + tokens, minlength=len(seqs) * vocab_size)
    return counts.view(len(seqs), vocab_size).float()


def has_penalty(p: SamplingParams) -> bool:
    """Whether sampling reads the values of the row's earlier tokens."""
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on logits [B, V]. Repetition (HF/vLLM): a seen token's logit is divided by the
    penalty when > 0, multiplied when <= 0. OpenAI: logit -= frequency * count + presence * [count > 0]."""
    sel = [b for b, row in enumerate(rows) if has_penalty(row.params)]
    if not sel:
        return
    params = [rows[b].params for b in sel]
    device, vocab_size = logits.device, logits.shape[1]
    index = _to_device(sel, device)
    sub = logits[index]  # [S, V]
    output_counts = _token_counts([rows[b].output_token_ids for b in sel], vocab_size, device)
    in_output = output_counts > 0
    if any(p.repetition_penalty != 1 for p in params):
        in_prompt = _token_counts([rows[b].prompt_token_ids for b in sel], vocab_size, device) > 0
        penalty = _column([p.repetition_penalty for p in params], device)
        penalty = torch.where(in_prompt | in_output, penalty, 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    sub -= _column([p.frequency_penalty for p in params], device) * output_counts
    sub -= _column([p.presence_penalty for p in params], device) * in_output
    logits[index] = sub


def _choose(logits: torch.Tensor, rows: Sequence[SamplingRow], whole_vocab: bool) -> torch.Tensor:
    """[B] int64: argmax of the penalised logits for greedy rows, a draw for the others."""
    greedy = [b for b, row in enumerate(rows) if row.params.greedy]
    if len(greedy) == len(rows):
        return logits.argmax(-1)
    if not greedy:
        return _draw(logits, rows, whole_vocab)
    token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    at = _to_device(greedy, logits.device)
    token_ids[at] = logits[at].argmax(-1)
    drawn = [b for b, row in enumerate(rows) if not row.params.greedy]
    at = _to_device(drawn, logits.device)
    token_ids[at] = _draw(logits[at], [rows[b] for b in drawn], whole_vocab)
    return token_ids


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow], whole_vocab: bool) -> torch.Tensor:
    """logits: [R, V] penalised, rows not greedy. Returns [R] int64 sampled token ids.
    whole_vocab: top-k / top-p sort every row's whole vocabulary (see `_top_k_top_p`)."""
    params = [row.params for row in rows]
    device = logits.device
    logits = logits / _column([p.temperature for p in params], device)
    if any(p.top_k or p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params], whole_vocab)
    probs = logits.softmax(-1)
    if any(p.min_p > 0 for p in params):
        min_p = _column([p.min_p for p in params], device)
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return _race(probs, rows)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float], whole_vocab: bool = False) -> torch.Tensor:
    """logits: [R, V]. Keep each row's k largest logits (k = 0: all), then the smallest
    most-likely set whose probability mass reaches p (at least one token)."""
    vocab_size = logits.shape[1]
    k = [k or vocab_size for k in top_k]
    # When every row has a top_k, no row keeps a token outside the largest max(k): skip the full
    # sort -- unless whole_vocab (deterministic mode): a row's softmax and cumsum over W values
    # would depend on the other rows' k (W = max k), and topk's order of tied values on its
    # algorithm, which follows the batch; a stable sort orders ties by token id, always.
    if whole_vocab:
        values, order = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    else:
        values, order = logits.topk(max(k), dim=-1)  # [R, W], descending
    kth_largest = values.gather(1, _to_device(k, logits.device).unsqueeze(1) - 1)  # [R, 1]
    values = values.masked_fill(values < kth_largest, float("-inf"))
    probs = values.softmax(-1)
    # [R, W]: mass of the strictly more likely tokens. whole_vocab: one row at a time, as torch
    # picks its scan by the tensor's shape (a lone row's differs from a batch's on CUDA)
    cumsum = torch.cat([probs[r:r + 1].cumsum(-1) for r in range(probs.shape[0])]) if whole_vocab \
        else probs.cumsum(-1)
    mass_before = cumsum - probs
    values = values.masked_fill(mass_before >= _column(top_p, logits.device), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values)


def _race(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[R] int64: argmax_t probs[r, t] / E[r, t], E i.i.d. Exp(1). A seeded row's E is a
    function of (seed, step, token) only (`race`); unseeded rows draw from torch's generator."""
    seeds = {r: row.sample_seed for r, row in enumerate(rows) if row.sample_seed is not None}
    seeded = list(seeds)
    winners = torch.empty(0, dtype=torch.int64, device=probs.device)
    if len(seeded) < len(rows):
        unseeded = [r for r, row in enumerate(rows) if row.sample_seed is None]
        sub = _rows(probs, unseeded)
        # E = -ln u, u uniform in [0, 1) (24 bits, as torch's exponential_ on CUDA): E > 0, so a
        # zero-probability token never wins through 0 / 0 = nan; u = 0 (2^-24 of the draws)
        # gives E = inf, a token that cannot win. On the CPU 5x faster than exponential_
        # (0.17 against 0.87 s at 1,024 x 32,000).
        noise = torch.empty_like(sub).uniform_().log_().neg_()
        winners = (sub / noise).argmax(-1)
        if not seeded:
            return winners
    keys = race.row_keys(_to_device(list(seeds.values()), probs.device),
                         _to_device([len(rows[r].output_token_ids) for r in seeded], probs.device))
    drawn = race.seeded_race(_rows(probs, seeded).contiguous(), keys)
    if len(seeded) == len(rows):
        return drawn
    out = torch.empty(len(rows), dtype=torch.int64, device=probs.device)
    out[_to_device(unseeded, probs.device)] = winners
    out[_to_device(seeded, probs.device)] = drawn
    return out


@dataclasses.dataclass(frozen=True)
class _LogprobTensors:
    """The logprobs of the rows that ask for them, as device tensors until `entries`."""

    rows: list[int]  # the batch rows with params.logprobs set
    limits: list[int]  # their params.logprobs
    batch: int
    tensors: tuple[torch.Tensor, ...]  # sampled [S], its logprob [S], its rank [S], top ids/lps/ranks [S, k]

    @classmethod
    def of(cls, raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow],
           stable: bool = False) -> _LogprobTensors | None:
        """raw: [B, V] unprocessed logits; token_ids: [B]. The sampled token first, then the
        top-k, ranked 1 + (number of tokens with a strictly larger logprob)."""
        asked = {b: row.params.logprobs for b, row in enumerate(rows) if row.params.logprobs is not None}
        if not asked:
            return None
        sel, limits = list(asked), list(asked.values())
        logprobs = _rows(raw, sel).log_softmax(-1)  # [S, V]
        sampled = _rows(token_ids, sel).unsqueeze(1)  # [S, 1]
        sampled_lp = logprobs.gather(1, sampled)  # [S, 1]
        sampled_rank = (logprobs > sampled_lp).sum(-1) + 1  # [S]
        k = min(max(limits), logprobs.shape[1])
        if stable:  # ties by token id, whatever the batch (topk's tie order follows its algorithm)
            top_lp, top_ids = (t[:, :k] for t in logprobs.sort(dim=-1, descending=True, stable=True))
        else:
            top_lp, top_ids = logprobs.topk(k, dim=-1)  # [S, k], descending
        # Every token more likely than top-k entry j is an earlier top-k entry: count those only.
        top_rank = (top_lp.unsqueeze(1) > top_lp.unsqueeze(2)).sum(-1) + 1  # [S, k]
        return cls(sel, limits, len(rows), (sampled[:, 0], sampled_lp[:, 0], sampled_rank, top_ids, top_lp, top_rank))

    def entries(self, host: list[list[Any]]) -> list[dict[int, Logprob] | None]:
        """host: `tensors` as lists -> one {token: Logprob} per batch row (None: not asked)."""
        out: list[dict[int, Logprob] | None] = [None] * self.batch
        for s, (b, limit) in enumerate(zip(self.rows, self.limits, strict=True)):
            ids, lps, ranks = (h[s][:limit] for h in host[3:])
            entry = {host[0][s]: Logprob(host[1][s], host[2][s])}
            entry.update((t, Logprob(lp, rank)) for t, lp, rank in zip(ids, lps, ranks, strict=True))
            out[b] = entry
        return out
