"""`prefixserve bench kv-accuracy`: how far an fp8 KV cache moves greedy outputs from the 16-bit one.

    prefixserve bench kv-accuracy                       (the embedded model, real weights)
    prefixserve bench kv-accuracy --model benchmarks/configs/llama-2-7b.json --load-format dummy ...

The `sharegpt` workload (real first turns after a system prompt, greedy, eos ignored) runs
twice through the same engine settings, with kv_cache_dtype auto and fp8. Per request, the two
greedy outputs agree up to their first differing token; reported:

    identical            fraction of requests whose whole outputs are the same
    agreement            mean over requests of (tokens before the first difference) / output length
    first_token          fraction whose first generated token is the same (the prompt's logits)
    mean_abs_logprob     mean |logprob(fp8) - logprob(16-bit)| of the chosen token, over the
                         positions both runs reach with the same context (before the first difference)
    max_abs_logprob      the largest of those

Past a first difference the two runs continue from different texts, so their later tokens say
nothing about the cache; the agreed prefix is the honest comparison. Writes
kv-accuracy-sharegpt-<model>-<hardware>.json (results.publish).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from . import results as R

log = logging.getLogger(__name__)


def register(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("kv-accuracy", help="fp8 KV cache: greedy agreement and logprob difference vs 16-bit",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="ShareGPT requests")
    p.add_argument("--system-prompt-len", type=int, default=256, help="tokens of the shared system prompt")
    p.add_argument("--max-output-len", type=int, default=64, help="tokens generated per request (at most)")
    p.add_argument("--prompt-seed", type=int, default=0, help="which ShareGPT conversations")
    R.add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    from ..cli import engine_kwargs
    from .workloads import sharegpt, token_source
    R.set_threads(args.threads)
    base = {**engine_kwargs(args), "kv_cache_dtype": "auto"}
    hw, model = R.hardware(), R.model_name(base)
    work = sharegpt(token_source(base), args.system_prompt_len, args.num_prompts, args.max_output_len,
                    seed=args.prompt_seed)
    wide, fp8 = (_greedy({**base, "kv_cache_dtype": dt}, work.prompts, work.params, not args.no_progress)
                 for dt in ("auto", "fp8"))
    doc = {"benchmark": "fp8 KV cache vs the model dtype's: greedy outputs over ShareGPT",
           "workload": work.settings, **compare(wide, fp8), "model": model, "hardware": hw}
    R.print_table([doc], [("requests", "requests", "d"), ("identical", "identical", ".3f"),
                          ("agreement", "agreement", ".3f"), ("first token", "first_token", ".3f"),
                          ("mean |dlogprob|", "mean_abs_logprob", ".4f"), ("max |dlogprob|", "max_abs_logprob", ".3f")])
    R.publish(doc, R.result_path(args.out_dir, "kv-accuracy", "sharegpt", model, hw, args.tag), args,
              "prefixserve bench kv-accuracy")
    return 0


Output = list[tuple[list[int], list[float]]]  # per request: tokens, the chosen tokens' logprobs


def _greedy(kwargs: dict[str, Any], prompts: list[list[int]], params: list[Any], progress: bool) -> Output:
    import dataclasses

    from ..llm import LLM
    llm = LLM(**kwargs)
    try:
        params = [dataclasses.replace(p, logprobs=0) for p in params]
        outs = llm.generate(prompts, params, use_tqdm=progress)
        return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [], strict=True)])
                for c in (o.outputs[0] for o in outs)]
    finally:
        llm.close()
        R.free_device_memory()


def compare(wide: Output, fp8: Output) -> dict[str, Any]:
    """The metrics of the module docstring, per request pair (tokens, logprobs)."""
    agreed, diffs, identical, first = [], [], 0, 0
    for (ta, la), (tb, lb) in zip(wide, fp8, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(ta, tb, strict=True)) if a != b), len(ta))
        agreed.append(n / len(ta))
        identical += n == len(ta)
        first += n > 0
        # the same token over the same context: the positions before the first difference
        diffs += [abs(a - b) for a, b in zip(la[:n], lb[:n], strict=True)]
    return {"requests": len(wide), "identical": identical / len(wide), "agreement": sum(agreed) / len(wide),
            "first_token": first / len(wide), "mean_abs_logprob": sum(diffs) / max(1, len(diffs)),
            "max_abs_logprob": max(diffs, default=0.0), "positions_compared": len(diffs), "agreed_fraction": agreed}
