"""Prometheus metrics, in the server's own `CollectorRegistry` (never the global one).

Two sources. Per-step events arrive on the engine thread through `StepObserver` (tokens,
time to first token, inter-token latency, finished requests, the attention schedule each step
ran). The engine's state (requests, KV cache, prefix hits) is read at scrape time from the
`AsyncEngine`'s latest snapshot, so a scrape never waits for a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.engine import EngineStats, TenantUsage
from ..engine.request import RequestOutput
from .tenancy import OTHER

_P = "prefixserve_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40, 80)


@dataclasses.dataclass
class _Progress:
    arrival: float
    last_token: float = 0.0
    tokens: int = 0


class Metrics:
    """Implements the engine's StepObserver; `render()` gives the exposition text."""

    def __init__(self, model_name: str, backend: str, tenants: Iterable[str] = ()):
        self.tenants = frozenset(tenants)  # the label values allowed: the keys' tenants (others: OTHER)
        self.registry = CollectorRegistry()
        r = self.registry
        Info(_P + "attention_backend", "attention backend the engine was built with", registry=r).info(
            {"backend": backend, "model": model_name})
        self.schedule_steps = Counter(_P + "attention_schedule_steps", "engine steps by the attention "
                                      "schedule they ran (auto picks one per step)", ["schedule"], registry=r)
        self.generation_tokens = Counter(_P + "generation_tokens", "tokens generated (rate() = tokens/s)", registry=r)
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "arrival at the engine to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(_P + "inter_token_latency_seconds", "time between a request's successive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(_P + "request_latency_seconds", "arrival at the engine to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter(_P + "requests_finished", "requests finished, by reason: "
                                "length (a sample hit max_tokens or the context), stop, abort", ["reason"], registry=r)
        self.errors = Counter(_P + "request_errors", "requests answered with an error, by status", ["status"],
                              registry=r)
        self._progress: dict[str, _Progress] = {}  # engine thread only

    def watch(self, snapshot: Callable[[], EngineStats]) -> None:
        self.registry.register(_SnapshotCollector(snapshot, self.tenants))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def count_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    # ---- StepObserver (the engine thread) ----------------------------------------------------------
    def on_add(self, request_id: str, now: float) -> None:
        self._progress[request_id] = _Progress(arrival=now)

    def on_step(self, outputs: list[RequestOutput], schedule: str, now: float) -> None:
        self.schedule_steps.labels(schedule).inc()
        for out in outputs:
            p = self._progress.get(out.request_id)
            if p is None:
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if tokens > p.tokens:
                self.generation_tokens.inc(tokens - p.tokens)
                (self.ttft if p.tokens == 0 else self.itl).observe(now - (p.last_token if p.tokens else p.arrival))
                p.tokens, p.last_token = tokens, now
            if out.finished:
                self.e2e.observe(now - p.arrival)
                length = any(c.finish_reason == "length" for c in out.outputs)
                self.finished.labels("length" if length else "stop").inc()
                del self._progress[out.request_id]

    def on_remove(self, request_id: str) -> None:
        if self._progress.pop(request_id, None) is not None:
            self.finished.labels("abort").inc()


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats], tenants: frozenset[str]):
        self._snapshot, self._tenants = snapshot, tenants

    def collect(self):
        s = self._snapshot()
        kv = s.kv
        yield _gauge("requests_running", "requests with a sequence running", s.running_requests)
        yield _gauge("requests_waiting", "requests waiting to be scheduled", s.waiting_requests)
        yield _gauge("kv_cache_usage_ratio", "fraction of KV slots held by running sequences or pins",
                     kv.in_use_tokens / max(1, kv.capacity_tokens))
        states = GaugeMetricFamily(_P + "kv_cache_tokens", "KV cache token slots by state "
                                   "(logical = the running sequences' lengths, before sharing)", labels=["state"])
        for state in ("capacity", "physical", "peak_physical", "in_use", "cached", "pinned", "logical"):
            states.add_metric([state], getattr(kv, f"{state}_tokens"))
        yield states
        yield _gauge("kv_shared_tokens", "what sharing saves: running sequences' tokens beyond the slots "
                     "in use (approximate: slots count whole chunks)", max(0, kv.logical_tokens - kv.in_use_tokens))
        yield _gauge("prefix_cache_hit_rate", "prompt tokens found in the prefix tree / prompt tokens",
                     kv.prefix_hit_tokens / max(1, kv.prompt_tokens))
        yield _counter("prompt_tokens", "prompt tokens of admitted requests", kv.prompt_tokens)
        yield _counter("prefix_cache_hit_tokens", "prompt tokens found in the prefix tree", kv.prefix_hit_tokens)
        yield _counter("computed_prompt_tokens", "prompt tokens run through the model", kv.computed_prompt_tokens)
        yield _counter("preemptions", "sequences preempted (to be recomputed) when the KV cache ran out",
                       s.preemptions)
        yield from _per_tenant(kv.tenants, self._tenants)
        last = GaugeMetricFamily(_P + "attention_schedule", "the attention schedule of the latest step "
                                 "(1 for the one in use)", labels=["schedule"])
        last.add_metric([s.schedule], 1)
        yield last


def _per_tenant(usage: tuple[TenantUsage, ...], known: frozenset[str]):
    """Prompt, cached and pinned tokens by tenant. Labels are bounded: the keys' tenants, and
    OTHER for the rest (the admin's own requests, a server without keys)."""
    sums: dict[str, list[int]] = {t: [0, 0, 0] for t in known}
    for u in usage:
        row = sums.setdefault(u.tenant if u.tenant in known else OTHER, [0, 0, 0])
        for i, v in enumerate((u.prompt_tokens, u.cached_tokens, u.pinned_tokens)):
            row[i] += v
    families: tuple[CounterMetricFamily | GaugeMetricFamily, ...] = (
        CounterMetricFamily(_P + "tenant_prompt_tokens", "prompt tokens of admitted requests, by tenant",
                            labels=["tenant"]),
        CounterMetricFamily(_P + "tenant_cached_tokens", "prompt tokens found in the prefix tree (the "
                            "tenant's partitions and public pins), by tenant", labels=["tenant"]),
        GaugeMetricFamily(_P + "tenant_pinned_tokens", "tokens in the tenant's active private pins",
                          labels=["tenant"]))
    for tenant, row in sorted(sums.items()):
        for family, value in zip(families, row, strict=True):
            family.add_metric([tenant], value)
    yield from families


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_P + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_P + name, doc, value=value)
