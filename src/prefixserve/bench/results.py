"""What the end-to-end benchmarks share: the configs compared, the hardware, the result files.

Configs are the seeds' systems, each one engine setting (RelayAttention's names in brackets):

    paged-nocache  paged backend, prefix caching off   every request computes and stores its own prompt ("vLLM")
    paged          paged backend, prefix caching on    shared prefixes stored and computed once, read per sequence ("vLLM-PS")
    relay | hydragen | chunk | auto                    that backend, caching on: shared prefixes also read once per step
    auto-det       auto in deterministic mode          bit-identical outputs whatever the batch (its cost: `det_vs_default`)
    auto-fp8       auto over an fp8 KV cache           half the K/V bytes; not the 16-bit model's outputs (`fp8_vs_default`)
    no-attention   attention skipped, caching on       Hydragen's throughput ceiling (outputs meaningless)

A result file is `{bench}-{workload}-{model}-{hardware}.json` (+ `.png`) under
benchmarks/results/, e.g. `throughput-sharegpt-SmolLM2-135M-Instruct-cpu.json`. Every bench
writes it with `publish`, which adds what makes a result reproducible: the command, the git
commit and whether the tree had uncommitted changes, the hardware and the date. The rest of the
top level names the model and workload; `results` holds one entry per (config, sweep point).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "paged-nocache": {"attention_backend": "paged", "enable_prefix_caching": False},
    "paged": {"attention_backend": "paged", "enable_prefix_caching": True},
    "relay": {"attention_backend": "relay", "enable_prefix_caching": True},
    "hydragen": {"attention_backend": "hydragen", "enable_prefix_caching": True},
    "chunk": {"attention_backend": "chunk", "enable_prefix_caching": True},
    "auto": {"attention_backend": "auto", "enable_prefix_caching": True},
    "auto-det": {"attention_backend": "auto", "enable_prefix_caching": True, "deterministic": True},
    "auto-fp8": {"attention_backend": "auto", "enable_prefix_caching": True, "kv_cache_dtype": "fp8"},
    "no-attention": {"attention_backend": "no-attention", "enable_prefix_caching": True},
}
BASELINE, CEILING = "paged-nocache", "no-attention"
INEXACT = frozenset({CEILING, "auto-fp8"})  # configs whose outputs are not the (16-bit cache) model's
DEFAULT_OUT_DIR = Path("benchmarks") / "results"
ENGINE_FLAGS_NOTE = ("Each config sets --attention-backend and --[no-]enable-prefix-caching; the other "
                     "engine flags apply to every config.")
_SECRET = frozenset({"api_key"})  # never written into a result's `command`


# ---- argument parsing ------------------------------------------------------------------------
def config_list(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown config(s) {bad}; choose from {', '.join(CONFIGS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a config is listed twice: {text}")
    return names


def positive(text: str) -> int:
    """An option's integer of 1 or more."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers (inf allowed), got {text!r}")
    return values


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run and output")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU: torch intra-op threads (default: torch's). On a shared machine 1 is steadier: "
                        "spinning threads that lose their core slow every op down several-fold")
    g.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where the JSON and PNG go")
    g.add_argument("--tag", default="", help="appended to the file names (e.g. a variant of the workload)")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace, prog: str) -> str:
    """The shell command that reproduces `args`: every option that differs from its default."""
    words = prog.split()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or action.dest in _SECRET:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            words.append(flag)
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return shlex.join(words)


# ---- hardware and names ----------------------------------------------------------------------
def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        import torch
        torch.set_num_threads(threads)


def hardware() -> dict[str, Any]:
    """The device the engine runs on: GPU name and count, or CPU model and cores."""
    import torch
    if torch.cuda.is_available():
        return {"device": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return {"device": "cpu", "name": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load: on a shared machine, what else ran beside the benchmark."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_slug(hw: dict[str, Any]) -> str:
    """`cpu`, or the GPU's name without its vendor: `h100-80gb-hbm3`."""
    if hw["device"] == "cpu":
        return "cpu"
    name = re.sub(r"^nvidia\s+", "", hw["name"].lower())
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return slug + (f"-x{hw['count']}" if hw.get("count", 1) > 1 else "")


def model_name(engine_kwargs: dict[str, Any]) -> str:
    """The name results are filed under (without loading the model)."""
    from ..config import EngineConfig
    from ..model import loader
    name = loader.resolve(EngineConfig.from_kwargs(**engine_kwargs)).name
    model = engine_kwargs.get("model")
    if model and Path(model).name == "config.json":  # a lone config.json: name it by its folder
        name = Path(model).resolve().parent.name
    return re.sub(r"\.(gguf|json)$", "", name)  # llama-2-7b.json: by its stem


def result_path(out_dir: Path, bench: str, workload: str, model: str, hw: dict, tag: str = "") -> Path:
    parts = [bench, workload, model, hardware_slug(hw)] + ([tag] if tag else [])
    return Path(out_dir) / ("-".join(p.replace("/", "_") for p in parts) + ".json")


def publish(doc: dict, path: Path, args: argparse.Namespace, prog: str,
            plot: Callable[[dict, Path], None] | None = None, partial: bool = False) -> Path:
    """Write a bench's result `doc` to `path` (JSON) and `plot` it beside it (PNG, unless
    --no-plot), then say so. Adds to `doc`: `command` (the `prog` command line that reproduces
    `args`), `git` ({commit, dirty}, both None outside a git checkout), `hardware` (unless the
    bench set it) and `created`. `partial`: a checkpoint of a long run, the JSON only, silently."""
    doc.update(command=command_line(args._parser, args, prog), git=git_state(),
               hardware=doc.get("hardware") or hardware(), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_json(path, doc)
    if partial:
        return path
    png = path.with_suffix(".png")
    draw = None if getattr(args, "no_plot", False) else plot
    if draw is not None:
        draw(doc, png)
    print(f"wrote {path}" + (f" and {png.name}" if draw is not None else ""))
    return path


def git_state() -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (tracked files; untracked
    ones are ignored), or None for both where git or the checkout is absent."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent, timeout=30).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=2, default=_jsonable, allow_nan=False) + "\n")


def _finite(value):
    """JSON has no infinity: an infinite request rate is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing, zero or infinite."""
    if not a or not b or math.isinf(a) or math.isinf(b):
        return None
    return round(a / b, 4)


def free_device_memory() -> None:
    """After `del llm`: collect it now, and give CUDA's cached blocks back."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the printed table -------------------------------------------------------------------------
def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """columns: (heading, key, format spec); a missing or None value prints as '-'."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append([_cell(row.get(k), spec) for _, k, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))))


def _cell(value, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec) if spec else str(value)
