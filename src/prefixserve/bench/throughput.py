"""`prefixserve bench throughput`: offline batches, every config side by side in one process.

For each sweep point the workload is built once; then each config gets a fresh engine (the
previous one freed first), an untimed pass of the whole workload on token-shifted prompts (the
same steps, no cache hits on the real ones), and the whole batch submitted at once and run to
completion; with `--rounds N` all of that N times, the configs' order rotated each round, and
each config keeps its fastest run. Reported per (config, point): output tokens/s and
requests/s over the whole run, decode tokens/s over the steps that computed no prompt token
(Hydragen's decode throughput; with overlapped scheduling a step's wall time is charged to the
batch it waited for, the one the step before launched: a 16K-token prompt's prefill ran on the
GPU during the first decode step's call and was counted as decode -- 0.73 s of relay's 7.75 s
on Llama-2-7B dims on an H200 --),
ratios to `paged-nocache` and to the `no-attention` ceiling, prompt tokens computed, peak KV
tokens held (physical) vs the running sequences' lengths (logical), and for greedy workloads
whether every output is token for token the reference config's (`paged-nocache` when run). With
`--profile` (CUDA) each decode step's GPU time (events around its forward and sampling) is set
beside the GPU's idle time before it: the host work not hidden behind the previous step
(`decode_profile`, medians over the decode steps; `host_busy_ms`: the host's own time per step,
hidden or not), and `device_vs_no_attention` compares the median GPU steps: where the host
bounds the ceiling's steps (1,024 rows of Llama-2-7B on an H200: its host took 33 ms a step
against the GPU's 26 on one lent machine, 17-18 on others), its tokens/s understate what the
GPU does without attention and every `vs_no_attention` reads high; the run warns when it does.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from . import results as R
from . import workloads as W

if TYPE_CHECKING:
    from ..engine.request import RequestOutput

log = logging.getLogger(__name__)

_WARMUP_SHIFT = 7919  # added to warm-up token ids, so the warm-up never prefixes the real prompts
_DEFAULT_GEN_LEN = {"synthetic": 256, "multi-sample": 128, "hierarchical": 128, "long-doc": 32}


def register(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("throughput", help="offline batch throughput of the configs on one workload",
                       description=__doc__.split("\n\n")[1], epilog=R.ENGINE_FLAGS_NOTE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=W.OFFLINE_WORKLOADS, default="sharegpt")
    p.add_argument("--configs", type=R.config_list, default=list(R.CONFIGS),
                   help=f"comma-separated, run in this order (default: all: {','.join(R.CONFIGS)})")
    p.add_argument("--no-warmup", action="store_true", help="skip the per-config warm-up")
    p.add_argument("--rounds", type=R.positive, default=1,
                   help="run every config this many times, the order rotated each round, and keep each "
                        "config's fastest run (every round's elapsed time is kept beside it): a run's "
                        "elapsed time varies with the host's hiccups")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: each decode step's GPU time and the GPU's idle time before it (events)")
    g = p.add_argument_group("workload (lists sweep: one JSON entry per config and value)")
    g.add_argument("--system-prompt-len", type=R.int_list, default=[1024], help="sharegpt, synthetic: list")
    g.add_argument("--num-prompts", type=int, default=32, help="sharegpt, synthetic")
    g.add_argument("--max-output-len", type=int, default=256, help="sharegpt: cap on the real answers' lengths")
    g.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt: longer questions are skipped")
    g.add_argument("--dataset-seed", type=int, default=0, help="sharegpt: which conversations; sampling seeds")
    g.add_argument("--prompt-len", type=int, default=128, help="synthetic: user prompt tokens")
    g.add_argument("--gen-len", type=int, default=None,
                   help="tokens per completion (default: synthetic 256, multi-sample/hierarchical 128, long-doc 32)")
    g.add_argument("--prefix-len", type=R.int_list, default=[2048],
                   help="multi-sample: list; the batch sweep runs at the first value, the prefix sweep at the largest batch")
    g.add_argument("--batch", type=R.int_list, default=[32], help="multi-sample: completions of the prompt, list")
    g.add_argument("--fewshot-len", type=int, default=1024, help="hierarchical")
    g.add_argument("--problems", type=int, default=4, help="hierarchical")
    g.add_argument("--problem-len", type=int, default=256, help="hierarchical")
    g.add_argument("--samples", type=int, default=16, help="hierarchical: completions per problem")
    g.add_argument("--doc-len", type=R.int_list, default=[4096],
                   help="long-doc: list; the questions sweep runs at the first value, the length sweep at the most questions")
    g.add_argument("--questions", type=R.int_list, default=[16], help="long-doc: list")
    g.add_argument("--question-len", type=int, default=32, help="long-doc")
    R.add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, _parser=p)


# ---- the command -----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from ..cli import engine_kwargs
    engine_kw = {k: v for k, v in engine_kwargs(args).items() if k not in ("attention_backend", "enable_prefix_caching")}
    R.set_threads(args.threads)
    hw, model = R.hardware(), R.model_name(engine_kw)
    load_start = R.load_average()
    src = W.token_source(engine_kw)
    entries = []
    for point in _points(args):
        wl = _build(args, src, point)
        log.info("workload %s %s: %d sequences, %d prompt tokens, %d output tokens", wl.name, point,
                 wl.num_sequences, wl.prompt_tokens, wl.output_tokens)
        entries += compare_configs(args.configs, engine_kw, wl, point, progress=not args.no_progress,
                                   warmup=not args.no_warmup, profile=args.profile, rounds=args.rounds)
    doc = _document(args, hw, model, engine_kw, entries)
    doc["load_average"] = {"start": load_start, "end": R.load_average()}
    print_summary(doc)
    from .plots import plot_throughput
    R.publish(doc, R.result_path(args.out_dir, "throughput", args.workload, model, hw, args.tag), args,
              "prefixserve bench throughput", plot_throughput)
    return 0


def compare_configs(configs: list[str], engine_kw: dict, wl: W.Workload, point: dict,
                    progress: bool = True, warmup: bool = True, profile: bool = False,
                    rounds: int = 1) -> list[dict]:
    """Run `wl` under each config in turn, `rounds` times, round r starting at config r (mod
    their number); entries (in `configs`' order) with ratios and the exactness verdict, each of
    its config's least elapsed time, with every round's in `round_elapsed_s` (and with `profile`
    its median GPU decode step in `round_device_ms`) where rounds > 1.
    (On an H200 the no-attention ceiling's elapsed time moved 20% between two rounds, its steps
    near host-bound; before `engine.heap` froze the start-up heap, the first config of a process
    collected twice and read 4-6% slower: kernels-notes.md, issue 25 part thirty-four.)"""
    runs: dict[str, list[tuple[dict, list]]] = {name: [] for name in configs}
    for r in range(rounds):
        start = r % len(configs)
        for name in configs[start:] + configs[:start]:
            runs[name].append(run_config(name, {**engine_kw, **R.CONFIGS[name]}, wl, progress, warmup, profile))
    entries, outputs = [], {}
    for name in configs:
        entry, outputs[name] = min(runs[name], key=lambda run: run[0]["elapsed_s"])
        if rounds > 1:
            entry = {**entry, "round_elapsed_s": [m["elapsed_s"] for m, _ in runs[name]]}
            if profile:  # (None for a round without decode steps)
                entry["round_device_ms"] = [(m["decode_profile"] or {}).get("device_ms") for m, _ in runs[name]]
        entries.append({"config": name, **point, **entry})
    _add_comparisons(entries, outputs, wl.greedy)
    return entries


def _add_comparisons(entries: list[dict], outputs: dict[str, list], greedy: bool) -> None:
    by = {e["config"]: e for e in entries}
    ceiling = (by.get(R.CEILING) or {}).get("decode_profile")
    if ceiling and ceiling["host_busy_ms"] > ceiling["device_ms"]:
        log.warning("the %s ceiling was host-bound (host %.1f ms a decode step, GPU %.1f): its tokens/s "
                    "understate the GPU's and the vs_no_attention ratios read high; device_vs_no_attention "
                    "compares the GPU's steps", R.CEILING, ceiling["host_busy_ms"], ceiling["device_ms"])
    exact = [e["config"] for e in entries if e["config"] not in R.INEXACT]
    ref = R.BASELINE if R.BASELINE in by else (exact[0] if exact else None)
    for e in entries:
        for key, other in (("vs_paged_nocache", R.BASELINE), ("vs_no_attention", R.CEILING)):
            o = by.get(other, {})
            e["cpu_time_" + key] = R.ratio(e["output_tokens_per_cpu_s"], o.get("output_tokens_per_cpu_s"))
            e[key] = R.ratio(e["output_tokens_per_s"], o.get("output_tokens_per_s"))
            e["decode_" + key] = R.ratio(e["decode_tokens_per_s"], o.get("decode_tokens_per_s"))
        mine = e.get("decode_profile")
        e["device_vs_no_attention"] = R.ratio(ceiling and ceiling["device_ms"], mine and mine["device_ms"])
        for mode in ("det", "fp8"):  # deterministic mode's cost, the fp8 cache's gain: same run
            default = by.get(e["config"].removesuffix(f"-{mode}"))
            if default is not None and default is not e:
                e[f"{mode}_vs_default"] = R.ratio(e["output_tokens_per_s"], default["output_tokens_per_s"])
                e[f"decode_{mode}_vs_default"] = R.ratio(e["decode_tokens_per_s"], default["decode_tokens_per_s"])
        against = ref if greedy and e["config"] in exact and e["config"] != ref else None
        # one workload: every config returns one output per sequence, in the same order
        mismatched = (None if against is None
                      else sum(a != b for a, b in zip(outputs[e["config"]], outputs[against], strict=True)))
        e.update(identical_to=against, mismatched_sequences=mismatched,
                 identical_outputs=None if mismatched is None else mismatched == 0)


# ---- one config ------------------------------------------------------------------------------
def run_config(name: str, kwargs: dict, wl: W.Workload, progress: bool = True,
               warmup: bool = True, profile: bool = False) -> tuple[dict, list[list[int]]]:
    """Build an engine for `kwargs`, run `wl` through it; -> (metrics, output ids per sequence)."""
    from ..llm import LLM
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    try:
        if warmup:
            _warmup(llm, wl)
        llm.engine.set_step_profiling(profile)
        metrics, outputs = _timed_run(llm.engine, wl, progress, desc=name)
    finally:
        llm.close()
        del llm
        R.free_device_memory()
    return {"load_s": round(load_s, 3), **metrics}, outputs


@dataclasses.dataclass
class _Clock:
    """Step times, split by whether the step computed prompt tokens (prefill) or only decoded."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens sampled in decode-only steps
    peak_in_use: int = 0
    peak_logical: int = 0
    cpu_s: float = 0.0  # this process's CPU time: on a shared machine, unlike wall time, not inflated by others
    computed: int = 0  # the engine's computed prompt tokens after the last step
    launched_prefill: bool | None = None  # whether the last step's batch computed prompt tokens
    choices: Counter = dataclasses.field(default_factory=Counter)
    profile: list = dataclasses.field(default_factory=list)  # decode steps' (StepTiming, host wall s)


def _timed_run(engine, wl: W.Workload, progress: bool, desc: str) -> tuple[dict, list[list[int]]]:
    from tqdm.auto import tqdm
    before = engine.stats()
    ids = [f"bench-{i}" for i in range(len(wl.prompts))]
    for rid, prompt, params in zip(ids, wl.prompts, wl.params, strict=True):
        engine.add_request(rid, prompt, params)
    seen: dict[str, int] = {}  # request id -> tokens read so far
    done: dict[str, RequestOutput] = {}  # request id -> its finished output
    clock, generated = _Clock(computed=before.kv.computed_prompt_tokens), 0
    bar = tqdm(total=wl.output_tokens, desc=f"{desc:>13}", unit="tok", disable=not progress, leave=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        new = _step(engine, clock, seen, done)
        generated += new
        bar.update(new)
    _synchronize()
    elapsed, clock.cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    bar.close()
    after = engine.stats()
    outputs = [c.token_ids for rid in ids for c in sorted(done[rid].outputs, key=lambda c: c.index)]
    return _metrics(wl, clock, elapsed, generated, before, after, engine.chunk_size), outputs


def _step(engine, clock: _Clock, seen: dict[str, int], done: dict[str, RequestOutput]) -> int:
    """One engine step, timed and classified; -> tokens read in it. Not synchronized: with
    overlapped scheduling on CUDA a step launches its batch and waits for the one before,
    whose outputs and timing it returns (`Engine.waits_for_previous`), so its wall time (the
    device's time for that batch whenever the host keeps up) and tokens are charged to that
    batch's class, prefill or decode; elsewhere to its own batch's."""
    engine.take_step_timing()  # drop an earlier step's
    waits_for = clock.launched_prefill if engine.waits_for_previous else None
    t = time.perf_counter()
    outs = engine.step()
    dt = time.perf_counter() - t
    sampled = 0
    for out in outs:
        total = sum(len(c.token_ids) for c in out.outputs)
        sampled, seen[out.request_id] = sampled + total - seen.get(out.request_id, 0), total
        if out.finished:
            done[out.request_id] = out
    stats = engine.stats()
    timing = engine.take_step_timing()
    launched_prefill = stats.kv.computed_prompt_tokens > clock.computed
    prefill = launched_prefill if waits_for is None else waits_for  # the batch this step's time was
    clock.launched_prefill = launched_prefill
    if prefill:
        clock.prefill_s, clock.prefill_steps = clock.prefill_s + dt, clock.prefill_steps + 1
    else:
        clock.decode_s, clock.decode_steps = clock.decode_s + dt, clock.decode_steps + 1
        clock.decode_tokens += sampled
        if timing is not None and timing.idle_s is not None:
            clock.profile.append((timing, dt))
    clock.computed = stats.kv.computed_prompt_tokens
    clock.peak_in_use = max(clock.peak_in_use, stats.kv.in_use_tokens)
    clock.peak_logical = max(clock.peak_logical, stats.kv.logical_tokens)
    if stats.schedule != engine.backend_name:  # a backend that picks a schedule per step (auto)
        clock.choices[stats.schedule] += 1
    return sampled


def _synchronize() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _metrics(wl: W.Workload, c: _Clock, elapsed: float, generated: int, before, after,
             chunk_size: int) -> dict[str, Any]:
    def per_s(n, s):
        return round(n / s, 3) if s > 0 else None
    return {
        "requests": len(wl.prompts), "sequences": wl.num_sequences,
        "prompt_tokens": after.kv.prompt_tokens - before.kv.prompt_tokens,
        "prompt_tokens_computed": after.kv.computed_prompt_tokens - before.kv.computed_prompt_tokens,
        "prefix_hit_tokens": after.kv.prefix_hit_tokens - before.kv.prefix_hit_tokens,
        "output_tokens": generated,
        "elapsed_s": round(elapsed, 3), "prefill_s": round(c.prefill_s, 3), "decode_s": round(c.decode_s, 3),
        "output_tokens_per_s": per_s(generated, elapsed), "requests_per_s": per_s(len(wl.prompts), elapsed),
        "process_cpu_s": round(c.cpu_s, 3), "output_tokens_per_cpu_s": per_s(generated, c.cpu_s),
        "decode_tokens_per_s": per_s(c.decode_tokens, c.decode_s),
        "steps": c.prefill_steps + c.decode_steps, "prefill_steps": c.prefill_steps,
        "peak_kv_tokens_physical": c.peak_in_use, "peak_kv_tokens_logical": c.peak_logical,
        "kv_capacity_tokens": after.kv.capacity_tokens, "chunk_size": chunk_size,
        "preemptions": after.preemptions - before.preemptions,
        "attention_choices": dict(c.choices) or None,
        "decode_profile": _profile_summary(c.profile),
    }


def _profile_summary(steps: list) -> dict | None:
    """Medians over profiled decode steps (StepTiming, the host's wall time in step()): GPU
    time, GPU idle time before the step (host work not hidden), and the host's busy time."""
    if not steps:
        return None
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"steps": len(steps), "rows_max": max(t.rows for t, _ in steps),
            "step_ms": round(1e3 * med([t.device_s + t.idle_s for t, _ in steps]), 3),
            "device_ms": round(1e3 * med([t.device_s for t, _ in steps]), 3),
            "host_ms": round(1e3 * med([t.idle_s for t, _ in steps]), 3),
            "host_fraction": round(med([t.idle_s / (t.device_s + t.idle_s) for t, _ in steps]), 4),
            "host_busy_ms": round(1e3 * med([wall - t.wait_s for t, wall in steps]), 3)}


def _warmup(llm, wl: W.Workload) -> None:
    """The whole workload once, untimed, its token ids shifted so that it shares no prefix with
    the real prompts: every step of the run -- its prefill and decode row counts, the tails'
    lengths, the plans they pick -- launches its kernel variants here first, so that none is
    compiled while timed. Row counts and tail lengths pick kernels: on an H200, 1,024 samples
    of a 16K prompt take the chunk-pair products (`hopper_pairs`, whose units must fill every
    SM), and 64-key tiles again once their tails pass ~115 keys. A warm-up of 160 samples and
    three tokens reached neither, one of all 1,024 samples and three tokens only the first: the
    first config of a run compiled the rest while timed (2.5 s at step 115; auto, run first,
    0.36-0.42x the no-attention ceiling, relay after it 0.48-0.49x, median steps within 1%)."""
    vocab = llm.engine.vocab_size
    prompts = [[(t + _WARMUP_SHIFT) % vocab for t in p] for p in wl.prompts]
    llm.generate(prompts, wl.params, use_tqdm=False)


def _points(args) -> list[dict]:
    if args.workload in ("sharegpt", "synthetic"):
        return W.sweep_points(("system_prompt_len", args.system_prompt_len))
    if args.workload == "multi-sample":
        return W.sweep_points(("batch", args.batch), ("prefix_len", args.prefix_len))
    if args.workload == "long-doc":
        return W.sweep_points(("questions", args.questions), ("doc_len", args.doc_len))
    return [{}]


def _sweep_lines(args) -> list[dict]:
    """The plotted lines: each swept axis with the other axis held fixed (see sweep_points)."""
    axes = {"sharegpt": ("system_prompt_len", None), "synthetic": ("system_prompt_len", None),
            "multi-sample": ("batch", "prefix_len"), "long-doc": ("questions", "doc_len")}.get(args.workload)
    if axes is None:
        return []
    a, b = axes
    avals, bvals = getattr(args, a), getattr(args, b) if b else [None]
    lines = [{"x": a, "fixed": {b: bvals[0]} if b else {}}] if len(avals) > 1 else []
    if b and len(bvals) > 1:
        lines.append({"x": b, "fixed": {a: max(avals)}})
    return lines


def _build(args, src: W.TokenSource, point: dict) -> W.Workload:
    if args.workload == "sharegpt":
        return W.sharegpt(src, point["system_prompt_len"], args.num_prompts, args.max_output_len,
                          args.max_prompt_len, args.dataset_seed)
    gen: int = args.gen_len or _DEFAULT_GEN_LEN[args.workload]
    if args.workload == "synthetic":
        return W.synthetic(src, point["system_prompt_len"], args.num_prompts, args.prompt_len, gen)
    if args.workload == "multi-sample":
        return W.multi_sample(src, point["prefix_len"], point["batch"], gen, args.dataset_seed)
    if args.workload == "hierarchical":
        return W.hierarchical(src, args.fewshot_len, args.problems, args.problem_len, args.samples, gen,
                              args.dataset_seed)
    return W.long_doc(src, point["doc_len"], point["questions"], args.question_len, gen)


def _document(args, hw: dict, model: str, engine_kw: dict, entries: list[dict]) -> dict:
    spl = args.system_prompt_len if args.workload in ("sharegpt", "synthetic") else None
    return {
        "benchmark": "throughput", "hardware": hw, "model": model, "workload": args.workload,
        "system_prompt_len": spl[0] if spl and len(spl) == 1 else spl,
        "engine": {k: v for k, v in engine_kw.items() if v is not None},
        "configs": {c: R.CONFIGS[c] for c in args.configs},
        "sweep": _sweep_lines(args),
        "results": entries,
    }


_COLUMNS = (("config", "config", ""), ("out tok/s", "output_tokens_per_s", ".1f"), ("req/s", "requests_per_s", ".3f"),
            ("decode tok/s", "decode_tokens_per_s", ".1f"), ("x nocache", "vs_paged_nocache", ".2f"),
            ("x no-attn", "vs_no_attention", ".2f"),
            ("x no-attn GPU", "device_vs_no_attention", ".2f"), ("x nocache cpu-time", "cpu_time_vs_paged_nocache", ".2f"),
            ("prefill s", "prefill_s", ".1f"), ("decode s", "decode_s", ".1f"),
            ("prompt computed", "prompt_tokens_computed", "d"), ("KV phys", "peak_kv_tokens_physical", "d"),
            ("KV logical", "peak_kv_tokens_logical", "d"), ("identical", "identical_outputs", ""))


def print_summary(doc: dict) -> None:
    hw = doc["hardware"]
    print(f"\n{doc['benchmark']} {doc['workload']}  model {doc['model']}  on {hw['name']}")
    sweep = [k for k in ("system_prompt_len", "batch", "prefix_len", "questions", "doc_len")
             if len({e.get(k) for e in doc["results"]}) > 1]
    cols = _COLUMNS[:1] + tuple((k, k, "") for k in sweep) + _COLUMNS[1:]
    R.print_table(doc["results"], cols)
