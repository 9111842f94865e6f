"""What a captured decode graph bakes in stays put while the backend's generation does (CPU).

A CUDA graph replays the kernel launches of its capture verbatim: every tensor argument's
address and strides, every int and flag, every grid, and the set of kernels launched. So for
a bucket of R rows, the launches of any later padded step at the same `backend.generation`
must be exactly those of the step the graph was captured in; if not, the replay reads stale
state (a wrong plan, or a freed buffer: the illegal address of a crash under cache thrashing).

Here the engine runs on the CPU with the Triton executor in the interpreter and a recording
stand-in for `DecodeGraphs`: every padded decode step runs eagerly with its launches recorded,
and is compared with the launches recorded at its bucket's "capture". The load thrashes the
cache: long shared prefixes in a small KV cache (eviction and preemption), overlap on, auto.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

if os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu") != "cpu":
    # its engine runs on the CPU in the interpreter, and setting TRITON_INTERPRET here would
    # take every kernel test module collected beside it off the GPU
    pytest.skip("a CPU test: the engine in Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules import triton
pytest.importorskip("triton")

from prefixserve import LLM, SamplingParams
from prefixserve.attention.backends import scheduled
from prefixserve.attention.ops.triton import kernels, launch, merge, store
from prefixserve.engine.cuda_graphs import DecodeGraphs, buckets

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}


def _persistent(rank) -> dict[str, torch.Tensor]:
    """The tensors that outlive a step and that a graph's launches may read: the KV pool, the
    plan's buffers, the executor's scratch, the graphs' static inputs. Everything else a
    launch takes is an activation, allocated inside the captured graph itself."""
    b, g = rank.backend, rank.graphs
    out = {f"k{i}": t for i, t in enumerate(rank.pool.k)} | {f"v{i}": t for i, t in enumerate(rank.pool.v)}
    out |= {f"plan.{n}": t for n, t in b.cache._buf.items()} | {"ids": g.ids, "positions": g.positions}
    if b.kernels._scratch is not None:
        out |= {"scratch.o": b.kernels._scratch[0], "scratch.lse": b.kernels._scratch[1]}
    return out


def _arg(a, persistent: dict[str, torch.Tensor]):
    """What a graph bakes of one launch argument: a persistent buffer's name and address, an
    activation's layout, a value."""
    if not isinstance(a, torch.Tensor):
        return a
    ptr = a.data_ptr()
    for name, t in persistent.items():
        lo = t.untyped_storage().data_ptr()
        if lo <= ptr < lo + t.untyped_storage().nbytes():
            return ("buffer", name, ptr, a.dtype, a.stride())
    return ("activation", a.dtype, a.stride())


def _check_attend(grid, q, k_cache, v_cache, q_pos, units, count, kv_chunk, kv_lo, kv_hi, kv_pos, o,
                  lse, k_new, v_new, slots, kv_scale, queue, fused, others, o_parts, *rest, STORE,
                  MERGE, **meta):
    """Every index the attend kernel follows stays inside what it indexes (on a GPU: else an
    illegal address)."""
    n_units = int(count[0])
    assert 0 <= n_units <= units.shape[0] and q_pos.numel() >= q.shape[0]
    u = units[:n_units].long()
    q_start, q_len, e0, e1, out, store = u.unbind(1)
    assert ((q_start >= 0) & (q_len >= 1) & (q_start + q_len <= q.shape[0])).all(), u
    # (e0 == e1: a unit with no keys, a padding row's whose merge writes its zeros)
    assert ((e0 >= 0) & (e0 <= e1) & (e1 <= kv_chunk.numel())).all(), (u, kv_chunk.numel())
    if MERGE:  # the units merge: final rows and the scratch rows they read
        f, first, n = fused[:n_units].long().unbind(1)
        assert ((f >= 0) & (f < o.shape[0]) & (first >= 0) & (first + n <= others.numel())).all()
        used = others[:int((first + n).max()) if n_units else 0].long()
        assert ((used >= 0) & (used < o_parts.shape[0])).all()
    else:
        assert ((out >= 0) & (out + q_len <= o.shape[0])).all(), (u, o.shape)
    num_chunks, size = k_cache.shape[:2]
    for e in range(n_units and int(e1.max())):
        chunk, lo, hi = int(kv_chunk[e]), int(kv_lo[e]), int(kv_hi[e])
        assert 0 <= chunk < num_chunks and 0 <= lo < hi <= size, (e, chunk, lo, hi)
    if STORE:
        t = store[store >= 0]
        assert (t < k_new.shape[0]).all() and (t < slots.numel()).all(), (t, k_new.shape)
        assert ((slots[t] >= 0) & (slots[t] < num_chunks * size)).all()


def _check_merge(grid, o_parts, lse_parts, indptr, parts, o, *rest, **meta):
    assert grid[0] == indptr.numel() - 1 <= o.shape[0]
    ptr = indptr.long()
    assert ptr[0] == 0 and (ptr[1:] >= ptr[:-1]).all() and ptr[-1] <= parts.numel()
    used = parts[:int(ptr[-1])].long()
    assert ((used >= 0) & (used < o_parts.shape[0]) & (used < lse_parts.shape[0])).all()


def _check_store(grid, k_cache, v_cache, k, v, slots, *rest, **meta):
    assert grid[0] <= slots.numel() and grid[0] <= k.shape[0]
    s = slots[:grid[0]]
    assert ((s >= 0) & (s < k_cache.shape[0] * k_cache.shape[1])).all(), s


_CHECKS = {"_attend_kernel": _check_attend, "_merge_kernel": _check_merge,
           "_store_kv_kernel": _check_store}


class _Recorded:
    """A Triton kernel whose launches are bounds-checked, and appended to `log` when it is a
    list."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel
        self.log: list | None = None
        self.persistent: dict[str, torch.Tensor] = {}

    def __getitem__(self, grid):
        def launch(*args, **meta):
            _CHECKS[self.name](tuple(grid), *args, **meta)
            if self.log is not None:
                keep = self.persistent
                self.log.append((self.name, tuple(grid), tuple(_arg(a, keep) for a in args),
                                 tuple(sorted((k, _arg(v, keep)) for k, v in meta.items()))))
            return self.kernel[grid](*args, **meta)
        return launch


class RecordingGraphs(DecodeGraphs):
    """`DecodeGraphs` on the CPU: each padded step runs eagerly; its launches must equal those
    of its bucket's capture while the generation is unchanged."""

    def __init__(self, rank, max_rows: int, recorders: list[_Recorded]):
        self.rank, self.device, self.sizes = rank, rank.device, buckets(max_rows)
        self.ids = torch.zeros(self.sizes[-1], dtype=torch.int64)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64)
        self.recorders = recorders
        self.graphs = {}  # rows -> (generation, the launches of the capture)
        self.replays = 0  # steps that a graph would have replayed

    def run(self, rows, ids, positions, generation, forward):
        n = ids.numel()
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.ids[n:rows].zero_()
        self.positions[n:rows].zero_()
        log = []
        persistent = _persistent(self.rank)
        plan = self.rank.backend.current
        held = [getattr(plan, f.name) for f in dataclasses.fields(plan)] + list(plan.extra.values())
        for t in held:  # an empty tensor has no address (data_ptr() 0); a per-step one is freed
            assert not isinstance(t, torch.Tensor) or _arg(t, persistent)[0] == "buffer", t
        for r in self.recorders:
            r.log, r.persistent = log, persistent
        try:
            hidden = forward(self.ids[:rows], self.positions[:rows])
        finally:
            for r in self.recorders:
                r.log = None
        entry = self.graphs.get(rows)
        if entry is not None and entry[0] == generation:
            self.replays += 1
            assert len(log) == len(entry[1]), (rows, generation, [x[0] for x in log], [x[0] for x in entry[1]])
            for now, then in zip(log, entry[1], strict=True):
                assert now == then, f"bucket {rows}, generation {generation}: {now} != captured {then}"
        else:
            self.graphs[rows] = (generation, log)
        return hidden


@pytest.fixture
def recorders(monkeypatch):
    """The Triton executor on the CPU, its kernels recorded."""
    recs = []
    for module, name in ((launch, "_attend_kernel"), (merge, "_merge_kernel"), (store, "_store_kv_kernel")):
        rec = _Recorded(name, getattr(module, name))
        monkeypatch.setattr(module, name, rec)
        recs.append(rec)
    monkeypatch.setattr(scheduled, "kernels_for", lambda shape: kernels.TritonKernels(shape, sms=3))
    return recs


def _thrashing_prompts(num_prefixes: int, prefix_len: int, per_prefix: int) -> list[list[int]]:
    prompts = []
    for p in range(num_prefixes):
        prefix = [(7 * p + 3 * i) % 290 + 5 for i in range(prefix_len)]
        prompts += [prefix + [(11 * p + 13 * j + k) % 290 + 5 for k in range(1 + (j * 5) % 23)]
                    for j in range(per_prefix)]
    return prompts


# (chunk size, KV tokens, new tokens): small enough that decode steps preempt, large enough that
# batches of several buckets run
@pytest.mark.parametrize("chunk_size,kv_tokens,new", [(16, 656, 24), (64, 896, 48)])
def test_padded_decode_steps_launch_what_their_graph_captured(tmp_path, recorders, chunk_size, kv_tokens, new):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
              attention_backend="auto", overlap_schedule=True, chunk_size=chunk_size,
              kv_cache_memory=kv_tokens * 2 * 2 * 16 * 4,  # K and V, 2 KV heads of 16 fp32
              max_num_seqs=12,
              max_num_batched_tokens=512)
    try:
        rank = llm.engine.runner.rank
        rank.graphs = RecordingGraphs(rank, 12, recorders)
        prompts = _thrashing_prompts(num_prefixes=3, prefix_len=150, per_prefix=6)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        graphs, engine = rank.graphs, llm.engine
        # the load did what it is for: graphs replayed, advanced plans, preemptions
        assert graphs.replays > 0 and len(graphs.graphs) > 1 and engine.runner.advanced_steps > 0
        assert engine.scheduler.num_preemptions > 0, "the cache must thrash"
    finally:
        llm.close()
