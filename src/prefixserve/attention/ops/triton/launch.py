"""The attend launches, host side: which kernel runs a launch, its checks and arguments, its grid.

    launch_units    one launch of work units: the Gluon row walk (`hopper_rows`) or the Gluon
                    wide launch (`hopper`, over chunk pairs `hopper_pairs` where the config's
                    `pairs` says so) where the launch's config asks for it and it applies
                    (sm_90, the Triton they are tested on: `hopper_module`), else the Triton
                    kernel (`attend`), its persistent grid trimmed to the programs the GPU holds
                    at once (`resident_programs`)
    launch_worklist a plan's two launches (narrow, wide): the narrow one started beside the
                    Gluon wide one by PDL (`pdl_beside`; elsewhere with the wide one forked on
                    a side stream), or after it where its units merge (`Merge`, PDL too) or
                    where it runs after it
    attend_items    twin of `ops.reference.attend_items` on these: the work list built on the
                    host, both launches, then the merge launch (`merge.merge_rows`)

Shapes and dtypes are asserted here, before a launch (the kernels check nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from types import ModuleType

import numpy as np
import numpy.typing as npt
import torch
import triton

from ..reference import FP8
from .attend import _LOG2E, MERGE_CHUNK, _attend_kernel
from .configs import NARROW_ROWS, KernelConfig, choose_configs, next_pow2
from .merge import merge_rows, unroll_for
from .worklist import build_worklist

GLUON_TRITON = (3, 6)  # the Triton whose Gluon (an experimental API) the Hopper kernel is tested on
log = logging.getLogger(__name__)


def gluon_tested(version: str) -> bool:
    """Whether Triton `version` (e.g. "3.6.0") is the one the Gluon kernel is tested on."""
    return tuple(int(x) for x in version.split(".")[:2]) == GLUON_TRITON


@functools.cache
def hopper_module(name: str = "hopper") -> ModuleType | None:
    """`ops.triton.<name>`, a Gluon launch for sm_90 (hopper: the wide launch; hopper_rows: the
    narrow row walk; hopper_tails: the narrow swapped walk), where this Triton is the one it
    was written and tested against; None elsewhere (the Triton kernel runs every launch).
    Imported on first use: it loads Gluon, which only a GPU run needs."""
    if not gluon_tested(triton.__version__):
        log.info("triton %s: the Gluon launches are tested on %d.%d only; using the Triton "
                 "kernel for every launch", triton.__version__, *GLUON_TRITON)
        return None
    return importlib.import_module(f".{name}", __package__)


NewKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # k, v [T, Hkv, D], slots [T] int64


@dataclasses.dataclass(frozen=True)
class Merge:
    """What a merging narrow launch reads (MERGE, worklist's `fused`)."""

    rows: torch.Tensor  # [>= Un, 3] int32: each unit's (final row, others start, count)
    others: torch.Tensor  # [>= M] int32: scratch rows
    o_parts: torch.Tensor  # [S, Hq, D] fp32: the wide launch's partials (the scratch rows)
    lse_parts: torch.Tensor  # [S, Hq] fp32
    pdl: bool  # launched beside the wide launch, which triggers it (CUDA: programmatic dependent launch)


def launch_units(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                 units: torch.Tensor, count: torch.Tensor, kv_chunk: torch.Tensor, kv_lo: torch.Tensor,
                 kv_hi: torch.Tensor, kv_pos: torch.Tensor, scale: float, o: torch.Tensor,
                 lse: torch.Tensor | None, cfg: KernelConfig, causal: bool, programs: int,
                 new_kv: NewKV | None = None, window: int | None = None,
                 kv_scale: torch.Tensor | None = None, queue: torch.Tensor | None = None,
                 merge: Merge | None = None, trigger: bool = False, beside: bool = False) -> None:
    """Run the first count[0] units of `units` ([>= count, 6] int32, see worklist; count: [2]
    int32 on the device, so a CUDA graph replays any number) on a persistent grid of
    `programs` programs (in the Gluon wide kernel, count[1] of them: `hopper._items`),
    into o [*, Hq, D] (any float dtype) and, unless lse is None, lse [*, Hq] fp32 at the units'
    out rows. causal=False promises that every row sees every key of its units (decode), which
    drops the position mask. new_kv: (k [T, Hkv, D], v, slots [T] int64) for units that store
    their row's new key (worklist `stores`). window: a sliding layer's (then every launch masks
    by position, both bounds); None: none. kv_scale: [4, Hkv] fp32, given iff the cache is fp8.
    queue: [1] int32 on the device, zero (and zero again after the launch: `attend._take`),
    given iff cfg.dynamic. merge: the units merge their rows (o, lse are then the final rows: see MERGE);
    trigger: a launch follows this one beside it (PDL); beside: this launch is that one (its
    programs end only after the triggering launch has, so the next kernel sees both; a
    merging launch says so in `merge.pdl`)."""
    t, hq, d = q.shape
    n_chunks, chunk_size, hkv, d_cache = k_cache.shape
    assert d_cache == d and hq % hkv == 0 and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and units.is_contiguous()
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and o.shape[1:] == q.shape[1:]
    assert k_cache.dtype == v_cache.dtype in (q.dtype, FP8), (q.dtype, k_cache.dtype)
    fp8 = k_cache.dtype == FP8
    assert fp8 == (kv_scale is not None), "an fp8 cache, and only it, has scales"
    assert kv_scale is None or (kv_scale.shape == (4, hkv) and kv_scale.dtype == torch.float32)
    assert units.dtype == torch.int32 and units.dim() == 2 and units.shape[1] == 6
    assert count.shape == (2,), count.shape
    for idx in (q_pos, count, kv_chunk, kv_lo, kv_hi, kv_pos):
        assert idx.dtype == torch.int32 and idx.device == q.device
    assert lse is None or (lse.dtype == torch.float32 and lse.shape == o.shape[:2])
    assert cfg.dynamic == (queue is not None), "a dynamic launch, and only it, takes a queue"
    assert queue is None or (queue.dtype == torch.int32 and queue.shape == (1,))
    assert merge is None or not cfg.dynamic or cfg.merge_beside or (cfg.after_wide and not merge.pdl), \
        "a merging launch that takes units from a counter runs after the wide one"
    if programs == 0:  # (the narrow class is empty when G > NARROW_ROWS)
        return
    g = hq // hkv
    assert cfg.block_m >= g, "a KV head's G query heads must fit one tile"
    k, v, slots = new_kv or (k_cache, v_cache, None)  # no store: any pointers
    if slots is not None:  # new_kv
        assert k.shape == v.shape and k.shape[1:] == k_cache.shape[2:]
        assert slots.shape == k.shape[:1]
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and slots.dtype == torch.int64
    cuda = q.device.type == "cuda"
    if merge is not None:
        parts = (merge.rows, merge.others, merge.o_parts, merge.lse_parts)
        assert merge.o_parts.dtype == merge.lse_parts.dtype == torch.float32
        assert merge.rows.dtype == merge.others.dtype == torch.int32
        assert merge.o_parts.stride(-1) == 1 and merge.lse_parts.stride(-1) == 1
        part_strides = (merge.o_parts.stride(0), merge.o_parts.stride(1), merge.lse_parts.stride(0))
    else:
        parts, part_strides = (q_pos, q_pos, o, o), (0, 0, 0)
    args = (q, k_cache, v_cache, q_pos, units, count, kv_chunk, kv_lo, kv_hi, kv_pos, o,
            o if lse is None else lse, k, v, q_pos if slots is None else slots,
            q_pos if kv_scale is None else kv_scale, q_pos if queue is None else queue, *parts,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1), 0 if lse is None else lse.stride(0),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *part_strides, scale * _LOG2E,
            chunk_size, window or 0)
    pdl = (merge.pdl if merge is not None else beside) and cuda
    meta: dict[str, int | bool | str] = dict(
        HKV=hkv, G=g, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, C_PAD=next_pow2(chunk_size), CAUSAL=causal, SLIDING=window is not None,
        WRITE_LSE=lse is not None, STORE=new_kv is not None, FP8_CACHE=fp8, DYNAMIC=cfg.dynamic,
        MERGE=merge is not None, PDL=pdl, TRIGGER=trigger and cuda, CHUNK=MERGE_CHUNK,
        ROW_KEYS=new_kv is not None and cfg.block_m > NARROW_ROWS,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # the interpreter (CPU tensors) multiplies raw bf16 bits in tl.dot (triton 3.9): upcast
        # there, exactly (the products are then of the same bf16 values, in fp32)
        DOT_FP32=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        meta["maxnreg"] = cfg.maxnreg
    if pdl:
        meta["launch_pdl"] = True
    if cuda:
        tails = hopper_module("hopper_tails") if cfg.tails else None
        if tails and tails.applies(q, k_cache, cfg.block_n, causal, window):
            tails.launch(q, k_cache, v_cache, units, count, kv_chunk, kv_lo, kv_hi, scale, o, lse, programs,
                         cfg.num_stages, cfg.maxnreg, new_kv, queue, pdl)
            return
        walk = hopper_module("hopper_rows") if cfg.walk else None
        if walk and walk.applies(q, k_cache, cfg.block_n, causal, window):
            walk.launch(q, k_cache, v_cache, units, count, kv_chunk, kv_lo, kv_hi, scale, o, lse, programs,
                        cfg.block_n, cfg.num_stages, cfg.maxnreg, new_kv, kv_scale, queue, merge)
            return
        if runs_gluon(q, k_cache, cfg, causal, window, slots is not None):
            assert not (cfg.pairs and causal), "the chunk pairs take no position mask"
            gluon = hopper_module("hopper_pairs") if cfg.pairs else hopper_module()
            assert gluon is not None  # (the same Triton as `hopper`)
            gluon.launch(q, k_cache, v_cache, units, count, kv_chunk, kv_lo, kv_hi, scale, o, lse,
                         min(programs, num_sms(q.device)), cfg.block_m, cfg.maxnreg, trigger, new_kv,
                         kv_scale, **({"positions": (q_pos, kv_pos)} if causal else {}))
            return
        programs = min(programs, resident_programs(args, meta, q.device))
    _attend_kernel[(programs,)](*args, **meta)


def runs_gluon(q: torch.Tensor, k_cache: torch.Tensor, cfg: KernelConfig, causal: bool, window: int | None,
               stores: bool) -> bool:
    """Whether `launch_units` runs this wide launch in Gluon (`hopper`, `hopper_pairs`): one
    CTA an SM, every CTA resident at once."""
    hopper = hopper_module() if cfg.hopper and q.is_cuda else None
    return bool(hopper and hopper.applies(q, k_cache, cfg.block_m, causal, window, stores))


_RESIDENT: dict[tuple[object, ...], int] = {}


def resident_programs(args: tuple[torch.Tensor | int | float, ...], meta: dict[str, int | bool | str],
                      device: torch.device) -> int:
    """Programs of this compiled attend kernel that the GPU holds at once (registers and
    shared memory per SM, as Triton's persistent tutorials compute it), x SMs. A persistent
    grid larger than this runs in waves: its last programs start only when the first ones
    have walked their whole stride of units. On an H200 (fp16, D 128) the narrow shape holds
    5 programs per SM (its target is 4) and the 128-row wide one 2 (its target). Compiled once
    per launch shape."""
    q, warps = args[0], meta["num_warps"]
    assert isinstance(q, torch.Tensor) and isinstance(warps, int)
    key = (device.index, q.dtype, *sorted(meta.items()))
    if key not in _RESIDENT:
        kernel = _attend_kernel.warmup(*args, grid=(1,), **meta)
        kernel._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(device.index)
        by_regs = props["max_num_regs"] // max(1, kernel.n_regs * 32 * warps)
        by_smem = props["max_shared_mem"] // max(1, kernel.metadata.shared)
        by_warps = 64 // warps  # 2,048 threads per SM (sm_80 / sm_90)
        per_sm = max(1, min(by_regs, by_smem, by_warps))
        _RESIDENT[key] = per_sm * props["multiprocessor_count"]
    return _RESIDENT[key]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One of a plan's two attend launches (narrow, wide)."""

    units: torch.Tensor  # [>= U, 6] int32
    count: torch.Tensor  # [2] int32 on the device: U, the programs that take units (`launch_units`)
    cfg: KernelConfig
    causal: bool
    programs: int  # persistent grid size; 0: nothing to run
    stores: bool = False  # some unit stores its row's new key (the launch takes new_kv)
    queue: torch.Tensor | None = None  # [1] int32, iff cfg.dynamic: the launch's work counter
    merge: tuple[torch.Tensor, torch.Tensor] | None = None  # narrow: (Merge.rows, .others) iff its units merge


def grid_size(num_units: int, num_kv_heads: int, cfg: KernelConfig, sms: int,
              fixed: bool) -> int:
    """Programs of a persistent launch: `programs_per_sm` per SM, or fewer when there is less
    work -- unless `fixed` (a CUDA graph replays the launch with other counts). On a GPU,
    launch_units trims it to the programs the GPU holds at once (`resident_programs`)."""
    full = cfg.programs_per_sm * sms
    return full if fixed else min(full, num_units * num_kv_heads)


def launch_worklist(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                    launches: tuple[Launch, Launch], kv_chunk: torch.Tensor, kv_lo: torch.Tensor,
                    kv_hi: torch.Tensor, kv_pos: torch.Tensor, scale: float, o: torch.Tensor,
                    lse: torch.Tensor | None, side: torch.cuda.Stream | None = None,
                    new_kv: NewKV | None = None, window: int | None = None,
                    kv_scale: torch.Tensor | None = None,
                    final: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> bool:
    """Both unit classes' launches (narrow, wide), writing o, lse. Beside a Gluon wide launch
    the narrow one follows it on the current stream, started by PDL as the wide one starts
    (where `pdl_beside` says so); elsewhere, with a side stream (CUDA), the wide launch runs
    on it, concurrently with the narrow one, and the current stream waits for it before
    returning (graph capture records the fork and join); where the narrow config says
    `after_wide`, one after the other on the current stream. new_kv: as launch_units',
    for the launches that store; window: a sliding layer's; kv_scale: an fp8 cache's. final:
    (o, lse or None) of the final rows, which a merging narrow launch (`Launch.merge`) writes
    -- after the wide one on the same stream, started beside it by PDL (unless `after_wide`:
    then only after it). Returns whether the
    launch after these may start beside them by PDL (`merge_rows(pdl=True)`): on CUDA, where the
    wide launch runs alone, which then triggers its dependents as it starts."""
    idx = (kv_chunk, kv_lo, kv_hi, kv_pos)

    def go(x: Launch, out: tuple[torch.Tensor, torch.Tensor | None] = (o, lse),
           merge: Merge | None = None, trigger: bool = False, beside: bool = False) -> None:
        launch_units(q, k_cache, v_cache, q_pos, x.units, x.count, *idx, scale, *out, x.cfg,
                     x.causal, x.programs, new_kv if x.stores else None, window, kv_scale, x.queue,
                     merge, trigger, beside)

    narrow, wide = launches
    if not narrow.programs:
        go(wide, trigger=True)
        return q.is_cuda
    if narrow.merge is not None:
        assert final is not None and lse is not None, "a merging launch reads the partials"
        pdl = bool(wide.programs) and not narrow.cfg.after_wide
        go(wide, trigger=pdl)
        go(narrow, final, Merge(*narrow.merge, o, lse, pdl))
        return False
    both = bool(wide.programs) and not narrow.cfg.after_wide  # the narrow launch beside the wide one
    if both and pdl_beside(q, k_cache, launches, window, new_kv is not None):
        go(wide, trigger=True)
        go(narrow, beside=True)
        return False
    fork = side if both else None  # a side stream
    if fork is not None:
        fork.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(fork):
            go(wide)
    else:
        go(wide)
    go(narrow)
    if fork is not None:
        torch.cuda.current_stream(q.device).wait_stream(fork)
    return False


def pdl_beside(q: torch.Tensor, k_cache: torch.Tensor, launches: tuple[Launch, Launch], window: int | None,
               stores: bool) -> bool:
    """Whether the narrow launch (the Triton kernel or the swapped walk; the row walk merges,
    `Merge.pdl`) starts beside the wide one by PDL rather than on a second stream: where the
    wide one runs in Gluon, whose CTAs are all resident and trigger as they start, so that
    they hold their SMs first and the narrow programs fill the room beside them; and where the
    narrow programs take units from a counter (`dynamic`), so that the resident ones take them
    all while each waits at its end for the wide launch (a strided launch's programs that are
    not resident yet would start only after it). On two streams a graph's branches start in
    either order: on an H200 the narrow launch started first in 3 of 8 captured steps, held
    the SMs, and the products waited for it (b1024 x 16K shared keys, 512-key tails: 1,267 us,
    by PDL 878; b256 x 2K, 128-key tails: 84, by PDL 60) -- an SM keeps the L1 / shared-memory
    split its first kernel chose, and the narrow kernel's leaves no room for a wide CTA even
    beside one narrow program (kernels-notes.md, issue 25 part thirty-seven).
    Against the fork's captures of the same run, the Hydragen grid's steps by PDL took up to
    9% less time on 8 rows and 1-6% more on 4 (512-key tails under 8-16K shared keys), where
    forked the order is chance (above): the swapped walk took its first items by stride, so
    its CTAs still waiting for room beside the products held one each until the products
    ended. With every item from the counter (`hopper_rows._take`) those four steps took 1-8%
    less by PDL than before, 0.4-1.8% less than forked on three of them and 3.9% more on b1024
    x 16K (kernels-notes.md, issue 25 part thirty-one)."""
    narrow, wide = launches
    return (q.is_cuda and narrow.cfg.dynamic and not narrow.cfg.walk
            and runs_gluon(q, k_cache, wide.cfg, wide.causal, window, stores and wide.stores))


def num_sms(device: torch.device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small "GPU", so small test batches still get split


def attend_items(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_pos: torch.Tensor, item_q_start: torch.Tensor, item_q_len: torch.Tensor,
                 item_out_start: torch.Tensor, item_kv_indptr: torch.Tensor,
                 kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
                 kv_pos: torch.Tensor, scale: float, num_out_rows: int,
                 window: int | None = None, kv_scale: torch.Tensor | None = None, *,
                 configs: tuple[KernelConfig, KernelConfig] | None = None,
                 sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `ops.reference.attend_items` (same arguments and result; partial rows no item
    writes stay (0, -inf)). Builds the work list on the host, so it synchronizes: backends use
    `kernels.TritonKernels`, which builds it once per plan instead."""
    host = [x.cpu().numpy() for x in (item_q_start, item_q_len, item_out_start, item_kv_indptr,
                                      q_pos, kv_pos, kv_lo, kv_hi)]
    hq, d = q.shape[1:]
    hkv, g = k_cache.shape[2], hq // k_cache.shape[2]
    sms = sms or num_sms(q.device)
    configs = configs or choose_configs(int(host[1].max(initial=0)) * g, d, q.element_size(),
                                        fp8=k_cache.element_size() == 1)
    wl = build_worklist(host[0], host[1], host[2], host[3], num_out_rows, None, None, configs,
                        group=g, num_kv_heads=hkv, chunk_size=k_cache.shape[1],
                        itemsize=k_cache.element_size(), num_sms=sms, positions=host[4:])

    def dev(a: npt.ArrayLike) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, np.int32)).to(q.device)

    grids = [grid_size(len(u), hkv, cfg, n, fixed=False)
             for u, cfg, n in zip((wl.narrow, wl.wide), configs, (sms, wl.wide_sms), strict=True)]
    narrow, wide = (Launch(dev(u), dev([len(u), max(1, grid)]), cfg, causal, grid,
                           queue=torch.zeros(1, dtype=torch.int32, device=q.device) if cfg.dynamic else None)
                    for u, cfg, causal, grid in zip((wl.narrow, wl.wide), configs, wl.causal, grids, strict=True))
    if wl.fused is not None and wl.others is not None:
        narrow = dataclasses.replace(narrow, merge=(dev(wl.fused), dev(wl.others)))
    launches = (narrow, wide)
    o = torch.zeros((num_out_rows, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.full((num_out_rows, hq), float("-inf"), dtype=torch.float32, device=q.device)
    idx = (kv_chunk, kv_lo, kv_hi, kv_pos)
    if wl.direct:
        launch_worklist(q, k_cache, v_cache, q_pos, launches, *idx, scale, o, lse, window=window,
                        kv_scale=kv_scale)
        return o, lse
    o_s = torch.empty((wl.num_partials, hq, d), dtype=torch.float32, device=q.device)
    lse_s = torch.empty((wl.num_partials, hq), dtype=torch.float32, device=q.device)
    beside = launch_worklist(q, k_cache, v_cache, q_pos, launches, *idx, scale, o_s, lse_s,
                             window=window, kv_scale=kv_scale, final=(o, lse))
    if narrow.merge is not None:
        return o, lse
    assert wl.merge_indptr is not None and wl.merge_parts is not None, "not direct: a merge"
    merge_rows(o_s, lse_s, dev(wl.merge_indptr), dev(wl.merge_parts), o, lse, pdl=beside,
               unroll=unroll_for(wl.merge_indptr))
    return o, lse
