"""The fused MoE op: the Triton grouped GEMMs against their PyTorch twin, both run on DEVICE,
and both against a dense fp64 evaluation of the same experts.

Runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before triton is first
imported); PREFIXSERVE_TRITON_TEST_DEVICE=cuda runs the same tests compiled on a GPU.

Bounds. Each output element is a dot product of length n (H, then I); two fp32 evaluations in
different orders differ by <= 2 n u32 sum|a_i b_i| (and each rounds to the dtype once, by u):
so a product rounded to the dtype differs by <= u |ref| + 2 n u32 S on each side, S the sum of
absolute products. The errors of h propagate into the down product through |W_down|. The test
uses the derived bound with a factor 2 margin for the silu and weight roundings.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module imports triton
pytest.importorskip("triton")

from prefixserve.model.fused import moe, moe_reference, moe_triton  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
U32 = U[torch.float32]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def moe_inputs(tokens, hidden, inter, experts, top_k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = moe.route(logits.to(dtype), top_k, renormalize=True)
    return (*(t.to(dtype).to(DEVICE) for t in (x, w13, w2)), weights.to(DEVICE), ids.to(DEVICE))


def dense_fp64(x, w13, w2, weights, ids):
    """Every (token, slot) pair's weighted expert output in fp64, and the sums of absolute
    products of both matrices (for the bounds): [T*K, H] each."""
    k = ids.shape[1]
    x, w13, w2, weights = (t.double().cpu() for t in (x, w13, w2, weights))
    flat = ids.reshape(-1).cpu()
    xs = x[torch.arange(flat.numel()) // k]
    gu = torch.einsum("ph,pnh->pn", xs, w13[flat])
    gu_abs = torch.einsum("ph,pnh->pn", xs.abs(), w13[flat].abs())
    gate, up = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    h_err = (gu_abs.chunk(2, dim=-1)[0] + gu_abs.chunk(2, dim=-1)[1]) * (h.abs() + 1)
    y = torch.einsum("pi,phi->ph", h, w2[flat]) * weights.reshape(-1)[:, None]
    y_abs = torch.einsum("pi,phi->ph", h.abs() + h_err, w2[flat].abs()) * weights.reshape(-1).abs()[:, None]
    return y, y_abs


def bound(y_abs, hidden, inter, dtype):
    u = U[dtype]
    return 2 * (4 * u + 2 * (hidden + inter) * U32) * y_abs.to(DEVICE) + 1e-30


SHAPES = [(7, 64, 48, 4, 2), (33, 40, 80, 8, 3), (1, 64, 64, 16, 4)]  # (T, H, I, E, K)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_twin_and_fp64(shape, dtype):
    t, hidden, inter, experts, top_k = shape
    args = moe_inputs(t, hidden, inter, experts, top_k, dtype, seed=t)
    out = moe_triton.expert_outputs(*args)
    ref = moe_reference.expert_outputs(*args)
    exact, y_abs = dense_fp64(*args)
    b = bound(y_abs, hidden, inter, dtype)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape == (t * top_k, hidden)
    assert ((out.double() - ref.double()).abs() <= 2 * b).all()
    assert ((ref.double() - exact.to(DEVICE)).abs() <= b).all()
    assert ((out.double() - exact.to(DEVICE)).abs() <= b).all()


def test_align_pairs_sorts_by_expert_in_padded_blocks():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3]])
    pair_ids, block_expert = moe_triton.align_pairs(ids, num_experts=5, block_m=2)
    pairs = ids.numel()
    # (8 pairs + 5 * 1 padding) / 2 -> 7 blocks; experts 0 (3 pairs: 2 blocks), 1, 2, 3 (2 blocks)
    assert block_expert.tolist() == [0, 0, 1, 2, 3, 3, -1]
    assert pair_ids.tolist() == [1, 2, 6, pairs, 5, pairs, 3, pairs, 0, 4, 7, pairs, pairs, pairs]


def test_fused_moe_sums_in_expert_order():
    """out[t] = its K results added by ascending expert id: matches HF's loop exactly in fp32."""
    x, w13, w2, weights, ids = (a.cpu() for a in moe_inputs(9, 32, 16, 6, 3, torch.float32, seed=5))
    out = moe.fused_moe(x, w13, w2, weights, ids)
    hf = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        slot, tok = torch.where((ids == e).T)
        gate, up = torch.nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        hf.index_add_(0, tok, y * weights[tok, slot, None])
    assert torch.equal(out, hf)


def test_route_renormalizes_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, ids = moe.route(logits, 2, renormalize=True)
    assert ids.tolist() == [[3, 2]] and torch.allclose(w.sum(), torch.tensor(1.0))
    w, _ = moe.route(logits, 2, renormalize=False)
    assert w.sum().item() < 0.95


def test_bench_function_runs_on_a_tiny_config(tmp_path):
    """The GPU benchmark's function, on the CPU: its per-expert baseline is HF's loop (equal
    to the fused op in fp32), and each row carries its limit."""
    from prefixserve.bench.moe import hf_expert_loop, moe_step_timing
    x, w13, w2, weights, ids = (a.cpu() for a in moe_inputs(9, 32, 16, 6, 3, torch.float32, seed=6))
    assert torch.equal(hf_expert_loop(x, w13, w2, weights, ids), moe.fused_moe(x, w13, w2, weights, ids))
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 16, "hidden_size": 32,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    rows = moe_step_timing(tmp_path / "c.json", tokens=(4,), device="cpu", dtype=torch.float32)
    assert rows[0]["tokens"] == 4 and rows[0]["flops"] == 6 * 4 * 2 * 16 * 32
    assert rows[0]["limit_us"] > 0 and rows[0]["fused_us"] > 0
