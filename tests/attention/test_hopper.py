"""The Gluon wide launch (`ops.triton.hopper`, sm_90 only) against its twin,
`ops.reference.attend_items`, and against the Triton kernel it replaces.

Gluon does not run in Triton's interpreter, so these tests run only on a Hopper GPU
(PREFIXSERVE_TRITON_TEST_DEVICE=cuda on the lent H100 / H200); CI runs the twin's and the
Triton kernel's tests. Tolerances as in test_triton_ops (16-bit P on the tensor cores).

The problems are decode steps over shared items with many rows (units of 128 rows: R query
rows x G heads), whose entries start and end inside chunks, with NaN in every slot no entry
covers: a slot outside [lo, hi) must reach neither a score nor the output; and prompts
(prefill), whose row blocks are masked by position across their diagonal.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type != "cuda" or torch.cuda.get_device_capability(DEVICE)[0] != 9:
    pytest.skip("the Gluon kernel runs on a Hopper GPU only (PREFIXSERVE_TRITON_TEST_DEVICE=cuda)",
                allow_module_level=True)

from prefixserve.attention.ops import reference  # noqa: E402
from prefixserve.attention.ops import triton as tops  # noqa: E402
from prefixserve.attention.ops.triton.launch import GLUON_TRITON, hopper_module  # noqa: E402

hopper = hopper_module()
products = hopper_module("hopper_products")
if hopper is None:
    pytest.skip(f"the Gluon kernel is tested on Triton {GLUON_TRITON} only", allow_module_level=True)
from triton import knobs  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from prefixserve.attention.ops.triton.configs import NARROW_REGS_BESIDE_GLUON, KernelConfig  # noqa: E402

U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
NARROW = KernelConfig(16, 64, num_warps=2)


@gluon.jit
def _quantize_kernel(x, inv, y, BLOCK: gl.constexpr, ROUNDED: gl.constexpr):
    """y[i] = hopper_products._quantize(x[i], inv[0]) (ROUNDED: `_quantize_rounded`), BLOCK
    values a program."""
    i = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=gl.BlockedLayout([4], [32], [4], [0]))
    if ROUNDED:
        gl.store(y + i, products._quantize_rounded(gl.load(x + i), gl.load(inv)))
    else:
        gl.store(y + i, products._quantize(gl.load(x + i), gl.load(inv)))


@pytest.mark.parametrize("rounded", [False, True], ids=["cast", "rounded"])
@pytest.mark.parametrize("inv", [1.0, 2.0**-3, 2.0**5])
def test_quantize_matches_the_reference_bit_for_bit(inv, rounded):
    """The Gluon kernels' e4m3 quantizations of new keys (`hopper_products._quantize`, the wide
    kernel's, and `_quantize_rounded`, the row walk's) against `reference.quantize`, as the
    cache's bytes: every fp16 value but NaN (all of e4m3's ties, its subnormals' ties, +-0,
    +-inf, saturation) x a power-of-two inverse scale, and random fp32 values that no fp16
    holds."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    rand = torch.randn(2**16, generator=torch.Generator().manual_seed(7)) * 40
    x = torch.cat([every[~every.isnan()], rand])
    x = torch.cat([x, torch.zeros(-x.numel() % 512)]).to(DEVICE)  # whole programs
    scale = torch.tensor([inv], device=DEVICE)
    y = torch.empty(x.shape, dtype=reference.FP8, device=DEVICE)
    _quantize_kernel[(x.numel() // 512,)](x, scale, y, BLOCK=512, ROUNDED=rounded, num_warps=4)
    ref = reference.quantize(x[:, None, None].cpu(), scale.cpu())[:, 0, 0]
    assert torch.equal(y.cpu().view(torch.uint8), ref.view(torch.uint8))


def shared_items(seed: int, dtype: torch.dtype, hkv: int, g: int, d: int, chunk: int,
                 items: list[tuple[int, int, int, int]]):
    """attend_items' arguments for `items` of (query rows, first slot, keys, chunks skipped):
    each item's keys are its own run of chunks from slot `first` of the first one; the
    chunk ids are shuffled; every slot no item covers holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    spans = [-(-(first + keys) // chunk) for _, first, keys, _ in items]
    n = sum(spans) + sum(skip for *_, skip in items) + 1
    k_cache = torch.full((n, chunk, hkv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    perm = torch.randperm(n, generator=gen)
    rows = sum(r for r, *_ in items)
    q = torch.randn(rows, hkv * g, d, generator=gen).to(dtype)
    q_start, kv_chunk, kv_lo, kv_hi, kv_pos, indptr = [], [], [], [], [], [0]
    at, row = 0, 0
    for (r, first, keys, skip), span in zip(items, spans, strict=True):
        at += skip
        q_start.append(row)
        row += r
        pos = 0
        for c in range(span):
            lo, hi = (first if c == 0 else 0), min(chunk, first + keys - c * chunk)
            cid = int(perm[at + c])
            for cache in (k_cache, v_cache):
                cache[cid, lo:hi] = torch.randn(hi - lo, hkv, d, generator=gen).to(dtype)
            kv_chunk.append(cid)
            kv_lo.append(lo)
            kv_hi.append(hi)
            kv_pos.append(pos)
            pos += hi - lo
        at += span
        indptr.append(len(kv_chunk))
    q_len = [r for r, *_ in items]
    q_pos = torch.full((rows,), 1 << 20, dtype=torch.int32)  # decode: after every key

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32)

    return (q, k_cache, v_cache, q_pos, i32(q_start), i32(q_len), i32(q_start), i32(indptr),
            i32(kv_chunk), i32(kv_lo), i32(kv_hi), i32(kv_pos)), rows


def prompt_items(seed: int, dtype: torch.dtype, hkv: int, g: int, d: int, chunk: int,
                 prompts: list[tuple[int, int, int]]):
    """`shared_items` for prefill `prompts` of (cached keys, new rows, first slot): one item
    each over its cached and new keys, its new rows after the cached ones (row r at position
    cached + r)."""
    args, rows = shared_items(seed, dtype, hkv, g, d, chunk,
                              [(new, first, cached + new, 0) for cached, new, first in prompts])
    q_pos = torch.cat([torch.arange(cached, cached + new) for cached, new, _ in prompts]).int()
    return (*args[:3], q_pos, *args[4:]), rows


def to_fp8(seed: int, args: tuple, hkv: int, d: int):
    """`shared_items`' arguments over an fp8 cache (per-head powers of two, as the engine's
    scales; NaN slots stay NaN): (arguments, kv_scale)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.exp2(-torch.randint(5, 9, (2, hkv), generator=gen).float())
    kv_scale = torch.cat([s, 1 / s])
    k8, v8 = (reference.quantize(c.float().view(-1, hkv, d), kv_scale[i]).view(c.shape)
              for c, i in ((args[1], reference.K_INV), (args[2], reference.V_INV)))
    return (args[0], k8, v8, *args[3:]), kv_scale


def check_partials(o, lse, o_ref, lse_ref, o_bound):
    """A launch's (o, lse) against the twin's: no NaN, o within o_bound, lse -inf where the
    twin's is (rows that saw no key), else within fp32 rounding."""
    assert not o.isnan().any() and not lse.isnan().any()
    assert (o - o_ref).abs().max() <= o_bound
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert ((lse - lse_ref)[fin].abs() <= 2e-4 * (1 + lse_ref[fin].abs())).all()


def with_padding(row, pad: int):
    """A bench row's (batch, q, k, v, k_cache, v_cache) with `pad` padding rows more, as a graph's
    step has them (0: the step as it is); the caches hold one more chunk, where those rows write
    their keys."""
    from prefixserve.attention.base import PaddedRows

    batch, q, k, v = row.batch, row.q, row.k, row.v
    k_cache, v_cache = (torch.cat([c, torch.zeros_like(c[:1])]) for c in (row.k_cache, row.v_cache))
    if pad:
        pad_slot = row.k_cache.shape[0] * row.k_cache.shape[1]
        batch = dataclasses.replace(batch, padded=PaddedRows(batch.num_tokens + pad, pad_slot))
        q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], device=DEVICE).to(x.dtype)]) for x in (q, k, v))
    return batch, q, k, v, k_cache, v_cache


CASES = [  # (dtype, Hkv, G, D, chunk, items)
    (torch.float16, 2, 4, 128, 64, [(100, 5, 1000, 0), (40, 0, 64 * 7, 2), (3, 60, 10, 1)]),
    (torch.bfloat16, 1, 8, 128, 64, [(64, 0, 4096, 0), (17, 33, 700, 3)]),
    (torch.float16, 4, 2, 64, 128, [(96, 100, 1500, 0), (64, 0, 129, 1)]),
    (torch.bfloat16, 2, 1, 128, 64, [(300, 1, 333, 0)]),
]


@pytest.mark.parametrize("dtype,hkv,g,d,chunk,items", CASES)
@pytest.mark.parametrize("sms", [None, 3], ids=["whole-items", "split-k"])
@pytest.mark.parametrize("block_m,pairs", [(128, False), (128, True), (32, False)],
                         ids=["two-row-groups", "chunk-pairs", "one-row-group"])
def test_gluon_wide_launch_matches_twin(dtype, hkv, g, d, chunk, items, sms, block_m, pairs):
    """Units of 128 rows (two row warpgroups; over 64-slot chunks also in 128-key tiles of two
    chunks, `hopper_pairs`, whose units start and end at any entry: an odd last one masks its
    tile's second half) and of 32 (one, its tiles half padding)."""
    args, rows = shared_items(len(items) + d, dtype, hkv, g, d, chunk, items)
    dev = [x.to(DEVICE) for x in args]
    assert hopper.applies(dev[0], dev[1], block_m, False, None, False)
    assert not hopper.applies(dev[0], dev[1], 16, False, None, False), "narrow tiles stay Triton's"
    if pairs and chunk != 64:
        assert not hopper_module("hopper_pairs").applies(dev[1], block_m, None, None)
        return
    o_ref, lse_ref = reference.attend_items(*args, 1.0 / d**0.5, rows)
    vmax = args[2].nan_to_num(0).abs().max().float()
    results = []
    for use in (True, False):  # the Gluon kernel, then the Triton kernel it replaces
        wide = KernelConfig(block_m, 64, num_stages=2, programs_per_sm=2, hopper=use, pairs=pairs and use)
        o, lse = (x.cpu() for x in tops.attend_items(*dev, 1.0 / d**0.5, rows, sms=sms,
                                                     configs=(NARROW, wide)))
        check_partials(o, lse, o_ref, lse_ref, (1e-5 + 2 * U[dtype]) * vmax)
        results.append(o)
    # the two kernels: the same products and softmax, up to the order of fp32 sums
    assert (results[0] - results[1]).abs().max() <= 2 * U[dtype] * vmax


PROMPTS = [  # (dtype, Hkv, G, D, chunk, prompts of (cached keys, new rows, first slot))
    (torch.float16, 2, 1, 128, 64, [(0, 700, 0), (130, 300, 5)]),
    (torch.bfloat16, 2, 4, 128, 64, [(0, 257, 0), (1000, 70, 63)]),
    (torch.float16, 4, 2, 64, 128, [(40, 500, 100)]),
]


@pytest.mark.parametrize("dtype,hkv,g,d,chunk,prompts", PROMPTS)
@pytest.mark.parametrize("sms", [None, 3], ids=["whole-items", "split-k"])
@pytest.mark.parametrize("block_m", [128, 32], ids=["two-row-groups", "one-row-group"])
def test_gluon_wide_launch_over_a_prompt_matches_twin(dtype, hkv, g, d, chunk, prompts, sms, block_m):
    """Prefill: a prompt's row blocks (after cached keys or none, entries starting inside a
    chunk) masked by position in the tiles across their diagonal, the tiles after it left out
    (split-k: some splits past a block's rows hold no tile): against the twin and the Triton
    kernel. Over an fp8 cache the Triton kernel runs them."""
    seed = len(prompts) + d + g
    args, rows = prompt_items(seed, dtype, hkv, g, d, chunk, prompts)
    dev = [x.to(DEVICE) for x in args]
    assert hopper.applies(dev[0], dev[1], block_m, True, None, False)
    fp8_args, _ = to_fp8(seed, args, hkv, d)
    assert not hopper.applies(dev[0], fp8_args[1].to(DEVICE), 32, True, None, False)
    o_ref, lse_ref = reference.attend_items(*args, 1.0 / d**0.5, rows)
    vmax = args[2].nan_to_num(0).abs().max().float()
    results = []
    for use in (True, False):  # the Gluon kernel, then the Triton kernel it replaces
        wide = KernelConfig(block_m, 64, num_stages=2, programs_per_sm=2, hopper=use)
        o, lse = (x.cpu() for x in tops.attend_items(*dev, 1.0 / d**0.5, rows, sms=sms,
                                                     configs=(NARROW, wide)))
        check_partials(o, lse, o_ref, lse_ref, (1e-5 + 2 * U[dtype]) * vmax)
        results.append(o)
    assert (results[0] - results[1]).abs().max() <= 2 * U[dtype] * vmax


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_step_with_gluon_wide_units(dtype, monkeypatch):
    """A prefill step: 3 prompts of 300-700 new tokens (G 4) after a shared 200-token cached
    prefix. Relay's plan takes the Gluon wide kernel (masked by position) for the prompts'
    row blocks and for the shared item; against the same plan on the Triton kernel, paged,
    and dense attention; the cache holds the new keys; a second run gives the same output."""
    import math

    from prefixserve.attention.backends.paged import PagedBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries
    from prefixserve.attention.ops.triton import kernels as tk

    c, hkv, g, d = 64, 4, 4, 128
    shape = AttentionShape(hkv * g, hkv, d, 1 / math.sqrt(d), dtype, DEVICE)
    gen = torch.Generator().manual_seed(3)
    news = (300, 700, 450)
    n_chunks = 4 + sum(-(-n // c) + 1 for n in news)
    ids = iter(torch.randperm(n_chunks, generator=gen).tolist())
    shared = Segment(0, 0, 200, tuple(next(ids) for _ in range(4)), 0)
    seqs, slots, start = [], [], 0
    for i, n in enumerate(news):
        own = Segment(1 + i, 200, n, tuple(next(ids) for _ in range(-(-n // c))), 0)
        seqs.append(SeqQueries(start, n, 200, (shared, own)))
        slots.append(own.slots(c))
        start += n
    batch = AttentionBatch(tuple(seqs), c, torch.cat(slots))
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(DEVICE)  # noqa: E731
    q, k, v = rnd(start, hkv * g, d), rnd(start, hkv, d), rnd(start, hkv, d)
    k_cache, v_cache = rnd(n_chunks, c, hkv, d), rnd(n_chunks, c, hkv, d)
    choose = tk.choose_configs

    def triton_wide(*args, **kwargs):
        narrow, wide = choose(*args, **kwargs)
        return narrow, dataclasses.replace(wide, hopper=False)

    outs = {}
    for label, cls, on in (("gluon", RelayBackend, True), ("triton", RelayBackend, False),
                           ("paged", PagedBackend, True)):
        monkeypatch.setattr(tk, "choose_configs", choose if on else triton_wide)
        be = cls(shape, kernels=tops.TritonKernels(shape))
        be.plan(batch)
        x = be.current.extra
        assert x["causal_wide"] and x["wide_hopper"] == on and not x["wide_pairs"], label
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[label] = be.run(q, k, v, kc, vc).float()
        again = be.run(q, k, v, k_cache.clone(), v_cache.clone()).float()
        assert torch.equal(again, outs[label]) and not outs[label].isnan().any(), label
        assert torch.equal(kc.view(-1, hkv, d)[batch.slots.to(DEVICE)], k), label
    dense = []
    for s in seqs:  # the shared keys from the cache, the prompt's own from k, v
        kd = torch.cat([k_cache.view(-1, hkv, d)[shared.slots(c).to(DEVICE)], k[s.q_start:s.q_start + s.q_len]])
        vd = torch.cat([v_cache.view(-1, hkv, d)[shared.slots(c).to(DEVICE)], v[s.q_start:s.q_start + s.q_len]])
        kd, vd = (x.double().repeat_interleave(g, 1).transpose(0, 1) for x in (kd, vd))
        qd = q[s.q_start:s.q_start + s.q_len].double().transpose(0, 1)
        mask = torch.ones(s.q_len, 200 + s.q_len, dtype=torch.bool, device=DEVICE).tril(200)
        dense.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask,
                                                                      scale=shape.scale).transpose(0, 1))
    ref = torch.cat(dense)
    vmax = max(v.abs().max(), v_cache.abs().max()).float()
    for label, o in outs.items():
        assert (o - ref).abs().max() <= 4 * U[dtype] * vmax, label


@pytest.mark.parametrize("dtype,hkv,g,d,chunk,items", CASES)
@pytest.mark.parametrize("sms", [None, 3], ids=["whole-items", "split-k"])
@pytest.mark.parametrize("block_m", [64, 32])
def test_gluon_wide_launch_over_fp8_matches_twin(dtype, hkv, g, d, chunk, items, sms, block_m):
    """An fp8 cache's units of <= 64 rows (one row warpgroup; tiles widened from e4m3 by a
    warpgroup of their own): against the twin and the Triton kernel. Units of 128 rows stay
    the Triton kernel's."""
    args, rows = shared_items(len(items) + d, dtype, hkv, g, d, chunk, items)
    args, kv_scale = to_fp8(len(items) + d, args, hkv, d)
    dev = [x.to(DEVICE) for x in args]
    assert hopper.applies(dev[0], dev[1], block_m, False, None, False)
    assert not hopper.applies(dev[0], dev[1], 128, False, None, False)
    o_ref, lse_ref = reference.attend_items(*args, 1.0 / d**0.5, rows, kv_scale=kv_scale)
    vmax = (args[2].float() * kv_scale[reference.V_SCALE][None, None, :, None]).nan_to_num(0).abs().max()
    results = []
    for use in (True, False):  # the Gluon kernel, then the Triton kernel it replaces
        wide = KernelConfig(block_m, 64, num_stages=5, programs_per_sm=1, hopper=use)
        o, lse = (x.cpu() for x in tops.attend_items(*dev, 1.0 / d**0.5, rows, kv_scale=kv_scale.to(DEVICE),
                                                     sms=sms, configs=(NARROW, wide)))
        check_partials(o, lse, o_ref, lse_ref, (1e-5 + 2 * U[dtype]) * vmax)
        results.append(o)
    assert (results[0] - results[1]).abs().max() <= 2 * U[dtype] * vmax


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,context", [(24, 8, 8, 512), (12, 16, 4, 512), (20, 8, 8, 700)],
                         ids=["all-shared-g1", "all-shared-g4", "tails-g1"])
def test_decode_step_with_gluon_wide_units_over_fp8(dtype, batch, heads, kv_heads, context, monkeypatch):
    """A decode step over an fp8 cache whose wide units hold <= 64 rows: relay runs them in
    the Gluon kernel. All-shared, the wide units write their rows' new keys (quantized as the
    store launch quantizes them); with tails, the narrow units do. Against the Triton wide
    kernel (Gluon off: within the products' 16-bit P) and paged; the same cache bytes; a
    second run gives the same output."""
    from prefixserve.attention.backends.paged import PagedBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.attention.ops.triton import kernels as tk
    from prefixserve.bench.kernels.rows import Workload, build

    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    row = build(Workload("test", batch, heads, kv_heads, 128, context, (512,), 64, name, kv_dtype="fp8"),
                DEVICE)
    choose = tk.choose_configs

    def triton_wide(*args, **kwargs):
        narrow, wide = choose(*args, **kwargs)
        return narrow, dataclasses.replace(wide, hopper=False)

    outs, caches = {}, []
    for label, cls, on in (("gluon", RelayBackend, True), ("triton", RelayBackend, False),
                           ("paged", PagedBackend, True)):
        monkeypatch.setattr(tk, "choose_configs", choose if on else triton_wide)
        be = cls(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(row.batch)
        x = be.current.extra
        if cls is RelayBackend:
            assert x["wide_block_m"] <= 64 and x["stores_wide"] == (context == 512), label
            assert hopper.applies(row.q, row.k_cache, x["wide_block_m"], False, None, bool(x["stores_wide"]))
            assert x["wide_hopper"] == on, label
        k_cache, v_cache = row.k_cache.clone(), row.v_cache.clone()
        outs[label] = be.run(row.q, row.k, row.v, k_cache, v_cache, kv_scale=row.kv_scale).float()
        again = be.run(row.q, row.k, row.v, row.k_cache.clone(), row.v_cache.clone(), kv_scale=row.kv_scale)
        assert torch.equal(again.float(), outs[label]) and not outs[label].isnan().any(), label
        caches.append((k_cache, v_cache))
    for other in caches[1:]:
        for a, b in zip(caches[0], other, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for label, o in outs.items():
        assert (o - outs["paged"]).abs().max() <= 4 * U[dtype] * row.vmax, label


def _widenings_before_their_keys(sass: str) -> list[str]:
    """The e4m3 widenings (`F2FP...UNPACK_B`) in `sass` (cuobjdump's) that read a register
    which an e4m3 conversion (`F2FP...PACK_AB*`) writes within the next 60 instructions and
    nothing wrote in the 100 before: the misschedule by which ptxas 12.8 let the row walk
    score stale registers when it quantized its new keys by the cast (NaN in some of a step's
    rows, a different number each run; kernels-notes.md, issue 25 part sixteen). Found there
    in the walk built with `_quantize`, none in the walk with `_quantize_rounded` or in the wide
    kernel with either (sm_90a, ptxas 12.8.93)."""
    code = [re.sub(r"^@!?U?P\w+\s+", "", m.group(1))
            for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]

    def written(ins: str) -> tuple[str, set[str]]:
        op, _, rest = ins.partition(" ")
        reg = re.match(r"\s*R(\d+)", rest)
        if reg is None or op.startswith(("ST", "RED", "ATOM", "BRA", "SYNCS", "BAR")):
            return op, set()
        width = 4 if ".128" in op else 2 if (".64" in op or "WIDE" in op) else 1
        return op, {f"R{int(reg.group(1)) + k}" for k in range(width)}

    info = [written(ins) for ins in code]
    found = []
    for i, (op, _) in enumerate(info):
        if op.startswith("F2FP") and "UNPACK" in op:
            src = re.search(r"(R\d+)(\.H1|\.reuse)*\s*$", code[i]).group(1)
            packed_after = any(src in regs and o.startswith("F2FP") and "UNPACK" not in o
                               for o, regs in info[i + 1:i + 61])
            if packed_after and not any(src in regs for _, regs in info[max(0, i - 100):i]):
                found.append(code[i])
    return found


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_e4m3_widening_reads_its_key_before_the_conversion(dtype, tmp_path):
    """The SASS of the fp8 kernels that quantize new keys -- the wide kernel over the rows'
    own keys (`_quantize`, an all-shared step), the row walk over its tails' (a step with
    tails) -- as compiled in this process by relay's steps: no widening scheduled before the
    conversion it widens (`_widenings_before_their_keys`)."""
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.bench.kernels.rows import Workload, build

    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    for context in (512, 700):
        row = build(Workload("test", 20, 8, 8, 128, context, (512,), 64, name, kv_dtype="fp8"), DEVICE)
        be = RelayBackend(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(row.batch)
        be.run(row.q, row.k, row.v, row.k_cache.clone(), row.v_cache.clone(), kv_scale=row.kv_scale)
    torch.cuda.synchronize()
    scanned = set()
    for kernel in (hopper._wide_kernel, hopper_module("hopper_rows")._rows_kernel):
        for i, compiled in enumerate(kernel.device_caches[DEVICE.index or 0][0].values()):
            cubin = tmp_path / f"{compiled.name}-{i}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            sass = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], text=True)
            if "E4M3.F32.PACK" in sass:  # it quantizes new keys
                assert _widenings_before_their_keys(sass) == [], compiled.name
                scanned.add(compiled.name)
    assert scanned == {"_wide_kernel", "_rows_kernel"}, scanned


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,kv_heads,block_m", [(96, 4, 128), (24, 16, 32)],
                         ids=["two-row-groups", "one-row-group"])
def test_decode_step_with_gluon_wide_units(dtype, batch, kv_heads, block_m):
    """A decode step whose shared prefix makes wide units (128 rows: 96 sequences x G 4; 32:
    24 x G 1): relay and hydragen run them in the Gluon kernel, beside the narrow units that
    write the new keys (Triton) -- at 128 rows in the shape that fits beside it, taking units
    from a counter; at 32 rows (G 1) in its own shape, not the row walk, as its 384 tails are
    split over the SMs; paged (narrow units only) runs Triton alone. The three agree, the
    cache holds the new keys after each, and a second run gives the same output (the counter
    is back at 0)."""
    from prefixserve.attention.backends.hydragen import HydragenBackend
    from prefixserve.attention.backends.paged import PagedBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.bench.kernels.rows import Workload, build

    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    row = build(Workload("test", batch, 16, kv_heads, 128, 700, (512,), 64, name, groups=4), DEVICE)
    outs = {}
    for cls in (PagedBackend, RelayBackend, HydragenBackend):
        be = cls(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(row.batch)
        x = be.current.extra
        if cls is not PagedBackend:  # Gluon applies, stores folded
            assert x["stores"] and x["wide_block_m"] == block_m and x["narrow_programs"] > 0
            beside = block_m == 128
            assert x["narrow_dynamic"] == beside and not x["narrow_walk"]
            assert x["narrow_maxnreg"] == (NARROW_REGS_BESIDE_GLUON if beside else 0)
            # a sub-partition's 512 registers a warp-thread: 3 of the CTA's warps and 1 narrow warp
            assert 3 * hopper.MAXNREG + NARROW_REGS_BESIDE_GLUON <= 512
        k_cache, v_cache = row.k_cache.clone(), row.v_cache.clone()
        outs[cls.name] = be.run(row.q, row.k, row.v, k_cache, v_cache).float()
        again = be.run(row.q, row.k, row.v, k_cache.clone(), v_cache.clone()).float()
        assert torch.equal(again, outs[cls.name]) and not be.kernels.queues.any(), cls.name
        slots = row.batch.slots.to(DEVICE)
        assert torch.equal(k_cache.view(-1, *k_cache.shape[2:])[slots], row.k)
        assert torch.equal(v_cache.view(-1, *v_cache.shape[2:])[slots], row.v)
    vmax = row.v_cache.abs().max().float()
    for name_, o in outs.items():
        assert not o.isnan().any(), name_
        assert (o - outs["paged"]).abs().max() <= 4 * U[dtype] * vmax, name_


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-grid"])
def test_decode_step_over_chunk_pairs(dtype, padded):
    """A decode step whose shared items walk 85x a tail's entries and hold every SM in one wave
    (256 sequences x G 4 under 16,384 shared keys, 128-key tails: 256 entries to 3, over
    WALK_OVER_TAILS, so no swapped walk): relay's and hydragen's plans take the Gluon wide kernel
    over 128-key tiles of two chunks (`hopper_pairs`), eagerly and in a graph's plan (padded
    rows); they agree with paged (Triton's narrow units only), padding rows are zeros, and a
    second run gives the same output."""
    from prefixserve.attention.backends.hydragen import HydragenBackend
    from prefixserve.attention.backends.paged import PagedBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.bench.kernels.rows import Workload, build

    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    row = build(Workload("test", 256, 32, 8, 128, 16512, (16384,), 64, name), DEVICE)
    batch, q, k, v, k_cache, v_cache = with_padding(row, 5 if padded else 0)
    outs = {}
    for cls in (PagedBackend, RelayBackend, HydragenBackend):
        be = cls(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(batch)
        assert bool(be.current.extra["wide_pairs"]) == (cls is not PagedBackend), cls.name
        outs[cls.name] = be.run(q, k, v, k_cache.clone(), v_cache.clone()).float()
        again = be.run(q, k, v, k_cache.clone(), v_cache.clone()).float()
        assert torch.equal(again, outs[cls.name]) and not outs[cls.name].isnan().any(), cls.name
    t = row.batch.num_tokens
    for name_, o in outs.items():
        assert not o[t:].any(), name_
        assert (o[:t] - outs["paged"][:t]).abs().max() <= 4 * U[dtype] * row.vmax, name_


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-grid"])
def test_decode_step_with_the_wide_launch_on_fewer_sms(padded, monkeypatch):
    """Tails long enough to outlast the products (96 sequences x G 4 under 512 shared keys,
    2,048 keys of their own): relay's plan leaves SMs to the narrow launch (`grids.wide_sms`).
    Eager, the wide grid is that many CTAs; in a graph's plan (padded rows) the grid stays one
    CTA an SM and count[1] of them, spread over it, take units (`hopper._items`). Both agree
    with the plan on every SM and with paged; padding rows are zeros."""
    from prefixserve.attention.backends.paged import PagedBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.attention.ops.triton import grids
    from prefixserve.bench.kernels.rows import Workload, build

    row = build(Workload("test", 96, 16, 4, 128, 2560, (512,), 64, "float16", groups=4), DEVICE)
    batch, q, k, v, k_cache, v_cache = with_padding(row, 5 if padded else 0)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    outs = {}
    for label, cls, keep_all in (("fewer", RelayBackend, False), ("all", RelayBackend, True),
                                 ("paged", PagedBackend, False)):
        if keep_all:
            monkeypatch.setattr(grids, "wide_sms", lambda *args: args[7])
        be = cls(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(batch)
        x = be.current.extra
        if label == "fewer":
            takers = int(x["unit_counts"][3])
            assert 0 < takers < sms and x["wide_programs"] == (sms if padded else takers)
        outs[label] = be.run(q, k, v, k_cache.clone(), v_cache.clone()).float()
        assert not outs[label].isnan().any(), label
    t = row.batch.num_tokens
    assert not outs["fewer"][t:].any()
    for label in ("fewer", "all"):
        assert (outs[label][:t] - outs["paged"][:t]).abs().max() <= 4 * U[torch.float16] * row.vmax, label
