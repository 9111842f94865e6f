"""`prefixserve bench determinism`: deterministic mode's promise checked over its matrix (issue 24).

    prefixserve bench determinism --dtype bfloat16            (the embedded model)
    prefixserve bench determinism --model benchmarks/configs/llama-2-7b.json --load-format dummy

A workload of requests, most sharing a system prompt: greedy and sampled, seeded and unseeded
(deterministic mode draws those with --seed), two samples of one prompt, all with logprobs and
ignore_eos. Each request first runs alone (the reference: paged backend, prefix caching off,
nothing else in the engine); then the workload runs under every setting below, and every
request's tokens and logprobs must equal its reference bit for bit:

    backend-<b>[-nocache]   paged relay hydragen chunk auto, prefix caching on and off, all at once
    batch-<n>               the first n requests at once
    shared-mid-flight       request 0 decodes alone for a few steps, then the rest, with its prefix, arrive
    budget-<n>              chunked prefill: n tokens per step
    no-overlap              overlapped scheduling off
    eager                   CUDA graphs off (CUDA only)
    preemption              a KV cache small enough that sequences are preempted and recomputed
    tp-<n>                  n tensor-parallel ranks (--tp n; against a reference run alone at n ranks)

Writes determinism-<dtype>-<model>-<hardware>.json (results.publish): per setting, whether it
matched and which requests did not; exit status 1 if any setting differs. The same matrix is
`make test`'s check on the CPU (tests/engine/test_determinism.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
from typing import Any

from . import results as R

log = logging.getLogger(__name__)

# (sampling keywords, shares the system prompt, question tokens); request 3 has two samples
REQUESTS: tuple[tuple[dict[str, Any], bool, int], ...] = (
    ({"temperature": 0, "logprobs": 3}, True, 9),
    ({"temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": 2}, True, 23),
    ({"temperature": 1.0, "top_k": 20, "logprobs": 1}, True, 4),
    ({"temperature": 0.7, "n": 2, "seed": 3, "logprobs": 0}, True, 31),
    ({"temperature": 0, "logprobs": 5}, False, 17),
    ({"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 11, "logprobs": 4}, True, 12),
)
Result = dict[str, list[tuple[list[int], list[list[tuple[int, float]]]]]]  # request -> per sample


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    engine: dict[str, Any]  # engine keywords over the base ones
    requests: int = len(REQUESTS)  # the first n requests
    later: int = 0  # steps request 0 runs alone before the others arrive


def register(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("determinism", help="deterministic mode: bitwise-identical outputs over the matrix",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-len", type=int, default=150, help="tokens of the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=10, help="tokens generated per sample")
    p.add_argument("--tp", type=int, default=0, help="also check N tensor-parallel ranks (0: no)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seeds the random prompt tokens")
    R.add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, _parser=p)


def settings(cuda: bool, tp: int, preempt_memory: int) -> list[Setting]:
    out = [Setting(f"backend-{b}{'' if cache else '-nocache'}",
                   {"attention_backend": b, "enable_prefix_caching": cache})
           for cache in (True, False) for b in ("paged", "relay", "hydragen", "chunk", "auto")]
    out += [Setting("batch-2", {}, requests=2), Setting("batch-4", {}, requests=4),
            Setting("shared-mid-flight", {"attention_backend": "auto"}, later=4),
            Setting("budget-16", {"max_num_batched_tokens": 16}), Setting("budget-48", {"max_num_batched_tokens": 48}),
            Setting("no-overlap", {"overlap_schedule": False}),
            Setting("preemption", {"kv_cache_memory": preempt_memory, "attention_backend": "hydragen"})]
    if cuda:
        out.append(Setting("eager", {"enforce_eager": True}))
    if tp > 1:
        out.append(Setting(f"tp-{tp}", {"tensor_parallel_size": tp}))
    return out


def run(args: argparse.Namespace) -> int:
    from ..cli import engine_kwargs
    R.set_threads(args.threads)
    base = {**engine_kwargs(args), "deterministic": True}
    hw, model = R.hardware(), R.model_name(base)
    dtype = args.dtype if args.dtype != "auto" else "float32" if hw["device"] == "cpu" else "bfloat16"
    doc = check_matrix(base, args.prefix_len, args.max_tokens, args.tp, args.prompt_seed, not args.no_progress)
    doc.update(model=model, hardware=hw, dtype=dtype)
    R.print_table(doc["settings"], [("setting", "name", ""), ("identical", "identical", ""),
                                    ("differing requests", "differing", ""), ("preemptions", "preemptions", "d")])
    print(f"all identical: {doc['all_identical']}")
    R.publish(doc, R.result_path(args.out_dir, "determinism", dtype, model, hw, args.tag), args,
              "prefixserve bench determinism")
    return 0 if doc["all_identical"] else 1


def check_matrix(base: dict[str, Any], prefix_len: int, max_tokens: int, tp: int = 0, seed: int = 0,
                 progress: bool = False) -> dict[str, Any]:
    """Every setting's results against the requests run alone; -> the JSON document's body."""
    import torch
    from tqdm import tqdm
    prompts = _prompts(base, prefix_len, seed)
    refs: dict[int, Result] = {}
    ref_engine = {"attention_backend": "paged", "enable_prefix_caching": False}
    rows = []
    cuda = base.get("device") != "cpu" and torch.cuda.is_available()
    preempt = _preempt_memory({**base, "attention_backend": "hydragen"}, prompts, max_tokens)
    for s in tqdm(settings(cuda, tp, preempt), desc="settings", disable=not progress):
        width = s.engine.get("tensor_parallel_size", 1)
        if width not in refs:  # tensor parallelism changes the sums: its own reference
            alone = [([i], 0) for i in range(len(REQUESTS))]  # one after another (nothing is cached)
            refs[width] = _run({**base, **ref_engine, "tensor_parallel_size": width}, prompts, max_tokens, alone)[0]
        got, preemptions = _run({**base, **s.engine}, prompts, max_tokens, [(list(range(s.requests)), s.later)])
        differing = [rid for rid, out in got.items() if out != refs[width][rid]]
        rows.append({"name": s.name, "engine": s.engine, "requests": s.requests, "identical": not differing,
                     "differing": differing, "preemptions": preemptions})
    return {"benchmark": "deterministic mode: each request's tokens and logprobs vs the request alone",
            "prefix_len": prefix_len, "max_tokens": max_tokens, "requests": [r[0] for r in REQUESTS],
            "settings": rows, "all_identical": all(r["identical"] for r in rows)}


def _prompts(base: dict[str, Any], prefix_len: int, seed: int) -> list[list[int]]:
    from ..config import EngineConfig, ModelConfig
    from ..model import loader
    vocab = ModelConfig.from_hf(loader.resolve(EngineConfig.from_kwargs(**base)).config).vocab_size
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    system = draw(prefix_len)
    return [(system if shared else draw(prefix_len)) + draw(q) for _, shared, q in REQUESTS]


def _preempt_memory(base: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> int:
    """KV bytes for what the workload's prompts take once admitted (measured on a probe engine
    after its first step) and one chunk: the first sequence to need a second new chunk preempts
    (with --max-tokens past the chunk size, one must; the setting's `preemptions` shows it)."""
    from ..config import EngineConfig
    from ..engine.engine import LLMEngine
    from ..kvcache.chunk_pool import ChunkPool
    engine = LLMEngine(EngineConfig.from_kwargs(**base))
    try:
        for i in range(len(REQUESTS)):
            _add(engine, prompts, max_tokens, i)
        engine.step()
        layers, _, chunk, kv_heads, head_dim = engine.pool.k.shape
        per_chunk = ChunkPool.bytes_per_chunk(layers, chunk, kv_heads, head_dim, engine.pool.k.dtype)
        chunks = -(-engine.kv_cache_stats().physical_tokens // chunk)
        return (chunks + 2) * per_chunk  # + the pad chunk and one to grow into
    finally:
        engine.close()
        del engine
        R.free_device_memory()


def _add(engine, prompts: list[list[int]], max_tokens: int, i: int) -> None:
    from ..sampling_params import SamplingParams
    engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **REQUESTS[i][0]))


def _run(kwargs: dict[str, Any], prompts: list[list[int]], max_tokens: int,
         groups: list[tuple[list[int], int]]) -> tuple[Result, int]:
    """Groups of requests through one engine, one group after another; in a group (which,
    later), request which[0] comes first and the rest `later` steps after it.
    -> ({request: per sample (tokens, logprobs)}, preemptions)."""
    from ..config import EngineConfig
    from ..engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    try:
        done: dict[str, Any] = {}  # request id -> its finished RequestOutput
        for which, later in groups:
            _add(engine, prompts, max_tokens, which[0])
            for _ in range(later):
                done.update((o.request_id, o) for o in engine.step() if o.finished)
            for i in which[1:]:
                _add(engine, prompts, max_tokens, i)
            while engine.has_unfinished():
                done.update((o.request_id, o) for o in engine.step() if o.finished)
        results = {rid: [(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs or []])
                         for c in out.outputs] for rid, out in done.items()}
        return results, engine.stats().preemptions
    finally:
        engine.close()
        del engine
        R.free_device_memory()
