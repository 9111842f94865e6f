"""`TritonKernels`: how a backend runs a plan on the GPU (the twin of `ops.ReferenceKernels`).

plan time (host, once per step, via `PlanCache(extend=...)`): the work list of the attend
kernel (narrow and wide units with their device counts, split-K merge CSR, which launches need
a position mask; see `worklist`), uploaded lazily like the plan's own arrays.
run time (per layer): store_kv, unless the attend units write the new keys themselves (a
decode step: `worklist.mark_stores`); the narrow and wide attend launches (persistent grids;
the narrow one beside the wide one, by PDL where `launch.pdl_beside` says so, else on a second
stream); one merge launch when the schedule merges or an item was split -- which
writes the output in q's dtype directly -- unless the narrow units merge their rows
(`worklist`'s `fused`: then the narrow launch follows the wide one on one stream, started
beside it by programmatic dependent launch, and writes the output).

A padded plan (a CUDA-graph decode step) fixes everything a captured launch bakes in: the
launch shapes (chosen for the graph's padded row count), the grids (programs_per_sm x SMs,
whatever the unit counts), always the merge (over all padded rows), and the fp32 scratch rows,
taken from a buffer that only grows (`generation` counts its moves, and the changes of
whether the units store the new keys, which a graph bakes in as well).
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import torch

from ...base import AttentionBatch, AttentionShape
from ...plan import DeviceExtras, DevicePlan, HostArrays, HostExtras, required
from .configs import NARROW_ROWS, WALK_OVER_TAILS, KernelConfig, choose_configs, wide_pairs
from .launch import Launch, grid_size, hopper_module, launch_worklist, num_sms
from .merge import UNROLL, merge_rows, unroll_for
from .store import store_kv
from .worklist import WorkList, build_worklist, items_need_causal

# a launch shape in a plan's extras: every field of KernelConfig as an int (its bools as 0 / 1)
_SHAPE_FIELDS = dataclasses.fields(KernelConfig)
_BOOL_FIELDS = {name for name, t in typing.get_type_hints(KernelConfig).items() if t is bool}


class TritonKernels:
    def __init__(self, shape: AttentionShape, configs: tuple[KernelConfig, KernelConfig] | None = None,
                 sms: int | None = None) -> None:
        """configs: fixed (narrow, wide) launch shapes (benchmarks sweep them); None: chosen per
        plan by `choose_configs`. sms: the SMs to balance over (default: the device's)."""
        self.shape = shape
        self.configs = configs
        self.group = shape.num_heads // shape.num_kv_heads
        self.sms = sms or num_sms(shape.device)
        cuda = torch.device(shape.device).type == "cuda"
        # the wide launch's stream. High priority: torch hands out streams round-robin from a
        # pool of 32 per priority, and graph captures (ours, the benchmarks') take theirs from
        # the default pool; a side stream equal to the capture stream serialized the two
        # launches (measured: 288 vs 274 us on Table 3 n_p 4096, n_s 2048)
        self.side = torch.cuda.Stream(shape.device, priority=-1) if cuda else None  # type: ignore[no-untyped-call]  # torch's Stream.__new__ is unannotated
        self.generation = 0  # moves of the padded plans' scratch buffers, changes of `stores`
        # each launch class's work counter for dynamic launches, zero between launches (the
        # classes run concurrently; a class's launches run one after another on its stream)
        self.queues = torch.zeros((2, 1), dtype=torch.int32, device=shape.device)
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # what a padded plan bakes into its graph besides shapes: stores (any, narrow, wide), fused,
        # the narrow launch beside the wide one (`merge_beside`), its swapped walk (`tails`), the
        # wide kernel's tiles (`pairs`)
        self._padded_baked: tuple[bool, bool, bool, bool, bool, bool, bool] | None = None
        self._tails = False  # the last plan's narrow units took the swapped walk (`_tails_flips`)

    def plan_extra(self, batch: AttentionBatch, arrays: HostArrays) -> HostExtras:
        """Work list of a plan's index arrays: device arrays `narrow`, `wide` (units),
        `unit_counts` (per launch: its units, the programs that take them), `merge_indptr`,
        `merge_parts`; ints `num_partials`, `direct`, `stores` and per launch whether it stores,
        the causal flags, the two launch shapes and grids, the merge's partials a chunk."""
        s, q_len, padded = self.shape, required(arrays, "item_q_len"), batch.padded is not None
        wide_rows = q_len[q_len * self.group > NARROW_ROWS]
        # a graph's launch shapes are fixed by its row count (an item holds at most all rows)
        rows_hint = (batch.padded.rows if batch.padded else int(wide_rows.max(initial=0))) * self.group
        # the shapes of the kernel that will run the wide units: Gluon's takes no window, no
        # position mask over an fp8 cache (a prompt's rows) and stores no new key (G >
        # NARROW_ROWS: the decode tails are wide units): the Triton kernel runs those
        positions = [required(arrays, f) for f in ("q_pos", "kv_pos", "kv_lo", "kv_hi")]
        gluon = (_gluon_wide(s, batch.chunk_size) and not batch.windowed
                 and self.group <= NARROW_ROWS
                 and (s.kv_itemsize != 1
                      or not items_need_causal(required(arrays, "item_q_start"), q_len,
                                               required(arrays, "item_kv_indptr"),
                                               q_len * self.group > NARROW_ROWS, *positions)))
        # the narrow units' row walk: G 1 and none needs the position mask (a graph's step is a
        # decode step: asserted below)
        walk = (self.group == 1 and not batch.windowed and _gluon_rows(s)
                and (padded or not items_need_causal(required(arrays, "item_q_start"), q_len,
                                                     required(arrays, "item_kv_indptr"),
                                                     q_len <= NARROW_ROWS, *positions)))
        # the narrow units' swapped walk (G 2-16, a 16-bit cache): as the row walk, decode only
        tails = (not batch.windowed and _gluon_tails(s)
                 and (padded or not items_need_causal(required(arrays, "item_q_start"), q_len,
                                                      required(arrays, "item_kv_indptr"),
                                                      q_len * self.group <= NARROW_ROWS, *positions)))
        fp8 = s.kv_itemsize == 1
        # (the swapped walk's shape first only where the last plan took it: the choice below
        # needs a work list, and a second one costs host time that a host-bound step pays)
        configs = self.configs or choose_configs(rows_hint, s.head_dim, s.dtype.itemsize, gluon, fp8=fp8, walk=walk,
                                                 tails=tails and self._tails)

        def work_list(configs: tuple[KernelConfig, KernelConfig]) -> WorkList:
            return build_worklist(required(arrays, "item_q_start"), q_len, required(arrays, "item_out_start"),
                                  required(arrays, "item_kv_indptr"), required(arrays, "q_pos").size,
                                  arrays["row_indptr"], arrays["row_parts"], configs, group=self.group,
                                  num_kv_heads=s.num_kv_heads, chunk_size=batch.chunk_size,
                                  itemsize=s.kv_itemsize, num_sms=self.sms, positions=positions,
                                  kv_chunk=required(arrays, "kv_chunk"), force_merge=padded)

        wl = work_list(configs)
        assert not (padded and any(wl.causal)), "a padded (graph) step must be a decode step"
        shared, own = (_mean_entries(required(arrays, "item_kv_indptr"), q_len * self.group > NARROW_ROWS)
                       if (gluon or tails) and not self.configs else (0.0, 0.0))  # (read by the choices below)
        if configs[0].after_wide and wl.wide_sms < self.sms:  # the walk beside the wide units after all
            configs = (dataclasses.replace(configs[0], after_wide=False, merge_beside=True), configs[1])
        elif tails and not self.configs and self._tails_flips(configs[0].tails, len(wl.wide), wl.wide_sms, configs[1],
                                                              shared, own):
            # the swapped walk only where it streams the tails faster than the Triton kernel's
            # programs (either shape's work list gives the wide units the same SMs)
            configs = (choose_configs(rows_hint, s.head_dim, s.dtype.itemsize, gluon, tails=self._tails)[0],
                       configs[1])
            wl = work_list(configs)
        elif configs[0].walk and not fp8 and not self.configs:
            # a 16-bit cache's walk runs only beside them: elsewhere the Triton kernel's units
            # (a second work list -- 0.6 ms more of host time a plan on Table 3's shapes, which
            # the engine's overlapped scheduling plans under the previous step -- only where a
            # G 1 model's walk could have run beside)
            configs = (choose_configs(rows_hint, s.head_dim, s.dtype.itemsize, gluon)[0], configs[1])
            wl = work_list(configs)
        stores = (wl.stores, bool(wl.stores and (wl.narrow[:, 5] != -1).any()),
                  bool(wl.stores and (wl.wide[:, 5] != -1).any()))  # (any, narrow, wide)
        if gluon and not self.configs and not wl.causal[1]:  # the wide launch over chunk pairs where
            # the products bound a decode step
            if (not configs[0].tails  # (the swapped walk's CTA beside the pairs' does not fit an SM)
                    and wide_pairs(configs[1], batch.chunk_size, fp8, stores[2], wl.wide_sms == self.sms, shared, own)):
                configs = (configs[0], dataclasses.replace(configs[1], pairs=True))
        if padded:
            self._reserve_scratch(wl.num_partials)
            # (fixed in practice: decode tails are narrow units iff G <= 16; the narrow units
            # merge unless a row's tail is split; the walk beside -- and over a 16-bit cache the
            # walk itself -- flips as the tails outgrow half the shared keys: about once in a
            # batch's life, each flip one more capture)
            baked = (*stores, wl.fused is not None, configs[0].merge_beside, configs[0].tails, configs[1].pairs)
            if baked != self._padded_baked:
                self._padded_baked = baked
                self.generation += 1
        shapes = {f"{c}_{f.name}": getattr(cfg, f.name) for c, cfg in zip(("narrow", "wide"), configs, strict=True)
                  for f in _SHAPE_FIELDS}
        # the programs that take each launch's units (the wide one's may leave SMs to the narrow
        # one: `grids.wide_sms`), and its grid: those, or in a graph the fixed full grid
        takers = [grid_size(len(u), s.num_kv_heads, cfg, sms, fixed=False) for u, cfg, sms in
                  zip((wl.narrow, wl.wide), configs, (self.sms, wl.wide_sms), strict=True)]
        grids = {f"{c}_programs": grid_size(0, 0, cfg, self.sms, fixed=True) if padded else n
                 for c, cfg, n in zip(("narrow", "wide"), configs, takers, strict=True)}
        if self.group > NARROW_ROWS:  # one row's G heads exceed a narrow tile: never a narrow unit
            grids["narrow_programs"] = 0
        return {"narrow": _addressable(wl.narrow), "wide": _addressable(wl.wide),
                "unit_counts": np.array([len(wl.narrow), max(1, takers[0]), len(wl.wide), max(1, takers[1])],
                                        np.int64),
                "merge_indptr": wl.merge_indptr, "merge_parts": wl.merge_parts,
                # a graph keeps the chunk it was captured with: the largest, right for any plan
                "merge_unroll": UNROLL if padded else unroll_for(wl.merge_indptr),
                "fused": int(wl.fused is not None),
                "merge_rows": None if wl.fused is None else _addressable(wl.fused),
                "merge_others": None if wl.others is None else _addressable(wl.others),
                "num_partials": wl.num_partials, "direct": int(wl.direct), "stores": int(wl.stores),
                "stores_narrow": int(stores[1]), "stores_wide": int(stores[2]),
                "causal_narrow": int(wl.causal[0]), "causal_wide": int(wl.causal[1]),
                **shapes, **grids}

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, plan: DevicePlan, scale: float, window: int | None = None,
            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v [R, Hkv, D] at plan.slots; o [R, Hq, D] in q's dtype for `plan` (a
        DevicePlan with this object's extras); window: a sliding layer's; kv_scale: an fp8
        cache's [4, Hkv]."""
        x, new_kv = plan.extra, (k, v, plan.slots)
        if not _int(x, "stores"):
            store_kv(k_cache, v_cache, k, v, plan.slots, kv_scale)
        args = (q, k_cache, v_cache, plan.q_pos, self.launches(x), plan.kv_chunk, plan.kv_lo,
                plan.kv_hi, plan.kv_pos, scale)
        out = torch.empty_like(q)
        if _int(x, "direct"):
            launch_worklist(*args, out, None, self.side, new_kv, window, kv_scale)
            return out
        scratch = self._scratch if plan.padded else self._new_scratch(_int(x, "num_partials"))
        assert scratch is not None, "plan_extra reserves a padded plan's scratch"
        o_s, lse_s = scratch
        beside = launch_worklist(*args, o_s, lse_s, self.side, new_kv, window, kv_scale,
                                 final=(out, None))
        if not _int(x, "fused"):
            merge_rows(o_s, lse_s, _tensor(x, "merge_indptr"), _tensor(x, "merge_parts"), out, None,
                       pdl=beside, unroll=_int(x, "merge_unroll"))
        return out

    def _tails_flips(self, taken: bool, wide_units: int, wide_sms: int, wide: KernelConfig, shared: float,
                     own: float) -> bool:
        """Whether the narrow units' shape must flip to (or from) the swapped walk's: it runs
        where the wide units (`wide_units` x KV heads over `wide_sms` SMs) leave a quarter of
        the SMs or more, or fill one wave of them at most while a wide item walks fewer than
        WALK_OVER_TAILS x a tail's entries (`shared`, `own`: the means). On an H200 beside
        the products on every SM the walk took 1-9% less time than the chunk pairs or the
        Triton kernel there (b256, G 4, 2-16K shared keys, 64-256-key tails), up to 6% more
        beside two waves (b1024) or at 85x (kernels-notes.md, issue 25 part twenty-nine). Remembers
        the choice for the next plan's first try."""
        heads = self.shape.num_kv_heads
        self._tails = (4 * grid_size(wide_units, heads, wide, wide_sms, fixed=False) <= 3 * self.sms
                       or (wide_units * heads <= self.sms and shared < WALK_OVER_TAILS * own))
        return self._tails != taken

    @staticmethod
    def launch_config(extra: DeviceExtras, cls: str) -> KernelConfig:
        fields: dict[str, typing.Any] = {f.name: _int(extra, f"{cls}_{f.name}") for f in _SHAPE_FIELDS}
        return KernelConfig(**{k: bool(v) if k in _BOOL_FIELDS else v for k, v in fields.items()})

    def launches(self, x: DeviceExtras) -> tuple[Launch, Launch]:
        """The (narrow, wide) launches of a plan's extras `x`."""
        cfgs = [self.launch_config(x, c) for c in ("narrow", "wide")]
        narrow, wide = (Launch(_tensor(x, c), _tensor(x, "unit_counts")[2 * i:2 * i + 2], cfg, bool(x[f"causal_{c}"]),
                               _int(x, f"{c}_programs"), bool(x[f"stores_{c}"]),
                               self.queues[i] if cfg.dynamic else None)
                        for i, (c, cfg) in enumerate(zip(("narrow", "wide"), cfgs, strict=True)))
        if _int(x, "fused"):
            narrow = dataclasses.replace(narrow, merge=(_tensor(x, "merge_rows"), _tensor(x, "merge_others")))
        return narrow, wide

    def _new_scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 partials o [rows, Hq, D] and lse [rows, Hq]."""
        s = self.shape
        return (torch.empty((rows, s.num_heads, s.head_dim), dtype=torch.float32, device=s.device),
                torch.empty((rows, s.num_heads), dtype=torch.float32, device=s.device))

    def _reserve_scratch(self, rows: int) -> None:
        if self._scratch is None or self._scratch[1].shape[0] < rows:
            self._scratch = self._new_scratch(max(256, 1 << (rows - 1).bit_length()))
            self.generation += 1


def _gluon_wide(shape: AttentionShape, chunk_size: int) -> bool:
    """Whether this shape's decode wide launches run the Gluon kernel."""
    if torch.device(shape.device).type != "cuda":
        return False
    hopper = hopper_module()
    return hopper is not None and hopper.supports(shape.device, shape.dtype, shape.kv_dtype or shape.dtype,
                                                  shape.head_dim, chunk_size)


def _gluon_rows(shape: AttentionShape) -> bool:
    """Whether this shape's narrow launches may run the Gluon row walk (`hopper_rows`)."""
    return _gluon_narrow(shape, "hopper_rows")


def _gluon_tails(shape: AttentionShape) -> bool:
    """Whether this shape's narrow launches may run the Gluon swapped walk (`hopper_tails`)."""
    return _gluon_narrow(shape, "hopper_tails")


def _gluon_narrow(shape: AttentionShape, name: str) -> bool:
    if torch.device(shape.device).type != "cuda":
        return False
    module = hopper_module(name)
    return module is not None and module.supports(shape.device, shape.dtype, shape.kv_dtype or shape.dtype,
                                                  shape.num_heads // shape.num_kv_heads, shape.head_dim)


def _mean_entries(item_kv_indptr: np.ndarray, is_wide: np.ndarray) -> tuple[float, float]:
    """The mean entries of a wide item and of a narrow one (0 where there is none)."""
    entries = np.diff(item_kv_indptr)
    shared, own = (float(entries[m].mean()) if m.any() else 0.0 for m in (is_wide, ~is_wide))
    return shared, own


def _int(x: DeviceExtras, name: str) -> int:
    """An int of `plan_extra`'s (the plan cache hands ints on as they are)."""
    value = x[name]
    assert isinstance(value, int), name
    return value


def _tensor(x: DeviceExtras, name: str) -> torch.Tensor:
    """An array of `plan_extra`'s, on the device (the merge CSR is None in a `direct` plan)."""
    value = x[name]
    assert isinstance(value, torch.Tensor), name
    return value


def _addressable(units: np.ndarray) -> np.ndarray:
    """units [U, ...], at least one row (an unused zero row when U = 0; `unit_counts` says U): an
    empty device tensor has no address (`data_ptr()` is 0), so a graph captured with no units of
    a class would replay a later step's units from address 0 (an illegal address on the GPU)."""
    return units if len(units) else np.zeros((1, *units.shape[1:]), units.dtype)
