"""`prefixserve bench serve` against real `prefixserve serve` processes (one per config), and
its statistics on hand-made timelines."""

from __future__ import annotations

import json

import pytest

from prefixserve.bench.loadgen import RequestRecord, summarize
from prefixserve.bench.server_process import engine_flags
from prefixserve.bench.serving import sustainable_rates
from prefixserve.cli import main


def test_tiny_sweep_against_real_servers(tmp_path):
    argv = ["bench", "serve", "--configs", "paged-nocache,auto", "--request-rate", "20,inf", "--num-prompts", "3",
            "--system-prompt-len", "40", "--max-output-len", "5", "--max-prompt-len", "40", "--latency-slo", "30",
            "--kv-cache-memory", str(64 << 20), "--threads", "1", "--no-progress", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("serve-sharegpt-SmolLM2-135M-Instruct-*.json")
    assert path.with_suffix(".png").stat().st_size > 10_000
    doc = json.loads(path.read_text())
    assert doc["system_prompt_len"] == 40 and doc["latency_slo_s"] == 30
    assert [(e["config"], e["request_rate"]) for e in doc["results"]] == [
        ("paged-nocache", 20.0), ("paged-nocache", "inf"), ("auto", 20.0), ("auto", "inf")]
    for e in doc["results"]:
        assert e["completed"] == 3 and e["failed"] == 0, e["errors"]
        assert 3 * 4 <= e["output_tokens"] <= 3 * 5 and e["output_tokens_per_s"] > 0
        assert 0 < e["ttft_p50_s"] <= e["latency_mean_s"] * 3 and e["itl_p50_s"] > 0
        assert e["normalized_latency_mean_s"] > 0
    assert doc["sustainable_request_rate"] == {"paged-nocache": "inf", "auto": "inf"}
    cached = [e["cached_prompt_tokens"] for e in doc["results"] if e["config"] == "auto"]
    assert all(c >= 3 * 40 for c in cached), "the system prompt is served from the cache"
    assert all(e["cached_prompt_tokens"] == 0 for e in doc["results"] if e["config"] == "paged-nocache")


def _record(sent, chunks, tokens, error=None):
    return RequestRecord(10, sent, chunks, chunks[-1] if chunks else None, tokens, 0, error)


def test_summary_statistics():
    recs = [_record(0.0, [1.0, 1.5, 2.0], 4), _record(1.0, [1.5, 3.0], 2), _record(2.0, [], 0, "HTTP 500")]
    s = summarize(recs, duration=4.0)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 6)
    assert s["output_tokens_per_s"] == 1.5 and s["requests_per_s"] == 0.5
    assert s["normalized_latency_mean_s"] == pytest.approx((2.0 / 4 + 2.0 / 2) / 2)
    assert s["ttft_mean_s"] == pytest.approx(0.75) and s["itl_p50_s"] == pytest.approx(0.5)
    assert s["errors"] == ["HTTP 500"]


def test_sustainable_rate_is_the_highest_within_slo():
    rows = [("a", 1, 0.1, 0), ("a", 2, 0.4, 0), ("a", 4, 0.9, 0), ("b", 1, 0.2, 0), ("b", 2, 0.3, 1)]
    entries = [dict(config=c, request_rate=r, normalized_latency_mean_s=lat, failed=f) for c, r, lat, f in rows]
    entries.append(dict(config="c", request_rate=1, normalized_latency_mean_s=0.7, failed=0))
    assert sustainable_rates(entries, 0.5) == {"a": 2, "b": 1, "c": None}


def test_engine_flags_spell_the_cli():
    assert engine_flags({"attention_backend": "relay", "enable_prefix_caching": False, "model": None,
                         "kv_cache_memory": 5}) == ["--attention-backend", "relay", "--no-enable-prefix-caching",
                                                    "--kv-cache-memory", "5"]


def test_engine_flags_parse_back_as_the_same_settings():
    """What a benchmark passes its servers must parse back to the same values (a float flag
    parsed as int once made every started server exit 2)."""
    from prefixserve.cli import build_parser, engine_kwargs
    settings = engine_kwargs(build_parser().parse_args(["serve", "--tp-join-timeout", "2.5"]))
    again = engine_kwargs(build_parser().parse_args(["serve", *engine_flags(settings)]))
    assert again == settings and again["tp_join_timeout"] == 2.5


def test_multi_tenant_on_one_process_reaches_the_ideal_hit_ratio(tmp_path):
    """One process has one cache: every request after its tenant's first hits the tenant's system
    prompt, so the measured cache-hit ratio is the ideal one (the scale-out run compares routers
    against this same ideal)."""
    argv = ["bench", "serve", "--workload", "multi-tenant", "--tenants", "3", "--configs", "auto",
            "--request-rate", "8", "--num-prompts", "7", "--system-prompt-len", "40", "--max-output-len", "3",
            "--max-prompt-len", "40", "--kv-cache-memory", str(64 << 20), "--threads", "1", "--no-progress",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("serve-multi-tenant-SmolLM2-135M-Instruct-*.json")
    assert path.with_suffix(".png").stat().st_size > 10_000
    (e,) = json.loads(path.read_text())["results"]
    assert e["completed"] == 7 and e["failed"] == 0, e["errors"]
    assert e["tenants"] == 3 and e["router"] is None and e["replicas_per_tenant_mean"] is None
    assert e["ideal_cache_hit_ratio"] > 0.3 and e["cache_hit_ratio"] == e["ideal_cache_hit_ratio"]
    assert e["computed_prompt_tokens"] == e["ideal_computed_prompt_tokens"] < e["prompt_tokens"]
    assert e["ttft_p99_s"] >= e["ttft_p50_s"] > 0 and e["itl_p50_s"] > 0


def test_tenant_stats_count_hits_misses_and_replica_spread():
    from prefixserve.bench.tenants import tenant_stats
    from prefixserve.bench.workloads import Workload
    sys_a, sys_b = [1] * 10, [2] * 10
    wl = Workload("multi-tenant", [sys_a + [5], sys_b + [6], sys_a + [7], sys_a + [8]], [], {}, 10, (0, 1, 0, 0))
    recs = [RequestRecord(11, 0.0, [1.0], 2.0, 3, cached, None, replica)
            for cached, replica in ((0, "r1"), (0, "r2"), (10, "r1"), (0, "r3"))]
    s = tenant_stats(wl, recs)
    assert s["ideal_cache_hit_ratio"] == round(20 / 44, 4) and s["cache_hit_ratio"] == round(10 / 44, 4)
    assert s["hit_ratio_vs_ideal"] == 0.5 and s["computed_prompt_tokens"] == 34
    assert s["replicas"] == 3 and s["replicas_per_tenant_mean"] == 1.5  # tenant 0 on r1 and r3, tenant 1 on r2
