"""`prefixserve serve | generate | chat | bench ...`

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser
and sets `func`; this file only wires them. Engine flags are derived from config.py's
dataclasses, so their defaults and choices have one source.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys

from .config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, SchedulerConfig

COMMANDS = ("prefixserve.commands", "prefixserve.server.cli", "prefixserve.bench.cli")

_HELP = {
    "model": "GGUF file, HF folder (config.json + *.safetensors), or config.json with "
             "--load-format dummy; default: the embedded SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer folder (default: the model's own)",
    "load_format": "how to read weights; dummy = random weights from a config.json (benchmarks)",
    "dtype": "weights/activations dtype; auto = float32 on CPU, bfloat16 on CUDA",
    "device": "auto = cuda if available, else cpu",
    "max_model_len": "context length limit (default: the model's)",
    "attention_backend": "attention schedule; auto picks per step by a bytes/FLOPs cost model",
    "seed": "seed for weights (dummy) and unseeded sampling",
    "tensor_parallel_size": "number of GPUs (or CPU processes) to split the model over",
    "tp_join_timeout": "seconds every tensor-parallel worker gets to start and join (a worker that dies "
                       "or is late ends the start with its exit code and stderr)",
    "enforce_eager": "CUDA: launch every kernel of a decode step (no CUDA graphs; for debugging "
                     "and comparison)",
    "deterministic": "a request's tokens and logprobs are bit-identical whatever else is batched or shared "
                     "with it (batch-invariant GEMMs, attention over fixed key cells; unseeded sampling "
                     "draws with --seed); slower than the default",
    "chunk_size": "tokens per KV chunk (vLLM's block size); default 64 on CUDA (one key tile of "
                  "the attention kernels), 16 on CPU",
    "kv_cache_memory": "bytes for the KV cache (default: 1 GiB on CPU, 90%% of free GPU memory)",
    "kv_cache_dtype": "KV cache element type: auto = the model's dtype; fp8 (= fp8_e4m3) = e4m3 with one "
                      "power-of-two scale per layer and KV head, fixed at start-up: half the cache memory "
                      "and bytes read (accuracy: benchmarks/kernels-notes.md)",
    "enable_prefix_caching": "find and reuse shared prefixes (off = every request its own copy)",
    "max_pinned_tokens_per_tenant": "most tokens one tenant may keep pinned (POST /v1/prefixes; public "
                                    "pins count for no tenant; default: no limit)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decode tokens)",
    "overlap_schedule": "schedule and launch each step before reading the last one's tokens, "
                        "hiding the host's work behind the device's",
}


_ARG_TYPES = {"int": int, "float": float, "str": str}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from .attention import backend_names
    g = p.add_argument_group("engine")
    fields = [f for c in (EngineConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(c)
              if f.name not in ("cache", "scheduler")]
    choices = {"dtype": ("auto", "float32", "bfloat16", "float16"), "device": ("auto", "cpu", "cuda"),
               "load_format": ("auto", "gguf", "safetensors", "dummy"), "attention_backend": backend_names(),
               "kv_cache_dtype": KV_CACHE_DTYPES}
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=_HELP[f.name])
        else:
            kind = _ARG_TYPES[str(f.type).split(" | ")[0]]  # the annotation's type ("int | None" -> int)
            g.add_argument(flag, type=kind, default=f.default, choices=choices.get(f.name), help=_HELP[f.name])


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for c in (EngineConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(c)}
    return {k: v for k, v in vars(args).items() if k in names - {"cache", "scheduler"}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixserve", description=__doc__.split("\n")[0] + "\n\n"
                                "An LLM serving engine that finds shared prefixes by itself, stores each "
                                "once, and reads each once per decode step.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG shows the attention schedule chosen)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"prefixserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
