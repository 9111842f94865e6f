"""`prefixserve bench serve --workload multi-tenant`: scale-out routing, measured.

T tenants, each with its own long system prompt; ShareGPT questions arrive under randomly
chosen tenants as a Poisson process (workloads.multi_tenant). One server per (config, router):
`prefixserve serve --replicas N --router R` (or one process without --replicas). Each rate
gets a fresh set of tenants, so no rate finds another's prompts cached. Reported per run:

    cache_hit_ratio        cached prompt tokens / prompt tokens (`usage.prompt_tokens_details`)
    ideal_cache_hit_ratio  every request after its tenant's first hits the whole system prompt
    computed_prompt_tokens prompt tokens the replicas ran through the model (prompt - cached)
    replicas_per_tenant    distinct `x-prefixserve-replica` values per tenant (1: perfect affinity)

plus loadgen's throughput and latency percentiles (TTFT, inter-token latency = TPOT).
"""

from __future__ import annotations

import asyncio
import logging
import statistics

from . import results as R
from . import workloads as W
from .loadgen import RequestRecord, poisson_run, summarize
from .plots import plot_multi_tenant
from .server_process import scale_out_flags, server

log = logging.getLogger(__name__)


def run_multi_tenant(args, engine_kw: dict) -> int:
    hw, model, load_start = R.hardware(), R.model_name(engine_kw), R.load_average()
    src = W.token_source(engine_kw)
    routers = args.routers if args.replicas else [None]
    entries = []
    for config in args.configs:
        for router in routers:
            with server(args, config, engine_kw, scale_out_flags(args, router)) as url:
                entries += _sweep(args, url, config, router, src)
    doc = _document(args, hw, model, engine_kw, entries)
    doc["load_average"] = {"start": load_start, "end": R.load_average()}
    print_summary(doc)
    R.publish(doc, R.result_path(args.out_dir, "serve", "multi-tenant", model, hw, args.tag), args,
              "prefixserve bench serve", plot_multi_tenant)
    return 0


def _sweep(args, url: str, config: str, router: str | None, src: W.TokenSource) -> list[dict]:
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    label = config if router is None else f"{config}/{router}"
    entries = []
    for i, rate in enumerate(args.request_rate):
        wl = W.multi_tenant(src, args.tenants, args.system_prompt_len, args.num_prompts, args.max_output_len,
                            args.max_prompt_len, args.dataset_seed, run=i)
        records, duration = asyncio.run(poisson_run(
            url, model, wl.prompts, wl.max_tokens, rate, args.dataset_seed + i, headers,
            args.request_timeout, not args.no_progress, f"{label} @ {rate:g} req/s"))
        entries.append({"config": config, "router": router, "label": label, "request_rate": rate,
                        **summarize(records, duration), **tenant_stats(wl, records)})
        log.info("%s @ %g req/s: %s", label, rate, {k: entries[-1][k] for k in
                 ("completed", "failed", "cache_hit_ratio", "ideal_cache_hit_ratio", "output_tokens_per_s")})
    return entries


def tenant_stats(wl: W.Workload, records: list[RequestRecord]) -> dict:
    """Cache hits against the ideal, over all requests (a failed one counts as a miss)."""
    prompt = sum(len(p) for p in wl.prompts)
    cached = sum(r.cached_tokens or 0 for r in records if r.ok)
    spread: dict[int, set[str]] = {}  # tenant -> the replicas that answered it
    for tenant, r in zip(wl.tenants, records, strict=True):
        if r.ok and r.replica is not None:
            spread.setdefault(tenant, set()).add(r.replica)
    ideal = W.ideal_cached_tokens(wl)
    return {"tenants": len(set(wl.tenants)), "cache_hit_ratio": round(cached / prompt, 4),
            "ideal_cache_hit_ratio": round(ideal / prompt, 4),
            "hit_ratio_vs_ideal": round(cached / ideal, 4) if ideal else None,
            "computed_prompt_tokens": prompt - cached, "ideal_computed_prompt_tokens": prompt - ideal,
            "replicas": len(set().union(*spread.values())) if spread else None,
            "replicas_per_tenant_mean": round(statistics.fmean(len(s) for s in spread.values()), 3)
            if spread else None}


def _document(args, hw: dict, model: str, engine_kw: dict, entries: list[dict]) -> dict:
    return {
        "benchmark": "serve", "hardware": hw, "model": model, "workload": "multi-tenant",
        "tenants": args.tenants, "system_prompt_len": args.system_prompt_len, "num_prompts": args.num_prompts,
        "max_output_len": args.max_output_len, "replicas": args.replicas,
        "routers": args.routers if args.replicas else None, "server_flags": args.server_flags,
        "server": args.base_url or "started per (config, router)",
        "engine": {k: v for k, v in engine_kw.items() if v is not None},
        "configs": {c: R.CONFIGS[c] for c in args.configs},
        "results": entries,
    }


_COLUMNS = (("server", "label", ""), ("rate", "request_rate", "g"), ("done", "completed", "d"),
            ("failed", "failed", "d"), ("hit ratio", "cache_hit_ratio", ".3f"),
            ("ideal", "ideal_cache_hit_ratio", ".3f"), ("vs ideal", "hit_ratio_vs_ideal", ".3f"),
            ("computed prompt tok", "computed_prompt_tokens", "d"), ("replicas/tenant", "replicas_per_tenant_mean", ".2f"),
            ("out tok/s", "output_tokens_per_s", ".1f"), ("TTFT p50", "ttft_p50_s", ".2f"),
            ("TTFT p99", "ttft_p99_s", ".2f"), ("TPOT p50", "itl_p50_s", ".3f"), ("TPOT p99", "itl_p99_s", ".3f"))


def print_summary(doc: dict) -> None:
    print(f"\nserve multi-tenant ({doc['tenants']} tenants, system prompt {doc['system_prompt_len']}, "
          f"replicas {doc['replicas'] or 1})  model {doc['model']}  on {doc['hardware']['name']}")
    R.print_table(doc["results"], _COLUMNS)
