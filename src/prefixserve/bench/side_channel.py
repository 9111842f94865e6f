"""`prefixserve bench side-channel`: can tenant B tell that tenant A sent a prompt? (issue 21)

One engine, tenants "a" and "b"; each trial draws fresh random token prompts of `--prompt-len`
(a secret S, a control F of the same length, never seen before). Time to first token (TTFT:
add_request to the first token, the request alone in the engine):

    A sends S (warms A's cache) -> B sends S (probe) and B sends F (control), in random order
                                -> A sends S again (within-tenant cached)

Isolation holds if the probe and control TTFTs are one distribution (Mann-Whitney U, KS
distance), while A's cached repeat is clearly faster (the ratio of medians shows what the
cache would leak if it were shared). Decode (TPOT: mean time between B's tokens) under
one-read sharing: A decodes `--decode-batch` samples of S while B decodes S (probe) or F
(control) beside them; then A decodes one more sample of S beside its own (within-tenant).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from . import results as R
from .twosample import ks_distance, mann_whitney, summary

log = logging.getLogger(__name__)


def register(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("side-channel", help="cross-tenant prefix cache side channel: TTFT and TPOT",
                       description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=50, help="paired trials (each: a fresh secret and control)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of the secret and control prompts")
    p.add_argument("--decode-len", type=int, default=16, help="tokens decoded per sequence in the TPOT part")
    p.add_argument("--decode-batch", type=int, default=8, help="A's samples decoding beside B in the TPOT part")
    p.add_argument("--prompt-seed", type=int, default=0, help="seeds the random prompts and the probe/control order")
    R.add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    from ..cli import engine_kwargs
    from ..config import EngineConfig
    from ..engine.engine import LLMEngine
    if args.trials < 2 or args.prompt_len < 2 or args.decode_len < 2 or args.decode_batch < 1:
        raise ValueError("--trials, --prompt-len and --decode-len must be >= 2, --decode-batch >= 1")
    R.set_threads(args.threads)
    kw = engine_kwargs(args)
    hw, model, load_start = R.hardware(), R.model_name(kw), R.load_average()
    engine = LLMEngine(EngineConfig.from_kwargs(**kw))
    bench = _Bench(engine, args)
    bench.warm_up()
    ttft = bench.series(bench.ttft_trial)
    tpot = bench.series(bench.tpot_trial)
    doc = {"bench": "side-channel", "model": model, "hardware": hw, "load_average": [load_start, R.load_average()],
           "backend": engine.backend_name, "trials": args.trials, "prompt_len": args.prompt_len,
           "ttft": _report(ttft), "tpot": _report(tpot), "raw": {"ttft": ttft, "tpot": tpot}}
    for part in ("ttft", "tpot"):
        r = doc[part]
        print(f"{part}: probe median {r['probe']['median'] * 1e3:.2f} ms vs control {r['control']['median'] * 1e3:.2f} ms "
              f"(Mann-Whitney p={r['mann_whitney']['p']:.3f}, KS D={r['ks_distance']:.3f}); within a tenant, "
              f"uncached / cached = {r['within_tenant_ratio']:.2f}")
    R.publish(doc, R.result_path(args.out_dir, "side-channel", f"p{args.prompt_len}", model, hw, args.tag), args,
              "prefixserve bench side-channel", _plot)
    return 0


class _Bench:
    def __init__(self, engine, args: argparse.Namespace):
        self.engine, self.args = engine, args
        self.rng = random.Random(args.prompt_seed)
        self.vocab = engine.vocab_size
        self._ids = 0

    def prompt(self) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(self.args.prompt_len)]

    def warm_up(self) -> None:
        for _ in range(2):
            self.ttft_trial()
            self.tpot_trial()

    def series(self, trial) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"probe": [], "control": [], "cached": []}
        for _ in range(self.args.trials):
            for k, v in trial().items():
                out[k].append(v)
        return out

    def ttft_trial(self) -> dict[str, float]:
        secret, control = self.prompt(), self.prompt()
        self.run([("a", secret, 1)])
        order = [("probe", secret), ("control", control)]
        self.rng.shuffle(order)
        times = {name: self.run([("b", p, 1)])[0][0] for name, p in order}
        times["cached"] = self.run([("a", secret, 1)])[0][0]
        return times

    def tpot_trial(self) -> dict[str, float]:
        secret, control = self.prompt(), self.prompt()
        self.run([("a", secret, 1)])
        order = [("probe", ("b", secret)), ("control", ("b", control)), ("cached", ("a", secret))]
        self.rng.shuffle(order)
        times = {}
        for name, (tenant, p) in order:
            batch = [("a", secret, self.args.decode_len)] * self.args.decode_batch
            times[name] = self.run(batch + [(tenant, p, self.args.decode_len)])[-1][1]
        return times

    def run(self, reqs: list[tuple[str, list[int], int]]) -> list[tuple[float, float]]:
        """Run (tenant, prompt, max_tokens) requests together; (TTFT, TPOT) of each, in seconds."""
        from ..sampling_params import SamplingParams
        start, first, last, ids = time.perf_counter(), {}, {}, []
        for tenant, prompt, n in reqs:
            self._ids += 1
            ids.append(f"sc-{self._ids}")
            self.engine.add_request(ids[-1], prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                    tenant=tenant)
        counts = {}
        while self.engine.has_unfinished():
            outs = self.engine.step()
            now = time.perf_counter()
            for out in outs:
                tokens = len(out.outputs[0].token_ids)
                if tokens and out.request_id not in first:
                    first[out.request_id] = now
                last[out.request_id], counts[out.request_id] = now, tokens
        return [(first[i] - start, (last[i] - first[i]) / max(1, counts[i] - 1)) for i in ids]


def _report(series: dict[str, list[float]]) -> dict:
    probe, control, cached = series["probe"], series["control"], series["cached"]
    return {"probe": summary(probe), "control": summary(control), "cached": summary(cached),
            "mann_whitney": mann_whitney(probe, control), "ks_distance": ks_distance(probe, control),
            "paired_median_difference": statistics.median(p - c for p, c in zip(probe, control, strict=True)),
            "within_tenant_ratio": statistics.median(control) / statistics.median(cached)}


def _plot(doc: dict, path) -> None:
    from .plots import _pyplot
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, part, unit in zip(axes, ("ttft", "tpot"), ("time to first token", "time per output token"), strict=True):
        raw = doc["raw"][part]
        for name, color in (("probe", "tab:red"), ("control", "tab:blue"), ("cached", "tab:green")):
            xs = sorted(v * 1e3 for v in raw[name])
            label = {"probe": "B sends A's prompt", "control": "B sends a fresh prompt",
                     "cached": "A repeats its prompt"}[name]
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=color, label=label)
        r = doc[part]
        ax.set_title(f"{unit}: Mann-Whitney p={r['mann_whitney']['p']:.2f}, within-tenant x{r['within_tenant_ratio']:.1f}",
                     fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of trials")
        ax.legend(fontsize=8)
    hw = doc["hardware"]
    fig.suptitle(f"cross-tenant prefix cache side channel: {doc['model']}, {hw['name']}, {doc['trials']} paired "
                 f"trials, {doc['prompt_len']}-token prompts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
