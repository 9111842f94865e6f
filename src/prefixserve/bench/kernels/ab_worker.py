"""One arm of `prefixserve bench kernels-ab`: run by path, in a process of its own, with the arm's
source tree first on PYTHONPATH, so that every import below is that tree's.

    argv   spec.json out.pt
    spec   {"name", "tree", "device", "backend", "rows": [Workload fields]}
    out    {"us": {label: us}, "outs": {label: the step's output on the CPU}}

Each row: built (`rows.build`, seeded: the same q, K/V and tree in every arm), the backend
planned, its run() timed as `bench kernels` times it (`timing.timed`: a CUDA graph's replays, L2
flushed before each; a wall clock on the CPU). It uses only what the trees it compares share:
`Workload`, `build`, `create_backend`, `timed`.
"""

from __future__ import annotations

import json
import logging
import os
import sys

# the script's own folder is sys.path[0]; its modules must come from the arm's tree, as a package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

log = logging.getLogger("prefixserve.bench.kernels.ab")


def run(spec: dict) -> dict:
    import prefixserve
    from prefixserve.attention import create_backend
    from prefixserve.bench.kernels.rows import Workload, build
    from prefixserve.bench.kernels.timing import timed

    tree = os.path.abspath(spec["tree"])
    if not os.path.abspath(prefixserve.__file__).startswith(tree + os.sep):
        raise SystemExit(f"arm {spec['name']!r}: prefixserve came from {prefixserve.__file__}, not from {tree}")
    device = torch.device(spec["device"])
    us, outs = {}, {}
    for fields in spec["rows"]:
        w = Workload(**{**fields, "shared": tuple(fields["shared"])})
        row = build(w, device)
        be = create_backend(spec["backend"], row.shape)
        be.plan(row.batch)

        def step(be=be, row=row):
            return be.run(row.q, row.k, row.v, row.k_cache, row.v_cache, kv_scale=row.kv_scale)

        outs[w.label] = step().cpu()
        us[w.label] = 1e6 * timed(step, device)
        log.info("%s %s: %.1f us", spec["name"], w.label, us[w.label])
        del be, row
    return {"us": us, "outs": outs}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    spec_path, out_path = sys.argv[1:]
    with open(spec_path) as f:
        torch.save(run(json.load(f)), out_path)
