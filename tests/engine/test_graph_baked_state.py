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

import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules import triton
pytest.importorskip("triton")

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.attention.backends import scheduled  # noqa: E402
from prefixserve.attention.ops.triton import attend, kernels, merge, store  # noqa: E402
from prefixserve.engine.cuda_graphs import DecodeGraphs, buckets  # noqa: E402

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


class _Recorded:
    """A Triton kernel whose launches are appended to `log` (when it is a list)."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel
        self.log: list | None = None
        self.persistent: dict[str, torch.Tensor] = {}

    def __getitem__(self, grid):
        def launch(*args, **meta):
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
            for now, then in zip(log, entry[1]):
                assert now == then, f"bucket {rows}, generation {generation}: {now} != captured {then}"
        else:
            self.graphs[rows] = (generation, log)
        return hidden


@pytest.fixture
def recorders(monkeypatch):
    """The Triton executor on the CPU, its kernels recorded."""
    recs = []
    for module, name in ((attend, "_attend_kernel"), (merge, "_merge_kernel"), (store, "_store_kv_kernel")):
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


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_padded_decode_steps_launch_what_their_graph_captured(tmp_path, recorders, chunk_size):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
              attention_backend="auto", overlap_schedule=True, chunk_size=chunk_size,
              kv_cache_memory=(640 // chunk_size + 2) * 2 * chunk_size * 2 * 16 * 4,  # ~640 tokens max_num_seqs=12,
              max_num_batched_tokens=512)
    try:
        rank = llm.engine.runner.rank
        rank.graphs = RecordingGraphs(rank, 12, recorders)
        prompts = _thrashing_prompts(num_prefixes=3, prefix_len=150, per_prefix=6)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        graphs, engine = rank.graphs, llm.engine
        # the load did what it is for: graphs replayed, advanced plans, preemptions
        assert graphs.replays > 0 and len(graphs.graphs) > 1 and engine.runner.advanced_steps > 0
        assert engine.scheduler.num_preemptions > 0, "the cache must thrash"
    finally:
        llm.close()
