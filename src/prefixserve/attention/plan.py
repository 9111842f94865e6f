"""Plans: a schedule's index tensors on the device, built once per step and reused.

`index_arrays` flattens a `Schedule` into the CSR arrays that `ops.reference.attend_items`
and `merge_partials` (and their Triton twins) take:

    item i -> q rows [item_q_start, +item_q_len)      -> partial rows [item_out_start, +item_q_len)
           -> entries [item_kv_indptr[i], item_kv_indptr[i+1]) -> (kv_chunk, kv_lo, kv_hi, kv_pos)
    row r  -> partial rows row_parts[row_indptr[r]:row_indptr[r+1]]   (only when merging)

When every row is in exactly one item, items write straight into the output rows
(item_out_start = item_q_start) and there is no merge. A padded batch (CUDA graph) has
`padded.rows` rows: q_pos and slots are padded (position 0, the pad slot) and so is the merge
CSR (padding rows merge nothing).

Caching policy (`PlanCache`, one per backend):
  1. Exact reuse. The batch's structure -- every sequence's query rows, positions and
     segments, the chunk size, the pinned nodes and the padding; everything but `slots` -- is
     compared with the last planned one. Equal: only `slots` is uploaded.
  2. Advance (decode). `batch.advance`: the same sequences each gained one key and one query
     position. At the last full build every row's newest key was found in an entry of an item
     of that row alone (its private tail: `_tail_entries`); now q_pos += 1 and that entry's
     kv_hi += 1, or, when the new key opens a chunk, a one-key entry is inserted after it.
     Vectorized over rows; no schedule, no Python per sequence.
  3. Otherwise the schedule and host arrays are rebuilt (O(sequences x depth) Python plus
     numpy over chunks) and compared field by field with the last upload.
  Device tensors are views of per-field buffers that only grow (by doubling), so a field's
  address is stable across steps, as CUDA graphs need; `generation` counts the moves. Only a
  field whose values changed is uploaded (through pinned staging: `staging.Uploader`): in a
  decode step without a new chunk that is q_pos, kv_hi and slots -- ChunkAttention's lazy copy
  of the tree context. A plan is valid until the next `get` on the same cache.

Executor extras (`extend`): an ops executor may derive more per-plan arrays from the host
arrays (the Triton path's work list); they are rebuilt with them and synced the same lazy way,
and handed to the executor in `DevicePlan.extra` (device tensors, and plain ints as they are).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import torch

from ..staging import Uploader
from .base import AttentionBatch, PaddedRows, SeqQueries
from .schedule import Schedule

_FIELDS = ("slots", "q_pos", "item_q_start", "item_q_len", "item_out_start", "item_kv_indptr",
           "kv_chunk", "kv_lo", "kv_hi", "kv_pos", "row_indptr", "row_parts")
_ENTRY_FIELDS = ("kv_chunk", "kv_lo", "kv_hi", "kv_pos")
_MERGE_FIELDS = ("row_indptr", "row_parts")  # None when the schedule does not merge

HostArrays = dict[str, np.ndarray | None]  # field -> host int64 array (None: a merge field, no merge)
HostExtras = dict[str, np.ndarray | int | None]  # an executor's extras: arrays (synced) and ints
DeviceExtras = dict[str, torch.Tensor | int | None]  # the same on the device (`DevicePlan.extra`)


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Device tensors of one step (shapes in `ops.reference`); merge fields None if no merge."""

    slots: torch.Tensor  # [R] int64 (R = the batch's num_rows)
    q_pos: torch.Tensor  # [R] int32
    item_q_start: torch.Tensor  # [I] int32
    item_q_len: torch.Tensor  # [I] int32
    item_out_start: torch.Tensor  # [I] int32
    item_kv_indptr: torch.Tensor  # [I+1] int32
    kv_chunk: torch.Tensor  # [E] int32
    kv_lo: torch.Tensor  # [E] int32
    kv_hi: torch.Tensor  # [E] int32
    kv_pos: torch.Tensor  # [E] int32
    row_indptr: torch.Tensor | None  # [R+1] int32
    row_parts: torch.Tensor | None  # [P'] int32
    num_out_rows: int  # P, partial rows the items write
    padded: bool  # a CUDA-graph step (fixed launch shapes; see ops.triton.kernels)
    extra: DeviceExtras = dataclasses.field(default_factory=dict)  # the executor's (see `extend`)

    @property
    def needs_merge(self) -> bool:
        return self.row_indptr is not None


def required(a: HostArrays, name: str) -> np.ndarray:
    """a[name], a field that every plan has (any but the merge fields)."""
    arr = a[name]
    assert arr is not None, f"{name} is None"
    return arr


def _csr(counts: list[int] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _row_positions(batch: AttentionBatch) -> np.ndarray:
    """[T]: the absolute position of every query row."""
    starts = np.array([s.q_start for s in batch.seqs], dtype=np.int64)
    lens = np.array([s.q_len for s in batch.seqs], dtype=np.int64)
    pos0 = np.array([s.q_pos for s in batch.seqs], dtype=np.int64)
    within = np.arange(lens.sum()) - np.repeat(_csr(lens)[:-1], lens)
    q_pos = np.full(batch.num_tokens, -1, dtype=np.int64)
    q_pos[np.repeat(starts, lens) + within] = np.repeat(pos0, lens) + within
    assert (q_pos >= 0).all(), "query rows of the sequences must tile [0, T)"
    return q_pos


def _entries(sched: Schedule, size: int) -> dict[str, np.ndarray]:
    """Cut every item's pieces into per-chunk kv entries (vectorized over pieces)."""
    pieces = [p for it in sched.items for p in it.pieces]
    piece_item = np.repeat(np.arange(len(sched.items)), [len(it.pieces) for it in sched.items])
    start = np.array([p.seg.offset + p.lo for p in pieces], dtype=np.int64)  # slot in segment
    end = np.array([p.seg.offset + p.hi for p in pieces], dtype=np.int64)
    pos0 = np.array([p.seg.pos_start + p.lo for p in pieces], dtype=np.int64)
    first = start // size
    count = (end - 1) // size - first + 1  # chunks each piece touches
    chunk_ids = itertools.chain.from_iterable(
        p.seg.chunks[f:f + n] for p, f, n in zip(pieces, first.tolist(), count.tolist(), strict=True))
    piece = np.repeat(np.arange(len(pieces)), count)  # [E]: entry -> piece
    cidx = first[piece] + np.arange(count.sum()) - np.repeat(_csr(count)[:-1], count)
    lo = np.maximum(start[piece], cidx * size)
    hi = np.minimum(end[piece], cidx * size + size)
    per_item = np.bincount(piece_item[piece], minlength=len(sched.items))
    return {"kv_chunk": np.fromiter(chunk_ids, dtype=np.int64, count=int(count.sum())),
            "kv_lo": lo - cidx * size, "kv_hi": hi - cidx * size,
            "kv_pos": pos0[piece] + lo - start[piece], "item_kv_indptr": _csr(per_item)}


def _merge_csr(q_start: np.ndarray, q_len: np.ndarray, num_rows: int) -> dict[str, np.ndarray]:
    """Partial rows in item order; row r's partials in item order."""
    out_start = _csr(q_len)[:-1]
    part_row = np.repeat(q_start - out_start, q_len) + np.arange(q_len.sum())  # [P]
    return {"item_out_start": out_start,
            "row_indptr": _csr(np.bincount(part_row, minlength=num_rows)),
            "row_parts": np.argsort(part_row, kind="stable")}


def _pad_rows(arrays: HostArrays, batch: AttentionBatch) -> None:
    """Extend the per-row arrays of a padded batch to its graph's rows (in place)."""
    if batch.padded is None:
        return
    extra = batch.padded.rows - batch.num_tokens
    arrays["q_pos"] = np.concatenate([required(arrays, "q_pos"), np.zeros(extra, np.int64)])
    arrays["slots"] = np.concatenate([required(arrays, "slots"),
                                      np.full(extra, batch.padded.pad_slot, np.int64)])
    ptr = arrays["row_indptr"]
    if ptr is not None:
        arrays["row_indptr"] = np.concatenate([ptr, np.full(extra, ptr[-1], np.int64)])


def index_arrays(sched: Schedule, batch: AttentionBatch) -> HostArrays:
    """Host int64 arrays for every index field of `DevicePlan`."""
    assert all(it.q_len > 0 and it.pieces for it in sched.items)
    q_start = np.array([it.q_start for it in sched.items], dtype=np.int64)
    q_len = np.array([it.q_len for it in sched.items], dtype=np.int64)
    arrays: HostArrays = {
        "slots": batch.slots.numpy(), "q_pos": _row_positions(batch),
        "item_q_start": q_start, "item_q_len": q_len, **_entries(sched, batch.chunk_size)}
    if sched.needs_merge:
        arrays.update(_merge_csr(q_start, q_len, sched.num_rows))
    else:
        arrays.update(item_out_start=q_start, row_indptr=None, row_parts=None)
    _pad_rows(arrays, batch)
    return arrays


def _tail_entries(a: HostArrays, batch: AttentionBatch) -> np.ndarray | None:
    """[B]: for a decode batch (one query row per sequence, row i = sequence i), the entry
    that holds row i's newest key (its own position) inside an item of row i alone -- where
    an advance puts the next key. None if some row has none (then no advance)."""
    num = len(batch.seqs)
    if num == 0 or num != batch.num_tokens or any(s.q_len != 1 for s in batch.seqs):
        return None
    indptr = required(a, "item_kv_indptr")
    item = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))  # [E]: entry -> item
    row = required(a, "item_q_start")[item]
    last_pos = required(a, "kv_pos") + required(a, "kv_hi") - required(a, "kv_lo") - 1
    own = (required(a, "item_q_len")[item] == 1) & (last_pos == required(a, "q_pos")[row])
    own &= np.arange(len(item)) == indptr[item + 1] - 1  # the item's last entry
    tail = np.full(num, -1, np.int64)
    tail[row[own]] = np.nonzero(own)[0]
    return tail if (tail >= 0).all() and own.sum() == num else None


def advance_arrays(a: HostArrays, tail: np.ndarray, new_slots: np.ndarray,
                   chunk_size: int) -> tuple[HostArrays, np.ndarray, list[str]]:
    """The arrays of the next decode step: every row one position further, its new key at
    `new_slots[i]` appended to entry tail[i] (or in a new entry after it when the key opens a
    chunk). -> (arrays, new tail, names of the changed fields)."""
    out = dict(a)
    rows = len(tail)
    out["q_pos"] = q_pos = required(a, "q_pos").copy()
    q_pos[:rows] += 1
    out["slots"] = slots = required(a, "slots").copy()
    slots[:rows] = new_slots
    chunk, slot = new_slots // chunk_size, new_slots % chunk_size
    fresh = slot == 0
    grow = ~fresh
    kv_hi = required(a, "kv_hi")
    assert (kv_hi[tail[grow]] == slot[grow]).all() and (required(a, "kv_chunk")[tail[grow]] == chunk[grow]).all(), \
        "an advanced key must continue its row's newest entry"
    out["kv_hi"] = kv_hi = kv_hi.copy()
    kv_hi[tail[grow]] += 1
    changed = ["q_pos", "slots", "kv_hi"]
    if not fresh.any():
        return out, tail, changed
    at = tail[fresh] + 1  # insert before old entry `at`: after the row's tail entry
    order = np.argsort(at, kind="stable")
    values = {"kv_chunk": chunk[fresh], "kv_lo": np.zeros(len(at), np.int64),
              "kv_hi": np.ones(len(at), np.int64), "kv_pos": q_pos[:rows][fresh]}
    for name in _ENTRY_FIELDS:
        out[name] = np.insert(required(out, name), at[order], values[name][order])
    indptr = required(a, "item_kv_indptr")
    item_of = np.searchsorted(indptr, tail[fresh], side="right") - 1
    out["item_kv_indptr"] = indptr + _csr(np.bincount(item_of, minlength=len(indptr) - 1))
    sorted_at = np.sort(at)
    new_tail = tail + np.searchsorted(sorted_at, tail, side="right")  # old entries shift
    new_tail[fresh] += 1  # ...and a fresh row's newest key is its inserted entry
    return out, new_tail, changed + ["kv_chunk", "kv_lo", "kv_pos", "item_kv_indptr"]


BatchKey = tuple[tuple[SeqQueries, ...], int, frozenset[int], PaddedRows | None]


def batch_key(batch: AttentionBatch) -> BatchKey:
    """Everything a schedule depends on: all of the batch but `slots`."""
    return batch.seqs, batch.chunk_size, batch.pinned_node_ids, batch.padded


class PlanCache:
    """Device copies of one backend's index tensors across steps; policy in the module doc."""

    def __init__(self, device: torch.device,
                 extend: Callable[[AttentionBatch, HostArrays], HostExtras] | None = None) -> None:
        self.device = torch.device(device)
        self.extend = extend  # (batch, host arrays) -> extra arrays (synced) and ints
        self.uploader = Uploader(self.device)
        self.generation = 0  # bumped when a device buffer moves
        self._ints: dict[str, int] = {}  # the extras that are ints
        self._extra_names: list[str] = []  # the extras that are arrays (synced)
        self._key: BatchKey | None = None
        self._tail: np.ndarray | None = None
        self._host: HostArrays = {}  # the arrays the device buffers hold
        self._buf: dict[str, torch.Tensor] = {}  # per field: a buffer of some capacity
        self._dev: dict[str, torch.Tensor] = {}  # per field: the used view of _buf (absent: None)

    @property
    def can_advance(self) -> bool:
        return self._tail is not None

    def next_positions(self) -> np.ndarray:
        """[B]: where an advance would put each row's new key (the last plan's q_pos + 1)."""
        assert self._tail is not None, "a plan that can advance"
        return required(self._host, "q_pos")[:len(self._tail)] + 1

    def get(self, batch: AttentionBatch, make_schedule: Callable[[], Schedule]) -> DevicePlan:
        if batch.advance:
            assert self._tail is not None, "an advanced batch follows a plan that can advance"
            arrays, self._tail, changed = advance_arrays(self._host, self._tail,
                                                         batch.slots.numpy(), batch.chunk_size)
            self._update(batch, arrays, changed)
            self._key = None  # the batch named no sequences: the next full batch rebuilds
        elif batch_key(batch) != self._key:
            arrays = index_arrays(make_schedule(), batch)
            self._tail = _tail_entries(arrays, batch)
            self._update(batch, arrays, list(arrays))
            self._key = batch_key(batch)
        else:
            slots = batch.slots.numpy()
            if batch.padded is not None:
                slots = np.concatenate([slots, required(self._host, "slots")[batch.num_tokens:]])
            self._sync("slots", slots)
        self.uploader.fence()
        extra: DeviceExtras = {**self._ints, **{n: self._dev.get(n) for n in self._extra_names}}
        return DevicePlan(num_out_rows=int(required(self._host, "item_q_len").sum()),
                          padded=batch.padded is not None, extra=extra,
                          row_indptr=self._dev.get("row_indptr"), row_parts=self._dev.get("row_parts"),
                          **{f: self._dev[f] for f in _FIELDS if f not in _MERGE_FIELDS})

    def _update(self, batch: AttentionBatch, arrays: HostArrays, changed: list[str]) -> None:
        for name in changed:
            self._sync(name, arrays[name])
        for name in set(arrays) - set(changed):
            self._host[name] = arrays[name]
        if self.extend is not None:
            extra = self.extend(batch, self._host)  # which now holds every array of `arrays`
            self._ints = {n: v for n, v in extra.items() if isinstance(v, int)}
            synced = {n: v for n, v in extra.items() if not isinstance(v, int)}
            self._extra_names = list(synced)
            for name, arr in synced.items():
                self._sync(name, arr)

    def _sync(self, name: str, arr: np.ndarray | None) -> None:
        """Make the device view of `name` hold `arr`, uploading only if it changed."""
        old = self._host.get(name)
        self._host[name] = arr
        if arr is None:
            self._dev.pop(name, None)
            return
        buf = self._buf.get(name)
        if buf is None or buf.shape[0] < arr.shape[0] or buf.shape[1:] != arr.shape[1:]:
            dtype = torch.int64 if name == "slots" else torch.int32
            cap = max(16, 1 << (max(1, arr.shape[0]) - 1).bit_length())
            buf = self._buf[name] = torch.empty((cap, *arr.shape[1:]), dtype=dtype, device=self.device)
            self.generation += 1
            old = None
        view = buf[:arr.shape[0]]
        if old is None or self._dev.get(name) is None or not np.array_equal(old, arr):
            self.uploader.copy(view, arr)
        self._dev[name] = view
