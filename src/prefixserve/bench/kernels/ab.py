"""`prefixserve bench kernels-ab`: two or more source trees' attention steps on the same rows.

For a change to a kernel or a plan, the question is how much faster the step is with the change
than without it, on the same machine. On a lent GPU, two machines can differ by a few percent,
and a change is often worth less than that. So each tree is timed on the same machine, in a
process of its own, alternately:

    arms     --tree NAME=PATH, twice or more: PATH is a tree's `src` folder (a worktree, or
             `git archive <commit> src | tar -x -C DIR`'s DIR/src); the first is the baseline
    rows     the rows of `bench kernels` (--grid, --batch, ..., --kv-cache-dtype)
    rounds   --rounds R: round r runs every arm once, in reverse order on odd rounds. Each run
             is one process (`ab_worker.py`, by path, PYTHONPATH = the arm's tree), which times
             --backend's planned step on every row as `bench kernels` does
    report   for each row and arm: the least time over its rounds and its ratio to the
             baseline's; the widest spread of a row's rounds (max / min - 1, over the arms); and
             whether every run's output equals the baseline's first bit for bit (the exit status
             is 1 where one does not, unless --allow-different); --json PATH writes every run's
             times too

Triton's cache is keyed by each kernel's source, so the arms' compiled kernels do not mix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

from ..results import positive
from .command import add_row_arguments, workloads

log = logging.getLogger(__name__)
WORKER = pathlib.Path(__file__).with_name("ab_worker.py")


def parse_tree(text: str) -> tuple[str, pathlib.Path]:
    name, sep, path = text.partition("=")
    tree = pathlib.Path(path)
    if not sep or not name or not (tree / "prefixserve" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH, PATH a source tree holding prefixserve/")
    return name, tree.resolve()


def run_arm(name: str, tree: pathlib.Path, spec: dict, out: pathlib.Path, spec_path: pathlib.Path) -> dict:
    """One process of arm `name`: every row's step timed, its outputs (`ab_worker.run`)."""
    spec_path.write_text(json.dumps({**spec, "name": name, "tree": str(tree)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run([sys.executable, str(WORKER), str(spec_path), str(out)], env=env)
    if done.returncode:
        raise SystemExit(f"kernels-ab: arm {name!r} ({tree}) exited {done.returncode}; its error is above")
    return torch.load(out)


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """Per row: each arm's times over its rounds, least, ratio to the first arm's, equal outputs."""
    names = list(runs)
    base = runs[names[0]][0]
    rows = []
    for label in base["us"]:
        row: dict = {"label": label, "arms": {}}
        base_least = min(r["us"][label] for r in runs[names[0]])
        for name in names:
            times = [r["us"][label] for r in runs[name]]
            least = min(times)
            row["arms"][name] = {
                "us": times, "least_us": least, "spread": max(times) / least - 1,
                "vs_first": least / base_least,
                "equal_to_first": all(torch.equal(r["outs"][label], base["outs"][label]) for r in runs[name])}
        rows.append(row)
    return rows


def print_report(rows: list[dict]) -> None:
    names = list(rows[0]["arms"])
    print("row | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:])
          + " | rounds' spread | outputs equal")
    for r in rows:
        a = r["arms"]
        print(f"{r['label']} | " + " | ".join(f"{a[n]['least_us']:.1f}" for n in names) + " | "
              + " | ".join(f"{a[n]['vs_first']:.3f}" for n in names[1:]) + " | "
              + f"{max(a[n]['spread'] for n in names):.1%} | "
              + ("yes" if all(a[n]["equal_to_first"] for n in names) else "NO"))


def main(args) -> int:
    trees = dict(args.tree)
    if len(args.tree) < 2 or len(trees) < len(args.tree):
        raise SystemExit("kernels-ab: give two or more --tree NAME=PATH, with different names")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = {"device": device, "backend": args.backend, "rows": [dataclasses.asdict(w) for w in workloads(args)]}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = list(trees.items()) if rnd % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                log.info("round %d of %d: %s (%s)", rnd + 1, args.rounds, name, tree)
                runs[name].append(run_arm(name, tree, spec, pathlib.Path(tmp) / f"{name}-{rnd}.pt",
                                          pathlib.Path(tmp) / "spec.json"))
    rows = compare(runs)
    print_report(rows)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": device, "backend": args.backend,
                                                       "trees": {n: str(t) for n, t in trees.items()},
                                                       "rounds": args.rounds, "rows": rows}, indent=1))
    return 0 if all(a["equal_to_first"] for r in rows for a in r["arms"].values()) or args.allow_different else 1


def register(sub) -> None:
    p = sub.add_parser("kernels-ab", help="attention steps of two or more source trees, alternated on one machine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=parse_tree, action="append", required=True, metavar="NAME=PATH",
                   help="an arm: NAME and a source tree's src folder (give two or more; the first is the baseline)")
    add_row_arguments(p)
    p.add_argument("--backend", default="relay", help="the attention backend whose step is timed")
    p.add_argument("--rounds", type=positive, default=2, help="runs of every arm, alternated")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every run's times here")
    p.add_argument("--allow-different", action="store_true",
                   help="exit 0 even where an arm's outputs differ from the baseline's (a change of summation order)")
    p.set_defaults(func=main, _parser=p)
