"""The seam between the engine and attention: what one step asks of attention, and the backend interface.

The engine describes a step as an `AttentionBatch` (host objects, built from the prefix tree);
a backend turns it into device index tensors once per step (`plan`) and then, per layer, only
launches work (`run`). Nothing else crosses this seam: no module-level "forward context".

Key layout. A sequence's keys are the concatenation of the segments on its root-to-leaf path.
A segment is (a prefix of) one tree node: `length` keys at absolute positions
`[pos_start, pos_start + length)`, stored in slot order inside the node's chunks, starting at
slot `offset` of `chunks[0]`:

    chunk:   chunks[0]              chunks[1]              chunks[2]
    slot:    0 .. offset-1 | offset .. C-1 | 0 .. C-1 | 0 .. (offset+length-1) % C
             (not this node) key 0 ...                     ... key length-1

Key j of a segment sits at flat slot `chunks[(offset + j) // C] * C + (offset + j) % C` of a
cache viewed as `[num_chunks * C, Hkv, D]`. The same node object appears as the same
`node_id` in every sequence below it; in a batch ordered depth-first the sequences sharing a
node are contiguous, which is what lets shared-prefix backends batch their queries.

Queries. Sequence i owns rows `[q_start, q_start + q_len)` of this step's `q`; they sit at
positions `q_pos .. q_pos + q_len - 1` and attend causally: a query at position p sees keys at
positions <= p. The new tokens' own K/V are written into the cache (at `slots`) before
attention, so every key a query sees is read from the cache.

Two variants of a batch keep the host work of a decode step small and CUDA-graph friendly:

- `advance=True`: this batch is the previously planned one with every sequence advanced by
  one decode token (same sequences, same order, same tree topology). `seqs` is then empty:
  `slots` ([B], one per sequence) says where each new key goes, and the plan is updated from
  the last one instead of being rebuilt (see `plan.PlanCache`).
- `padded`: the step is replayed in a CUDA graph captured for `padded.rows` >= num_tokens
  query rows. Rows past num_tokens are padding: they attend to nothing (output 0) and write
  their K/V to `padded.pad_slot`, a slot that no sequence owns.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch


@dataclasses.dataclass(frozen=True)
class Segment:
    node_id: int
    pos_start: int
    length: int
    chunks: tuple[int, ...]
    offset: int

    def slots(self, chunk_size: int) -> torch.Tensor:
        """Flat cache slots of this segment's keys, in key order: [length] int64."""
        j = torch.arange(self.offset, self.offset + self.length)
        chunks = torch.tensor(self.chunks, dtype=torch.int64)
        return chunks[j // chunk_size] * chunk_size + j % chunk_size


@dataclasses.dataclass(frozen=True)
class SeqQueries:
    q_start: int
    q_len: int
    q_pos: int
    segments: tuple[Segment, ...]  # root to leaf; lengths sum to q_pos + q_len (unless windowed)

    @property
    def kv_len(self) -> int:
        return self.q_pos + self.q_len


@dataclasses.dataclass(frozen=True)
class PaddedRows:
    rows: int  # query rows of the captured graph, >= the batch's num_tokens
    pad_slot: int  # flat cache slot the padding rows write their K/V to


@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    seqs: tuple[SeqQueries, ...]  # depth-first tree order; () when `advance`
    chunk_size: int
    slots: torch.Tensor  # [num_tokens] int64 (CPU): where each new token's K/V is written
    pinned_node_ids: frozenset[int] = frozenset()
    advance: bool = False  # the last planned batch, every sequence one decode token further
    padded: PaddedRows | None = None  # replayed in a CUDA graph of padded.rows rows
    windowed: bool = False  # segments cut to a sliding window (window.py): keys may be skipped

    def __post_init__(self) -> None:
        assert not self.advance or not self.seqs, "an advanced batch names no sequences"
        assert self.padded is None or self.padded.rows >= self.num_tokens

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())

    @property
    def num_rows(self) -> int:
        """Query rows of the step's q: num_tokens, or the graph's rows when padded."""
        return self.padded.rows if self.padded else self.num_tokens


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Static facts a backend is built with (one per model)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None = None  # the window of the model's sliding layers, if any
    cell: int | None = None  # deterministic mode: keys in cells of this many positions (cells.py)
    kv_dtype: torch.dtype | None = None  # the KV cache's, if not `dtype` (float8_e4m3fn: fp8)

    @property
    def kv_itemsize(self) -> int:
        """Bytes per cached K or V element."""
        return (self.kv_dtype or self.dtype).itemsize


class AttentionBackend(ABC):
    """plan() once per step on the host; run() once per layer, launching work only."""

    name: str = ""
    chosen: str | None = None  # the schedule the last plan picked, for backends that pick one per step

    def __init__(self, shape: AttentionShape):
        self.shape = shape

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> None:
        """Build this step's device index tensors from `batch` (reusing them when unchanged).
        They live in buffers whose addresses change only when `generation` does."""

    @property
    def generation(self) -> int:
        """Bumped whenever the plan's device buffers move (CUDA graphs must be re-captured)."""
        return 0

    def can_advance(self) -> bool:
        """Whether the next batch may be `advance=True` (the last plan records every row's
        newest key)."""
        return False

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None,
            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write the new keys/values, then attend (with `window`: a sliding layer's, which must
        be `shape.sliding_window`).

        q: [R, Hq, D]; k, v: [R, Hkv, D] (this step's new tokens, rotary already applied; R =
        the batch's num_rows); k_cache, v_cache: [num_chunks, C, Hkv, D] (one layer), in
        `shape.kv_dtype`; kv_scale: [4, Hkv] fp32, the layer's scales when that is fp8
        (`ops.reference`). Returns o: [R, Hq, D] in q's dtype (padding rows: 0).
        """
