"""The cost report against RelayAttention's Eq. 8 and 9, and `auto`'s choices."""

import math

import pytest
import torch

from prefixserve.attention.backends.auto import AutoBackend
from prefixserve.attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries
from prefixserve.attention.cost import GPU_COST_MODEL, cost_report

H, D = 4, 16  # heads (MHA, as in the paper), head dim
d = H * D  # the paper's embedding dimension


def system_prompt_batch(b: int, s: int, c: int, chunk_size: int = 16, shared: bool = True):
    """b decoding requests: a system prompt of s tokens (node 0) + c tokens of their own."""
    ceil = lambda n: -(-n // chunk_size)  # noqa: E731
    prompt = Segment(0, 0, s, tuple(range(ceil(s))), 0)
    seqs = []
    for i in range(b):
        own = tuple(range(1000 + 100 * i, 1000 + 100 * i + ceil(c)))
        mine = tuple(range(10**5 * (i + 1), 10**5 * (i + 1) + ceil(s)))
        head = prompt if shared else Segment(1 + b + i, 0, s, mine, 0)
        seqs.append(SeqQueries(i, 1, s + c - 1, (head, Segment(1 + i, s, c, own, 0))))
    return AttentionBatch(tuple(seqs), chunk_size, torch.arange(b))


def shape(dtype=torch.float32):
    return AttentionShape(H, H, D, 1 / math.sqrt(D), dtype, torch.device("cpu"))


@pytest.mark.parametrize("b,s,c", [(32, 1024, 128), (7, 300, 1), (2, 5, 9)])
def test_relay_eq_8_and_9(b, s, c):
    """Elements moved (fp32: bytes / 4). The paper counts one d-wide vector per cached token;
    K and V are two, so each KV term appears twice here. Eq. 9's partial outputs (bd each) also
    carry one fp32 LSE per head (b*H each), written once and read once by the fusion."""
    report = cost_report(system_prompt_batch(b, s, c), shape())
    eq8 = b * d + b * (s + c) * d + b * d
    eq9 = (b * d + s * d + b * d) + (b * d + b * c * d + b * d) + 3 * b * d
    assert report["paged"].bytes / 4 == eq8 + b * (s + c) * d
    assert report["relay"].bytes / 4 == eq9 + (s + b * c) * d + 4 * b * H
    assert report["hydragen"] == report["relay"]  # one shared node: the same schedule
    for name in ("paged", "relay", "hydragen", "chunk"):
        assert report[name].flops == 4 * D * H * b * (s + c)


def test_chunk_reads_kv_once_but_saves_a_partial_per_shared_chunk():
    b, s, c = 8, 100, 3
    report = cost_report(system_prompt_batch(b, s, c), shape(torch.bfloat16))
    assert report["chunk"].kv_bytes == report["relay"].kv_bytes == (s + b * c) * 2 * H * D * 2
    shared_chunks = math.ceil(s / 16)
    assert report["chunk"].items == shared_chunks + b
    partials = (shared_chunks + 1) * b * H * (D + 1) * 4  # written, then read by the merge
    assert report["chunk"].io_bytes == (shared_chunks + 1) * b * d * 2 + b * d * 2 + 2 * partials


def test_no_attention_ceiling_only_writes_zeros():
    report = cost_report(system_prompt_batch(4, 64, 8), shape(torch.bfloat16))
    assert (report["no-attention"].bytes, report["no-attention"].flops) == (4 * d * 2, 0)


def test_auto_shares_a_long_prompt_and_pages_without_sharing():
    auto = AutoBackend(shape(torch.bfloat16), model=GPU_COST_MODEL)
    auto.plan(system_prompt_batch(32, 2048, 64))
    assert auto.chosen in ("relay", "hydragen")
    auto.plan(system_prompt_batch(32, 2048, 64, shared=False))
    assert auto.chosen == "paged"
