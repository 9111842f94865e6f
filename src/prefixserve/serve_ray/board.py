"""The board: where every replica reports its health and its Prometheus text, once a second,
so the ingress can answer /health (is any replica able to serve?) and /metrics (every
replica's series, each with a `replica` label) without reaching every replica per scrape.

A report older than `STALE_S` is ignored: a replica that died (or hangs) drops out of both
within that time, and its restarted successor reports under its own replica id.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPORT_INTERVAL_S = 1.0
STALE_S = 5.0


class Board:
    """A Ray actor (made one by launch.py): replica id -> its latest report."""

    def __init__(self):
        self._reports: dict[str, tuple[float, str | None, str]] = {}

    def report(self, replica: str, problem: str | None, metrics_text: str) -> None:
        self._reports[replica] = (time.monotonic(), problem, metrics_text)

    def read(self) -> dict[str, tuple[str | None, str]]:
        """The fresh reports: replica id -> (health problem or None, Prometheus text)."""
        now = time.monotonic()
        return {r: (problem, text) for r, (t, problem, text) in self._reports.items() if now - t <= STALE_S}


def health(reports: dict[str, tuple[str | None, str]]) -> str | None:
    """None when at least one replica can serve; else why none can."""
    if any(problem is None for problem, _ in reports.values()):
        return None
    if not reports:
        return "no replica is running"
    return "no replica can serve: " + "; ".join(f"{r}: {p}" for r, (p, _) in sorted(reports.items()))


def merged_metrics(reports: dict[str, tuple[str | None, str]]) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(_Merged({r: text for r, (_, text) in reports.items()}))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Merged(Collector):
    """Each replica's families, one family per name, every sample labelled with its replica."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def collect(self):
        families = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, family)
                samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
                if merged is family:
                    family.samples = samples
                else:
                    merged.samples.extend(samples)
        yield from families.values()
