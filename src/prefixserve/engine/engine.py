"""The engine: requests in, outputs out; `step()` is schedule -> launch -> collect.

Overlapped scheduling (`overlap_schedule`, on by default; SGLang's overlap scheduler, vLLM's
async scheduling). Step t+1 is scheduled and launched before step t's tokens are read, so
the host's bookkeeping runs while the device computes:

    host:    | schedule t+1 | launch t+1 | read t, stops, outputs | schedule t+2 | launch t+2 | ...
    device:  ... step t ...][........... step t+1 ...........................][ step t+2 ...

Each sequence's token from step t is PENDING meanwhile (request.py): step t+1 takes its value
on the device, and a sequence that step t stopped has its step t+1 token dropped. Requests
with penalties need the values of their tokens on the host, and tensor-parallel workers get
their inputs from the host: while any is running, steps run one at a time.

A step that raises ends only the requests it touched (the sequences it scheduled and those
of the steps still in flight): they finish with `finish_reason == STEP_ERROR`, their paths
are released (tokens the failed step computed were never marked computed, so no cached node
claims K/V it does not hold), and the engine serves on. Failures that leave the engine in an
unknown state are re-raised: any failure under tensor parallelism (the ranks may disagree on
what ran) and device errors (a CUDA error poisons the context).

The scheduler keeps the sequences' and the tree's bookkeeping (`on_launched`, `on_sampled`,
pins); the engine adds what needs the tokenizer and the model (detokenization, stop checks,
validation). Everything outside the engine package reads its state through `stats()` and the
public properties below, never through the scheduler, runner or backend.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from ..config import EngineConfig, ModelConfig
from ..kvcache.prefix_tree import PUBLIC, Partition, PrefixTree
from ..model import loader
from ..model.parallel import TPGroup, check_divides
from ..sampling_params import Logprob, SamplingParams
from . import heap
from .detokenizer import with_decoded_tokens
from .model_runner import Launched, ModelRunner, StepTiming
from .pins import Pin, PinTable
from .request import Request, RequestOutput, Sequence
from .sampler import Sampler, has_penalty
from .scheduler import Scheduler, SchedulerOutput
from .stops import check_stop
from .workers import Workers, build_rank

log = logging.getLogger(__name__)

STEP_ERROR = "error"  # the finish reason of a request whose step raised

@dataclasses.dataclass(frozen=True)
class TenantUsage:
    tenant: str
    prompt_tokens: int  # cumulative, over admitted sequences
    cached_tokens: int  # of those, found in the tree at admission
    pinned_tokens: int  # now, in the tenant's active pins


@dataclasses.dataclass(frozen=True)
class KVCacheStats:
    capacity_tokens: int
    physical_tokens: int  # token slots of allocated chunks (in use or cached)
    peak_physical_tokens: int
    in_use_tokens: int  # slots of chunks held by running sequences or pins
    cached_tokens: int
    logical_tokens: int  # sum of running sequences' lengths
    pinned_tokens: int
    prompt_tokens: int  # cumulative, over admitted sequences
    prefix_hit_tokens: int  # prompt tokens found in the tree at admission
    computed_prompt_tokens: int  # prompt tokens run through the model
    tenants: tuple[TenantUsage, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's state for readers outside it (AsyncEngine, metrics, benchmarks)."""

    running_requests: int  # requests with a sequence running
    waiting_requests: int  # requests waiting to be scheduled (none of their sequences running)
    kv: KVCacheStats
    schedule: str  # the attention schedule the last step ran (the backend's name unless `auto`)
    preemptions: int  # cumulative


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        heap.thaw()  # (what an engine dropped unclosed left frozen, before this one takes memory)
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        tp = cfg.tensor_parallel_size
        if tp > 1:
            check_divides(ModelConfig.from_hf(loader.resolve(cfg).config), tp)
        self.workers = Workers(cfg) if tp > 1 else None
        try:
            rank = build_rank(cfg, TPGroup(0, tp, cfg.deterministic))
        except BaseException:
            if self.workers:
                self.workers.kill()
            raise
        self.device, self.dtype, self.model, self.pool = rank.device, rank.dtype, rank.model, rank.pool
        self.backend = rank.backend
        self.model_name, self.hf_config = rank.source.name, rank.source.config
        self.tokenizer = loader.load_tokenizer(rank.source, cfg.tokenizer)
        m = self.model.cfg
        self.max_model_len = cfg.max_model_len or m.max_position_embeddings
        if self.max_model_len > m.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's %d positions: outputs past them are "
                        "extrapolated (fine for speed benchmarks on dummy weights)",
                        self.max_model_len, m.max_position_embeddings)
        log.info("KV cache: %d chunks of %d tokens", self.pool.num_chunks, self.pool.chunk_size)
        self.tree = PrefixTree(self.pool, cfg.cache.enable_prefix_caching)  # written only by the scheduler
        self.scheduler = Scheduler(cfg.scheduler, self.tree)
        if self.max_sequence_tokens < 2:  # a prompt token and a generated one
            self.close()
            raise ValueError(f"the KV cache ({self.pool.num_chunks} chunks of {self.pool.chunk_size} tokens, with "
                             "one kept spare) cannot hold a single sequence; raise kv_cache_memory")
        self.eos_token_ids = self._eos_ids()
        self.runner = ModelRunner(rank, self.tree, Sampler(self.eos_token_ids, cfg.deterministic), self.workers)
        self.requests: dict[str, Request] = {}
        self.pins = PinTable(cfg.cache.max_pinned_tokens_per_tenant)
        self._inflight: collections.deque[Launched] = collections.deque()
        self._penalized: set[str] = set()  # running requests with penalties (they need token values)
        self._seq_ids = itertools.count()
        self._stepping: list[Sequence] = []  # the sequences the current step scheduled
        self.peak_physical_tokens = 0
        heap.freeze()  # (after everything start-up builds: see heap.py)

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine is unusable afterwards."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        heap.unfreeze()  # (collecting here would free nothing of this engine: it is still held)

    # ---- the heartbeat ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except Exception as e:
            if self.workers is not None:
                raise self.workers.failure(e) from e
            if isinstance(e, torch.AcceleratorError):
                raise
            log.exception("a step failed; its requests end with finish_reason %r", STEP_ERROR)
            return self._fail_step()

    def _step(self) -> list[RequestOutput]:
        self._expire_pins()
        overlap = self._can_overlap()
        outputs = [] if overlap else self._collect_all(keep=0)
        self._stepping = []
        sched = self.scheduler.schedule()
        self._stepping = [g.seq for g in sched.seqs] + [f for f, _ in sched.forks]
        if sched.seqs:
            self._inflight.append(self._launch(sched))
        outputs += self._collect_all(keep=1 if overlap and sched.seqs else 0)
        return outputs + self._settle_pins()

    def _fail_step(self) -> list[RequestOutput]:
        """End every request of the failed step and of the steps in flight (their tokens are
        never read). A failure before scheduling ended names no sequence: then all running fail."""
        seqs = self._stepping or list(self.scheduler.running)
        seqs += [seq for launched in self._inflight for seq in launched.rows]
        self._inflight.clear()
        self._stepping = []
        self.runner.forget()
        failed = {seq.request.request_id: seq.request for seq in seqs}
        for req in failed.values():
            for seq in req.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, STEP_ERROR)
            self.requests.pop(req.request_id, None)
            self._penalized.discard(req.request_id)
            self.pins.discard_pending(req.request_id)  # a pin whose prefill failed is not made
        return [req.output() for req in failed.values()]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _can_overlap(self) -> bool:
        return self.cfg.scheduler.overlap_schedule and self.workers is None and not self._penalized

    @property
    def waits_for_previous(self) -> bool:
        """Whether the next `step` spends its time on the batch the step before launched: it
        launches its own and collects the one before (overlapped scheduling), and the device
        runs launches asynchronously (CUDA; on the CPU a launch computes before it returns)."""
        return self._can_overlap() and torch.device(self.device).type == "cuda"

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens (prompt + generated) one sequence can ever hold: the context, or what
        the KV cache can give it beside the pinned chunks with one chunk to spare."""
        return min(self.max_model_len,
                   (self.pool.num_chunks - self.scheduler.pinned_chunks - 1) * self.pool.chunk_size)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def last_schedule(self) -> str:
        """The attention schedule the last step ran (the backend's name unless `auto`)."""
        return self.backend.chosen or self.backend.name

    @property
    def chunk_size(self) -> int:
        return self.pool.chunk_size

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def set_step_profiling(self, on: bool) -> None:
        """CUDA: time each step with events (no extra sync); read with `take_step_timing`."""
        self.runner.profile = on

    def take_step_timing(self) -> StepTiming | None:
        """The timing of the last profiled step collected since the last call, if any."""
        timing, self.runner.timing = self.runner.timing, None
        return timing

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *, tenant: str = "", cache_salt: str = "") -> Request:
        """Queue a request. It shares cached prefixes only with requests of the same tenant and
        cache salt, and with public pins (kvcache/prefix_tree.py)."""
        self._expire_pins()  # before validating: what they held is room the request may use
        text, ids = self._tokenize(prompt)
        return self._add(request_id, text, ids, params, False, tenant, Partition(tenant, cache_salt))

    def _add(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
             prefill_only: bool, tenant: str, partition: Partition) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self._validate(ids, params, prefill_only)
        req = Request(request_id, text, ids, params, prefill_only, tenant, partition)
        if has_penalty(params):
            self._penalized.add(request_id)
        for i in range(1 if prefill_only else params.n):
            seq = Sequence(next(self._seq_ids), req, i, self.tokenizer)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str) -> None:
        self.pins.discard_pending(request_id)
        req = self.requests.pop(request_id, None)
        self._penalized.discard(request_id)
        for seq in req.seqs if req else ():
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    # ---- pinned prefixes (RelayAttention's system KV, filled once; engine/pins.py) ------------
    def add_pin(self, pin_id: str, prompt: str | list[int], *, tenant: str = "", cache_salt: str = "",
                public: bool = False, ttl: float | None = None) -> Request:
        """Start pinning `prompt`: the next steps prefill it like any request, which then finishes
        with reason "pinned" (active) or "refused" (it did not fit; nothing pinned). A public pin
        is read by every partition, a private one by (tenant, cache_salt). ValueError: a bad
        prompt or ttl, the tenant's quota, or a pin that cannot fit beside the live sequences."""
        if not self.cfg.cache.enable_prefix_caching:
            raise ValueError("pinned prefixes need enable_prefix_caching=True")
        if ttl is not None and not (isinstance(ttl, (int, float)) and 0 < ttl < float("inf")):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self._expire_pins()
        text, ids = self._tokenize(prompt)
        if not self._pin_fits(-(-len(ids) // self.pool.chunk_size)):
            pinned = self.scheduler.pinned_chunks * self.pool.chunk_size
            raise ValueError(f"a pin of {len(ids)} tokens does not fit in the KV cache beside "
                             f"{pinned} pinned tokens and the running requests")
        partition = PUBLIC if public else Partition(tenant, cache_salt)
        self.pins.add(Pin(pin_id, tenant, partition, ids, ttl))
        try:
            return self._add(pin_id, text, ids, SamplingParams(max_tokens=1), True, tenant, partition)
        except ValueError:
            self.pins.discard_pending(pin_id)
            raise

    def pin_prefix(self, prompt: str | list[int], **kwargs: Any) -> Pin:
        """`add_pin` (`kwargs`: its keywords), then step until it is settled (offline use and
        start-up: nothing else may be in flight, as this drops other requests' outputs). Raises
        ValueError if refused."""
        pin_id = f"pin-{next(self._seq_ids)}"
        req = self.add_pin(pin_id, prompt, **kwargs)
        while not req.finished:
            self.step()
        if req.seqs[0].finish_reason == STEP_ERROR:
            raise RuntimeError(f"pinning a prefix of {len(req.prompt_token_ids)} tokens failed (see the log)")
        if req.seqs[0].finish_reason != "pinned":
            raise ValueError(f"the pin of {len(req.prompt_token_ids)} tokens does not fit in the KV cache")
        return self.pins.pins[pin_id]

    def unpin(self, pin_id: str, owner: str | None = None) -> Pin:
        """Remove a pin (pending or active) made by `owner` (None: by anyone). ValueError if none."""
        pin = self.pins.pins.get(pin_id)
        if pin is None or owner is not None and pin.owner != owner:
            raise ValueError(f"no pinned prefix {pin_id!r}")
        if pin.leaf is not None:  # active
            del self.pins.pins[pin_id]
            self.scheduler.unpin(pin.leaf)
        else:
            self.abort(pin_id)
        return pin

    def _pin_fits(self, extra_chunks: int) -> bool:
        """Pinned chunks, plus `extra_chunks`, plus the largest live sequence at its longest,
        plus one spare chunk, fit in the pool."""
        C = self.pool.chunk_size
        live = (s for s in self.scheduler.live() if not s.request.prefill_only)
        need = max((-(-(len(s.prompt_token_ids) + s.max_tokens) // C) for s in live), default=1)
        return self.scheduler.pinned_chunks + extra_chunks + need + 1 <= self.pool.num_chunks

    def _settle_pins(self) -> list[RequestOutput]:
        """Pin the pending pins whose prompts are computed (or refuse them), ending their requests."""
        outputs = []
        for pin in self.pins.pending():
            seq = self.requests[pin.id].seqs[0]
            if not self.scheduler.prompt_computed(seq):
                continue
            if self._pin_fits(self.scheduler.chunks_to_pin(seq)):
                self.pins.activate(pin, self.scheduler.pin(seq), time.time())
                self.scheduler.finish(seq, "pinned")
            else:
                self.pins.discard_pending(pin.id)
                self.scheduler.finish(seq, "refused")
            outputs.append(self.requests.pop(pin.id).output())
        return outputs

    def _expire_pins(self) -> None:
        for pin in self.pins.expired(time.time()):
            log.info("pinned prefix %s (%d tokens) expired", pin.id, len(pin.token_ids))
            self.unpin(pin.id)

    def list_pins(self, owner: str | None = None) -> list[Pin]:
        """The owner's pins (None: all), after dropping the expired ones."""
        self._expire_pins()
        return self.pins.visible_to(owner)

    # ---- state ------------------------------------------------------------------------------
    def _track_peak(self) -> None:
        """O(1): every allocated chunk is in use or cached."""
        physical = (self.pool.num_chunks - self.pool.num_free) * self.pool.chunk_size
        self.peak_physical_tokens = max(self.peak_physical_tokens, physical)

    def stats(self) -> EngineStats:
        running, waiting = self.scheduler.num_requests()
        return EngineStats(running, waiting, self.kv_cache_stats(), self.last_schedule,
                           self.scheduler.num_preemptions)

    def kv_cache_stats(self) -> KVCacheStats:
        C, sched = self.pool.chunk_size, self.scheduler
        counts = sched.chunk_counts()
        physical = (counts["in_use"] + counts["cached"]) * C
        self._track_peak()
        return KVCacheStats(
            capacity_tokens=self.pool.num_chunks * C, physical_tokens=physical,
            peak_physical_tokens=self.peak_physical_tokens, in_use_tokens=counts["in_use"] * C,
            cached_tokens=counts["cached"] * C, logical_tokens=sched.logical_tokens(),
            pinned_tokens=sched.pinned_tokens(), prompt_tokens=sched.prompt_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            computed_prompt_tokens=sched.computed_prompt_tokens, tenants=self._tenant_usage())

    def _tenant_usage(self) -> tuple[TenantUsage, ...]:
        pinned = self.pins.pinned_tokens_by_owner()
        counts = self.scheduler.tenant_tokens
        usage = []
        for t in sorted(counts.keys() | pinned.keys()):
            prompt_tokens, cached_tokens = counts.get(t, (0, 0))
            usage.append(TenantUsage(t, prompt_tokens, cached_tokens, pinned.get(t, 0)))
        return tuple(usage)

    def check_integrity(self) -> None:
        pins = self.pins.pins.values()
        self.scheduler.check_integrity(p.leaf for p in pins if p.leaf is not None)
        for pin in pins:
            assert pin.active or pin.id in self.requests, f"pending pin {pin.id} has no request"

    # ---- internals --------------------------------------------------------------------------
    def _launch(self, sched: SchedulerOutput) -> Launched:
        """Queue the step; its K/V counts as computed from now on (later steps queue behind it),
        and each sampled row's token is PENDING until collected."""
        step = self.runner.launch(sched)
        self.scheduler.on_launched(sched)
        self._track_peak()
        return step

    def _collect_all(self, keep: int) -> list[RequestOutput]:
        """Read the launched steps' tokens, oldest first, until `keep` remain in flight."""
        outputs = []
        while len(self._inflight) > keep:
            outputs += self._collect(self._inflight.popleft())
        return outputs

    def _collect(self, step: Launched) -> list[RequestOutput]:
        sampled = self.runner.collect(step)
        if sampled is None:
            return []
        def stop(seq: Sequence, row: int, token: int) -> str | None:
            return self._postprocess(seq, token, sampled.logprobs[row])
        touched = self.scheduler.on_sampled(step.rows, sampled.token_ids, stop)
        outputs = [req.output() for req in touched.values()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
                self._penalized.discard(out.request_id)
        return outputs

    def _postprocess(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> str | None:
        """A token read for `seq`: logprobs, detokenization; -> its finish reason, if it stops."""
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if seq.logprobs is not None:
            assert logprobs is not None, "the sampler ranks every row that asks for logprobs"
            seq.logprobs.append(with_decoded_tokens(self.tokenizer, logprobs) if self.tokenizer else logprobs)
        delta = seq.detok.append(token) if seq.detok else ""
        return check_stop(seq, token, delta, self.eos_token_ids, self.max_model_len)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return None, ids

    def _validate(self, ids: list[int], params: SamplingParams, prefill_only: bool) -> SamplingParams:
        if not ids:
            raise ValueError("the prompt is empty")
        params = params.for_model(self.vocab_size)
        max_len = self.max_model_len
        if len(ids) + (0 if prefill_only else 1) > max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {max_len} "
                             "tokens including at least one generated token")
        C, room = self.pool.chunk_size, self.max_sequence_tokens
        max_tokens = params.max_tokens if params.max_tokens is not None else room - len(ids)
        if len(ids) + max_tokens > max_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the context of {max_len} tokens")
        if len(ids) + max_tokens > room or max_tokens < 1:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) can never fit "
                             f"in the KV cache of {self.pool.num_chunks * C} tokens; "
                             "raise kv_cache_memory or lower max_tokens")
        if self.cfg.deterministic and params.seed is None:  # draws from the global generator depend on the batch
            params = dataclasses.replace(params, seed=self.cfg.seed)
        return dataclasses.replace(params, max_tokens=max_tokens) if params.max_tokens is None else params

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        eos = self.hf_config.get("eos_token_id")
        ids.update([] if eos is None else [eos] if isinstance(eos, int) else eos)
        return tuple(sorted(ids))
