"""The board: where every replica reports its health and its Prometheus text, once a second,
so the ingress can answer /health (is any replica able to serve?) and /metrics (every
replica's series, each with a `replica` label) without reaching every replica per scrape.

A report older than `STALE_S` is ignored: a replica that died (or hangs) drops out of both
within that time, and its restarted successor reports under its own replica id.
"""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPORT_INTERVAL_S = 1.0
STALE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Report:
    node: str              # the host the replica runs on
    pid: int               # its process
    problem: str | None    # why it cannot serve, None when it can
    metrics: str           # its /metrics text


class Board:
    """A Ray actor (made one by launch.py): replica id -> its latest report."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, Report]] = {}

    def report(self, replica: str, report: Report) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def read(self) -> dict[str, Report]:
        """The fresh reports, by replica id."""
        now = time.monotonic()
        return {r: report for r, (t, report) in self._reports.items() if now - t <= STALE_S}


def health(reports: dict[str, Report]) -> str | None:
    """None when at least one replica can serve; else why none can."""
    if any(r.problem is None for r in reports.values()):
        return None
    if not reports:
        return "no replica is running"
    return "no replica can serve: " + "; ".join(f"{name}: {r.problem}" for name, r in sorted(reports.items()))


def merged_metrics(reports: dict[str, Report]) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(_Merged(reports))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Merged(Collector):
    """Each replica's families, one family per name, every sample labelled with its replica;
    and `prefixserve_replica{replica, node, pid}`, which process each replica is."""

    def __init__(self, reports: dict[str, Report]):
        self.reports = reports

    def collect(self):
        where = GaugeMetricFamily("prefixserve_replica", "the replicas reporting now (1 each), and where they "
                                  "run", labels=["replica", "node", "pid"])
        for replica, r in sorted(self.reports.items()):
            where.add_metric([replica, r.node, str(r.pid)], 1)
        yield where
        families = {}
        for replica, text in sorted((name, r.metrics) for name, r in self.reports.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, family)
                samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
                if merged is family:
                    family.samples = samples
                else:
                    merged.samples.extend(samples)
        yield from families.values()
