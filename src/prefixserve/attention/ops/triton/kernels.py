"""`TritonKernels`: how a backend runs a plan on the GPU (the twin of `ops.ReferenceKernels`).

plan time (host, once per step, via `PlanCache(extend=...)`): the work list of the attend
kernel (narrow and wide units, split-K merge CSR, which launches need a position mask; see
`worklist`), uploaded lazily like the plan's own arrays.
run time (per layer): store_kv; the narrow and wide attend launches (two streams); one
merge launch when the schedule merges or an item was split -- which writes the output in q's
dtype directly.
"""

from __future__ import annotations

import numpy as np
import torch

from ...base import AttentionBatch, AttentionShape
from .attend import launch_worklist, num_sms
from .merge import merge_rows
from .store import store_kv
from .worklist import NARROW_ROWS, KernelConfig, build_worklist, choose_configs


class TritonKernels:
    def __init__(self, shape: AttentionShape, configs: tuple[KernelConfig, KernelConfig] | None = None,
                 sms: int | None = None):
        """configs: fixed (narrow, wide) launch shapes (benchmarks sweep them); None: chosen per
        plan by `choose_configs`. sms: the SMs to balance over (default: the device's)."""
        self.shape = shape
        self.configs = configs
        self.group = shape.num_heads // shape.num_kv_heads
        self.sms = sms or num_sms(shape.device)
        cuda = torch.device(shape.device).type == "cuda"
        self.side = torch.cuda.Stream(shape.device) if cuda else None  # the wide launch's

    def plan_extra(self, batch: AttentionBatch,
                   arrays: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | int | None]:
        """Work list of a plan's index arrays: device arrays `narrow`, `wide` (units),
        `merge_indptr`, `merge_parts`; ints `num_partials`, `direct`, the causal flags and the
        two launch shapes."""
        s, q_len = self.shape, arrays["item_q_len"]
        wide_rows = q_len[q_len * self.group > NARROW_ROWS]
        configs = self.configs or choose_configs(int(wide_rows.max(initial=0)) * self.group,
                                                 s.head_dim, s.dtype.itemsize)
        wl = build_worklist(arrays["item_q_start"], q_len, arrays["item_out_start"],
                            arrays["item_kv_indptr"], arrays["q_pos"].size, arrays["row_indptr"],
                            arrays["row_parts"], configs, group=self.group,
                            num_kv_heads=s.num_kv_heads, chunk_size=batch.chunk_size,
                            itemsize=s.dtype.itemsize, num_sms=self.sms,
                            positions=[arrays[f] for f in ("q_pos", "kv_pos", "kv_lo", "kv_hi")])
        shapes = {f"{c}_{k}": getattr(cfg, k) for c, cfg in zip(("narrow", "wide"), configs)
                  for k in ("block_m", "block_n", "num_warps", "num_stages")}
        none_if_empty = lambda a: a if len(a) else None  # noqa: E731
        return {"narrow": none_if_empty(wl.narrow), "wide": none_if_empty(wl.wide),
                "merge_indptr": wl.merge_indptr, "merge_parts": wl.merge_parts,
                "num_partials": wl.num_partials, "direct": int(wl.direct),
                "causal_narrow": int(wl.causal[0]), "causal_wide": int(wl.causal[1]), **shapes}

    def store_kv(self, k_cache, v_cache, k, v, slots) -> None:
        store_kv(k_cache, v_cache, k, v, slots)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan,
               scale: float) -> torch.Tensor:
        """o [T, Hq, D] in q's dtype for `plan` (a DevicePlan with this object's extras)."""
        x = plan.extra
        out = torch.empty_like(q)
        if x["narrow"] is None and x["wide"] is None:
            return out
        configs = tuple(KernelConfig(*(x[f"{c}_{k}"] for k in ("block_m", "block_n", "num_warps",
                                                                "num_stages")))
                        for c in ("narrow", "wide"))
        args = (q, k_cache, v_cache, plan.q_pos, (x["narrow"], x["wide"]), plan.kv_chunk,
                plan.kv_lo, plan.kv_hi, plan.kv_pos, scale)
        causal = (bool(x["causal_narrow"]), bool(x["causal_wide"]))
        if x["direct"]:
            launch_worklist(*args, out, None, configs, causal, self.side)
            return out
        hq, d = q.shape[1:]
        o_s = torch.empty((x["num_partials"], hq, d), dtype=torch.float32, device=q.device)
        lse_s = torch.empty((x["num_partials"], hq), dtype=torch.float32, device=q.device)
        launch_worklist(*args, o_s, lse_s, configs, causal, self.side)
        merge_rows(o_s, lse_s, x["merge_indptr"], x["merge_parts"], out, None)
        return out
