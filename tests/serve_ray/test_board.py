"""The board's /health and /metrics answers, from replicas' reports (no Ray needed)."""

import time

from prometheus_client.parser import text_string_to_metric_families

from prefixserve.serve_ray import board
from prefixserve.serve_ray.board import Board, Report, health, merged_metrics
from prefixserve.server.metrics import Metrics


def _report(problem=None, tokens=0):
    m = Metrics("m", "paged")
    m.generation_tokens.inc(tokens)
    return Report("host", 123, problem, m.render()[0].decode())


def test_healthy_while_any_replica_can_serve():
    assert health({}) == "no replica is running"
    assert health({"a": _report("engine failed"), "b": _report()}) is None
    assert "a: engine failed" in health({"a": _report("engine failed")})


def test_stale_reports_are_dropped(monkeypatch):
    b = Board()
    b.report("a", _report())
    assert set(b.read()) == {"a"}
    now = time.monotonic()
    monkeypatch.setattr(board.time, "monotonic", lambda: now + board.STALE_S + 1)
    assert b.read() == {}


def test_metrics_carry_each_replicas_series_with_its_label():
    text = merged_metrics({"r1": _report(tokens=3), "r2": _report(tokens=5)})[0].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["replica"]: s.value for s in families["prefixserve_generation_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens == {"r1": 3.0, "r2": 5.0}
    where = {s.labels["replica"]: s.labels["pid"] for s in families["prefixserve_replica"].samples}
    assert where == {"r1": "123", "r2": "123"}
