"""Plan caching: identical structure reuses every buffer; decode steps update only what changed,
in place (stable addresses, as CUDA graphs need), by a full rebuild or by advancing the last plan."""

import dataclasses
import math

import pytest
import torch

from prefixserve.attention import create_backend
from prefixserve.attention.base import AttentionBatch, AttentionShape, PaddedRows, Segment, SeqQueries
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


def run_step(backend, batch, gen, k_cache, v_cache, full=None):
    """Plan and run `batch` (`full`: the sequences an advanced batch stands for); check it."""
    backend.plan(batch)
    q = torch.randn(2, HKV * G, D, generator=gen)
    k, v = torch.randn(2, HKV, D, generator=gen), torch.randn(2, HKV, D, generator=gen)
    o = backend.run(q, k, v, k_cache, v_cache)
    err = (o.double() - dense_from_cache(full or batch, q, k_cache, v_cache)).abs().max()
    assert err <= 1e-5 * v_cache.abs().max()  # fp32 tolerance, see test_reference_ops
    return backend.current


def tensors(plan):
    fields = (f.name for f in dataclasses.fields(DevicePlan))
    return {f: getattr(plan, f) for f in fields if isinstance(getattr(plan, f), torch.Tensor)}


def addresses(plan):
    return {f: t.data_ptr() for f, t in tensors(plan).items()}


@pytest.mark.parametrize("name", ["paged", "hydragen", "chunk"])
def test_same_structure_reuses_every_buffer(name):
    backend = create_backend(name, SHAPE)
    backend.plan(step(5, 3))
    first, generation = addresses(backend.current), backend.generation
    backend.plan(dataclasses.replace(step(5, 3), slots=step(5, 3).slots.clone()))
    assert addresses(backend.current) == first and backend.generation == generation


@pytest.mark.parametrize("name", ["paged", "hydragen", "chunk"])
def test_decode_steps_update_in_place_and_stay_exact(name):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, C, HKV, D, generator=gen) for _ in range(2))
    backend = create_backend(name, SHAPE)
    before = tensors(run_step(backend, step(5, 3), gen, k_cache, v_cache))
    first, kv_hi = addresses(backend.current), before["kv_hi"].clone()
    kv_chunk = before["kv_chunk"].clone()
    after = tensors(run_step(backend, step(6, 4), gen, k_cache, v_cache))  # same chunks
    assert addresses(backend.current) == first  # nothing reallocated
    assert not torch.equal(after["kv_hi"], kv_hi)  # ...and the lengths updated in place
    assert torch.equal(after["kv_chunk"], kv_chunk)
    grown = tensors(run_step(backend, step(17, 5, (9, 11)), gen, k_cache, v_cache))  # new chunk
    assert 11 in grown["kv_chunk"].tolist()
    assert addresses(backend.current) == first  # more entries, same (doubling) buffers


def host_plan(plan):
    return {f: t.tolist() for f, t in tensors(plan).items()}


@pytest.mark.parametrize("name", ["paged", "relay", "hydragen", "chunk", "auto"])
def test_advancing_a_plan_equals_rebuilding_it(name):
    """Decode steps 12->20 of A (its 17th key opens chunk 11) and 3->11 of B: an advanced
    plan holds exactly the arrays a fresh backend builds from the full batch, and stays exact."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(12, C, HKV, D, generator=gen) for _ in range(2))
    backend = create_backend(name, SHAPE)
    run_step(backend, step(12, 3), gen, k_cache, v_cache)
    for n in range(1, 9):
        full = step(12 + n, 3 + n, (9, 11) if 12 + n > C else (9,))
        assert backend.can_advance()
        advanced = run_step(backend, AttentionBatch((), C, full.slots, advance=True), gen,
                            k_cache, v_cache, full)
        fresh = create_backend(name, SHAPE)
        fresh.plan(full)
        assert host_plan(advanced) == host_plan(fresh.current), n


@pytest.mark.parametrize("name", ["paged", "hydragen", "chunk", "no-attention"])
def test_padded_rows_attend_to_nothing(name):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(12, C, HKV, D, generator=gen) for _ in range(2))
    pad_slot = 11 * C + 5  # a slot no sequence of `step` owns
    batch = dataclasses.replace(step(5, 3), padded=PaddedRows(8, pad_slot))
    backend = create_backend(name, SHAPE)
    backend.plan(batch)
    q = torch.randn(8, HKV * G, D, generator=gen)
    k, v = torch.randn(8, HKV, D, generator=gen), torch.randn(8, HKV, D, generator=gen)
    o = backend.run(q, k, v, k_cache, v_cache)
    assert o.shape == q.shape and not o[2:].any()
    if name != "no-attention":
        expect = dense_from_cache(step(5, 3), q[:2], k_cache, v_cache)
        assert (o[:2].double() - expect).abs().max() <= 1e-5 * v_cache.abs().max()
    assert torch.equal(k_cache.view(-1, HKV, D)[pad_slot], k[-1])  # padding wrote the pad slot
