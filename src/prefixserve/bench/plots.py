"""PNG figures of the result JSONs (matplotlib, imported here only, with the Agg backend).

throughput: one column per swept axis (RelayAttention Fig. 7: tokens/s vs system prompt
length; Hydragen Fig. 3: vs batch at the first prefix length, vs prefix length at the largest
batch), rows = overall output tokens/s and decode tokens/s, one line per config; a run without
a sweep is a bar chart. serve: throughput and normalized latency vs request rate (RelayAttention
Fig. 8), the latency SLO as a dashed line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

_STYLE: dict[str, dict[str, Any]] = {  # matplotlib line keywords per config
    "paged-nocache": dict(color="0.45", marker="o"),
    "paged": dict(color="tab:blue", marker="s"),
    "relay": dict(color="tab:orange", marker="^"),
    "hydragen": dict(color="tab:green", marker="v"),
    "chunk": dict(color="tab:purple", marker="D"),
    "auto": dict(color="tab:red", marker="*", markersize=9),
    "no-attention": dict(color="black", marker="", linestyle="--"),
}
_METRICS = (("output_tokens_per_s", "output tokens/s (whole run)"), ("decode_tokens_per_s", "decode tokens/s"))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(doc: dict, extra: str = "") -> str:
    hw = doc["hardware"]
    where = hw["name"] + (f" ({hw['cores']} cores)" if hw.get("cores") else "")
    return f"{doc['benchmark']} {doc['workload']}{extra} - {doc['model']} - {where}"


def plot_throughput(doc: dict, path: Path) -> None:
    plt = _pyplot()
    lines = doc.get("sweep") or []
    if not lines:
        return _bars(plt, doc, path)
    fig, axes = plt.subplots(len(_METRICS), len(lines), figsize=(5.5 * len(lines), 7), squeeze=False)
    for col, line in enumerate(lines):
        entries = [e for e in doc["results"] if all(e.get(k) == v for k, v in line["fixed"].items())]
        for row, (metric, label) in enumerate(_METRICS):
            ax = axes[row][col]
            for config in doc["configs"]:
                pts = sorted((e[line["x"]], e[metric]) for e in entries if e["config"] == config and e[metric])
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=config, **_STYLE.get(config, {}))
            fixed = ", ".join(f"{k}={v}" for k, v in line["fixed"].items())
            ax.set(xlabel=line["x"].replace("_", " ") + (f"  ({fixed})" if fixed else ""), ylabel=label)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(_title(doc), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(plt, doc: dict, path: Path) -> None:
    entries = doc["results"]
    names = [e["config"] for e in entries]
    fig, axes = plt.subplots(1, len(_METRICS), figsize=(11, 4.2))
    for ax, (metric, label) in zip(axes, _METRICS, strict=True):
        values = [e[metric] or 0 for e in entries]
        bars = ax.bar(names, values, color=[_STYLE.get(n, {}).get("color", "tab:gray") for n in names])
        base = next((e[metric] for e in entries if e["config"] == "paged-nocache"), None)
        for bar, v in zip(bars, values, strict=True):
            if base:
                ax.annotate(f"{v / base:.2f}x", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                            va="bottom", fontsize=8)
        ax.set(ylabel=label)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    spl = doc.get("system_prompt_len")
    fig.suptitle(_title(doc, f" (system prompt {spl})" if spl else "") + "\nratios: vs paged-nocache", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serving(doc: dict, path: Path) -> None:
    plt = _pyplot()
    panels = (("output_tokens_per_s", "output tokens/s"), ("normalized_latency_mean_s", "normalized latency (s/token)"),
              ("ttft_p50_s", "TTFT p50 (s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for config in doc["configs"]:
            pts = sorted((e["request_rate"], e[metric]) for e in doc["results"]  # "inf" (all at once) not drawn
                         if e["config"] == config and e.get(metric) is not None and _finite(e["request_rate"]))
            if pts:
                ax.plot(*zip(*pts, strict=True), label=config, **_STYLE.get(config, {}))
        if metric.startswith("normalized") and doc.get("latency_slo_s"):
            ax.axhline(doc["latency_slo_s"], color="0.3", linestyle=":", label="SLO")
        ax.set(xlabel="request rate (req/s)", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    spl = doc.get("system_prompt_len")
    fig.suptitle(_title(doc, f" (system prompt {spl})" if spl else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_multi_tenant(doc: dict, path: Path) -> None:
    """Bars per server (config/router), one per request rate: cache-hit ratio (the ideal as a
    dotted line over its bar), prompt tokens computed, output tokens/s, TTFT p50 and p99."""
    plt = _pyplot()
    panels = (("cache_hit_ratio", "cache-hit ratio (cached / prompt tokens)"),
              ("computed_prompt_tokens", "prompt tokens computed"), ("output_tokens_per_s", "output tokens/s"),
              ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"))
    labels = list(dict.fromkeys(e["label"] for e in doc["results"]))
    rates = list(dict.fromkeys(e["request_rate"] for e in doc["results"]))
    width = 0.8 / len(rates)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2))
    for ax, (metric, name) in zip(axes, panels, strict=True):
        for j, rate in enumerate(rates):
            rows = {e["label"]: e for e in doc["results"] if e["request_rate"] == rate}
            xs = [i + (j - (len(rates) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [(rows[lb].get(metric) or 0) if lb in rows else 0 for lb in labels], width,
                   label=f"{rate:g} req/s" if _finite(rate) else "all at once")
            if metric == "cache_hit_ratio":
                for x, lb in zip(xs, labels, strict=True):
                    if lb in rows:
                        ax.hlines(rows[lb]["ideal_cache_hit_ratio"], x - width / 2, x + width / 2, colors="0.2",
                                  linestyles=":")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set(ylabel=name)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, title="dotted: ideal", title_fontsize=8)
    fig.suptitle(_title(doc, f" ({doc['tenants']} tenants, system prompt {doc['system_prompt_len']}, "
                             f"{doc['replicas'] or 1} replicas)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
