"""Plan caching: identical structure reuses every tensor; decode steps update only what changed."""

import dataclasses
import math

import pytest
import torch

from prefixserve.attention import create_backend
from prefixserve.attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries
from prefixserve.attention.plan import DevicePlan

C, HKV, G, D = 16, 2, 3, 8
SHAPE = AttentionShape(HKV * G, HKV, D, 1 / math.sqrt(D), torch.float32, torch.device("cpu"))
ROOT = Segment(0, 0, 20, (3, 7), 0)


def step(len_a: int, len_b: int, chunks_a=(9,)) -> AttentionBatch:
    """Two decoding sequences below ROOT: A in its own chunks, B continuing ROOT's chunk 7."""
    a = Segment(1, 20, len_a, chunks_a, 0)
    b = Segment(2, 20, len_b, (7,), 4)
    seqs = (SeqQueries(0, 1, 20 + len_a - 1, (ROOT, a)),
            SeqQueries(1, 1, 20 + len_b - 1, (ROOT, b)))
    slots = torch.cat([a.slots(C)[-1:], b.slots(C)[-1:]])
    return AttentionBatch(seqs, C, slots)


def dense_from_cache(batch, q, k_cache, v_cache):
    """float64 attention of each (single-query) sequence over its slots."""
    out = []
    for i, s in enumerate(batch.seqs):
        slots = torch.cat([seg.slots(C) for seg in s.segments])
        k = k_cache.view(-1, HKV, D)[slots].double().repeat_interleave(G, 1)
        v = v_cache.view(-1, HKV, D)[slots].double().repeat_interleave(G, 1)
        p = (torch.einsum("hd,lhd->hl", q[i].double(), k) * SHAPE.scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


def run_step(backend, batch, gen, k_cache, v_cache):
    backend.plan(batch)
    q = torch.randn(2, HKV * G, D, generator=gen)
    k, v = torch.randn(2, HKV, D, generator=gen), torch.randn(2, HKV, D, generator=gen)
    o = backend.run(q, k, v, k_cache, v_cache)
    err = (o.double() - dense_from_cache(batch, q, k_cache, v_cache)).abs().max()
    assert err <= 1e-5 * v_cache.abs().max()  # fp32 tolerance, see test_reference_ops
    return backend.current


def tensors(plan):
    fields = (f.name for f in dataclasses.fields(DevicePlan))
    return {f: getattr(plan, f) for f in fields if isinstance(getattr(plan, f), torch.Tensor)}


@pytest.mark.parametrize("name", ["paged", "hydragen", "chunk"])
def test_same_structure_reuses_every_tensor(name):
    backend = create_backend(name, SHAPE)
    backend.plan(step(5, 3))
    first = tensors(backend.current)
    backend.plan(dataclasses.replace(step(5, 3), slots=step(5, 3).slots.clone()))
    assert all(t is first[f] for f, t in tensors(backend.current).items())


@pytest.mark.parametrize("name", ["paged", "hydragen", "chunk"])
def test_decode_steps_update_in_place_and_stay_exact(name):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, C, HKV, D, generator=gen) for _ in range(2))
    backend = create_backend(name, SHAPE)
    before = tensors(run_step(backend, step(5, 3), gen, k_cache, v_cache))
    kv_hi = before["kv_hi"].clone()
    after = tensors(run_step(backend, step(6, 4), gen, k_cache, v_cache))  # same chunks
    assert all(after[f] is before[f] for f in after)  # nothing reallocated
    assert not torch.equal(after["kv_hi"], kv_hi)  # ...and the lengths updated in place
    assert torch.equal(after["kv_chunk"], before["kv_chunk"])
    grown = tensors(run_step(backend, step(17, 5, (9, 11)), gen, k_cache, v_cache))  # new chunk
    assert grown["kv_chunk"] is not before["kv_chunk"] and 11 in grown["kv_chunk"].tolist()
    assert grown["item_q_start"] is before["item_q_start"]  # unchanged fields are still kept
