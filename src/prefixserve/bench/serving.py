"""`prefixserve bench serve`: interactive serving, RelayAttention Fig. 8 / vLLM's serving benchmark.

For each config a `prefixserve serve` process is started with that config's engine flags (or
`--base-url` names a running server), then for each `--request-rate` the same ShareGPT
requests (system prompt + real question, output length from the real answer, capped) arrive
as a Poisson process and stream their answers (see loadgen.py). Reported per (config, rate):
throughput, normalized latency (s per output token), TTFT and inter-token latency
percentiles; per config, the sustainable request rate: the highest swept rate whose mean
normalized latency is within `--latency-slo` with no request failed.

`--workload multi-tenant` (tenants.py) asks another question: how well requests are routed to
the replica that holds their prefix, against `serve --replicas N` with each of `--routers`.

Between rates the server keeps running; like a live chatbot service it has the system prompt
cached (a warm-up request before each rate puts it there, as RelayAttention pins it at start).
Each rate's requests carry a different session line after the system prompt, so no rate finds
another rate's questions in the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os

from . import results as R
from . import workloads as W
from .loadgen import poisson_run, summarize
from .plots import plot_serving
from .server_process import scale_out_flags, server

log = logging.getLogger(__name__)


def register(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("serve", help="online serving: Poisson arrivals over request rates, one server per config",
                       description=__doc__.split("\n\n")[1], epilog=R.ENGINE_FLAGS_NOTE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=R.config_list, default=["paged-nocache", "paged", "relay", "auto"],
                   help=f"comma-separated, one server each (choices: {','.join(R.CONFIGS)})")
    p.add_argument("--base-url", default=None,
                   help="benchmark this running server instead (e.g. http://127.0.0.1:8000); --configs then only labels it")
    p.add_argument("--api-key", default=None,
                   help="bearer token for the server (default: $PREFIXSERVE_API_KEY); never written to the results")
    p.add_argument("--workload", choices=("sharegpt", "multi-tenant"), default="sharegpt",
                   help="sharegpt: one system prompt; multi-tenant: --tenants system prompts, interleaved")
    p.add_argument("--tenants", type=int, default=8, help="multi-tenant: distinct system prompts")
    p.add_argument("--replicas", type=int, default=None,
                   help="start each server with `--replicas N` (Ray Serve; default: one process)")
    p.add_argument("--routers", type=_router_list, default=["prefix", "pow2"],
                   help="with --replicas: one server per router, comma-separated (prefix, pow2)")
    p.add_argument("--server-flags", default="",
                   help="more flags for each started server, one string (e.g. \"--cpus-per-replica 0.5\")")
    p.add_argument("--request-rate", type=R.float_list, default=[1.0, 2.0, 4.0, 8.0],
                   help="requests per second, list (inf = all at once)")
    p.add_argument("--latency-slo", type=float, default=0.5, help="seconds per output token (RelayAttention: 0.5)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--dataset-seed", type=int, default=0, help="which conversations; arrival times")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    R.add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    from ..cli import engine_kwargs
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if args.base_url and len(args.configs) != 1:
        raise ValueError("with --base-url, name the running server's config with one --configs value")
    engine_kw = {k: v for k, v in engine_kwargs(args).items() if k not in ("attention_backend", "enable_prefix_caching")}
    args.api_key = args.api_key or os.environ.get("PREFIXSERVE_API_KEY")
    R.set_threads(args.threads)  # recorded in `hardware`; the servers get it as OMP_NUM_THREADS
    if args.workload == "multi-tenant":
        from .tenants import run_multi_tenant
        return run_multi_tenant(args, engine_kw)
    hw, model = R.hardware(), R.model_name(engine_kw)
    load_start = R.load_average()
    src = W.token_source(engine_kw)
    wl = W.sharegpt(src, args.system_prompt_len, args.num_prompts, args.max_output_len, args.max_prompt_len,
                    args.dataset_seed)
    entries = []
    for config in args.configs:
        with server(args, config, engine_kw, scale_out_flags(args, None)) as url:
            entries += _sweep(args, url, config, src, wl)
    doc = _document(args, hw, model, engine_kw, entries)
    doc["load_average"] = {"start": load_start, "end": R.load_average()}
    print_summary(doc)
    R.publish(doc, R.result_path(args.out_dir, "serve", "sharegpt", model, hw, args.tag), args,
              "prefixserve bench serve", plot_serving)
    return 0


def _sweep(args, url: str, config: str, src: W.TokenSource, wl: W.Workload) -> list[dict]:
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    sys_len, entries = wl.shared_prefix_len, []
    system = wl.prompts[0][:sys_len]
    max_tokens = wl.max_tokens
    for i, rate in enumerate(args.request_rate):
        session = src.encode(f"\nSession {i + 1}.")
        prompts = [p[:sys_len] + session + p[sys_len:] for p in wl.prompts]
        warm = system + src.encode("\nSession 0. Hello")
        asyncio.run(poisson_run(url, model, [warm], [2], math.inf, 0, headers, args.request_timeout, False))
        records, duration = asyncio.run(poisson_run(
            url, model, prompts, max_tokens, rate, args.dataset_seed + i, headers, args.request_timeout,
            not args.no_progress, f"{config} @ {rate:g} req/s"))
        entries.append({"config": config, "request_rate": rate, **summarize(records, duration)})
        log.info("%s @ %g req/s: %s", config, rate, {k: entries[-1][k] for k in
                 ("completed", "failed", "output_tokens_per_s", "normalized_latency_mean_s")})
    return entries


# ---- the server process ----------------------------------------------------------------------
def _router_list(text: str) -> list[str]:
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names or any(r not in ("prefix", "pow2") for r in names):
        raise argparse.ArgumentTypeError(f"routers are prefix and pow2, got {text!r}")
    return names


# ---- results ---------------------------------------------------------------------------------
def sustainable_rates(entries: list[dict], slo: float) -> dict[str, float | None]:
    """Per config: the highest swept rate with no failure and mean normalized latency <= slo."""
    out: dict[str, float | None] = {}
    for e in entries:
        out.setdefault(e["config"], None)
        lat = e["normalized_latency_mean_s"]
        if not e["failed"] and lat is not None and lat <= slo:
            out[e["config"]] = max(e["request_rate"], out[e["config"]] or 0.0)
    return out


def _document(args, hw: dict, model: str, engine_kw: dict, entries: list[dict]) -> dict:
    rates = sustainable_rates(entries, args.latency_slo)
    base = rates.get(R.BASELINE)
    for e in entries:
        e["sustainable_request_rate"] = rates[e["config"]]
    return {
        "benchmark": "serve", "hardware": hw, "model": model, "workload": "sharegpt",
        "system_prompt_len": args.system_prompt_len, "latency_slo_s": args.latency_slo,
        "num_prompts": args.num_prompts, "max_output_len": args.max_output_len,
        "server": args.base_url or "started per config",
        "engine": {k: v for k, v in engine_kw.items() if v is not None},
        "configs": {c: R.CONFIGS[c] for c in args.configs},
        "sustainable_request_rate": rates,
        "sustainable_vs_paged_nocache": {c: R.ratio(r, base) for c, r in rates.items()},
        "results": entries,
    }


_COLUMNS = (("config", "config", ""), ("rate", "request_rate", "g"), ("done", "completed", "d"), ("failed", "failed", "d"),
            ("out tok/s", "output_tokens_per_s", ".1f"), ("req/s", "requests_per_s", ".3f"),
            ("norm lat s/tok", "normalized_latency_mean_s", ".3f"), ("TTFT p50", "ttft_p50_s", ".2f"),
            ("TTFT p99", "ttft_p99_s", ".2f"), ("ITL p50", "itl_p50_s", ".3f"), ("ITL p99", "itl_p99_s", ".3f"),
            ("sustainable", "sustainable_request_rate", "g"))


def print_summary(doc: dict) -> None:
    print(f"\nserve sharegpt (system prompt {doc['system_prompt_len']})  model {doc['model']}  "
          f"on {doc['hardware']['name']}  SLO {doc['latency_slo_s']} s/token")
    R.print_table(doc["results"], _COLUMNS)
