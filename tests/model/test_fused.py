"""The fused Triton kernels against their PyTorch twins (`fused.reference`), both run on DEVICE.

Runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is
first imported); PREFIXSERVE_TRITON_TEST_DEVICE=cuda runs the same tests compiled on a GPU,
where the twins are torch's CUDA ops. Skipped only where triton is not installed.

The kernels keep every rounding point of their twins, so a result differs only where an input
to a rounding differs: the sum order of RMSNorm's mean (and on CUDA torch's mean and rsqrt,
which are not correctly rounded), and cos/sin/exp, which are numpy's in the interpreter and
SLEEF's in torch on CPU; compiled, they are libdevice's, as in torch's CUDA ops. Hence:
bit-exact RMSNorm on CPU when every sum is exact; bit-exact rotary and silu wherever the
rounded cos/sin/silu values of both sides agree (on CUDA everywhere); elsewhere the bounds
derived at each tolerance below (u: the unit roundoff 2^-p of the dtype).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module imports triton
pytest.importorskip("triton")

from prefixserve.model import fused  # noqa: E402
from prefixserve.model.fused import reference  # noqa: E402
from prefixserve.model.fused import triton as kernels  # noqa: E402
from prefixserve.model.layers import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
U32 = U[torch.float32]
HIDDEN = [576, 333]  # the embedded model's, and an odd one; both pad a power-of-2 block


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops: intra-op threads only spin against each other on a small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(dtype: torch.dtype) -> float:
    """The spacing of subnormals: absolute slack for results that underflow the relative bounds."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound) -> None:
    """|out - ref| <= bound elementwise (bound a tensor broadcasting to ref, or a float)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.double() - ref.double()).abs()
    excess = err - torch.as_tensor(bound, dtype=torch.float64, device=err.device)
    assert (excess <= 0).all(), f"{(excess > 0).sum().item()} elements past the bound, " \
                                f"worst by {excess.max().item():.3g}"


def assert_exact_where(out: torch.Tensor, ref: torch.Tensor, same: torch.Tensor, bound) -> None:
    """Bit-exact where `same` (both sides rounded the same transcendental values), else within
    bound. On CUDA `same` is everywhere: libdevice's functions are torch's there."""
    same = same.expand_as(ref)
    assert torch.equal(out[same], ref[same]), "differs where the rounded inputs agree"
    assert_within(out, ref, bound)


# --- RMSNorm -----------------------------------------------------------------------------------

def rms_inputs(tokens: int, hidden: int, dtype: torch.dtype, exact_sums: bool, seed: int):
    """x as a strided view (rows of a wider tensor), residual, weight. exact_sums: x and residual
    are k/8 with |k| <= 32, so x + residual is exact in every dtype and its squares are multiples
    of 1/64 below 64: every partial sum (below 2^16) is exact in fp32, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    if exact_sums:
        wide, residual = (torch.randint(-32, 33, (tokens, hidden + 8), generator=g) / 8
                          for _ in "xr")
    else:
        wide, residual = (torch.randn(tokens, hidden + 8, generator=g) * 3 for _ in "xr")
    weight = torch.randn(hidden, generator=g)
    x, residual, weight = (t.to(dtype).to(DEVICE) for t in (wide, residual, weight))
    return x[:, 3:3 + hidden], residual[:, :hidden].contiguous(), weight


def rms_bound(ref: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Sums of H nonnegative terms in two orders differ by <= 2(H - 1) u32 relative; the mean,
    sqrt and reciprocal round on each side (torch's CUDA mean and rsqrt: a few u32 more), and
    sqrt halves the rest: 1/rms differs by <= (H + 8) u32, v / rms (rounded in fp32) by
    (H + 10) u32. Rounding that to the dtype adds u on each side, and so does rounding its
    product with w: |out - ref| <= (4u + (H + 10) u32) |ref|."""
    rel = 4 * U[dtype] + (hidden + 10) * U32
    return rel * ref.double().abs() + 4 * tiny(dtype)


@pytest.mark.parametrize("add", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("exact_sums", [True, False], ids=["exact-sums", "random"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype, hidden, exact_sums, add):
    x, residual, weight = rms_inputs(5, hidden, dtype, exact_sums, seed=hidden)
    if add:
        out, new_residual = kernels.add_rms_norm(x, residual, weight, 1e-5)
        ref, ref_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(new_residual, ref_residual)  # one rounding of the same fp32 sum
    else:
        out, ref = kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5)
    if exact_sums and DEVICE.type == "cpu":
        assert torch.equal(out, ref)  # same fp32 mean; torch's CPU rsqrt is 1 / sqrt, each RN
    else:
        assert_within(out, ref, rms_bound(ref, hidden, dtype))


@pytest.mark.parametrize("exact_sums", [True, False], ids=["exact-sums", "random"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_matches_reference(dtype, hidden, exact_sums):
    """Gemma's (1 + w) norm, rounded once: the same bounds as `rms_bound` (one rounding fewer)."""
    x, _, weight = rms_inputs(5, hidden, dtype, exact_sums, seed=hidden + 1)
    out, ref = kernels.gemma_rms_norm(x, weight, 1e-6), reference.gemma_rms_norm(x, weight, 1e-6)
    if exact_sums and DEVICE.type == "cpu":
        assert torch.equal(out, ref)
    else:
        assert_within(out, ref, rms_bound(ref, hidden, dtype))


# --- rotary ------------------------------------------------------------------------------------

ROTARY_SHAPES = [(9, 3, 64), (4, 1, 80)]  # (Hq, Hkv, D): the embedded model's; half of D not 2^k


def qkv_views(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """qkv: [T, (Hq + 2 Hkv) D] as a fused projection returns it, and its q, k head views."""
    qkv = randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    return qkv, q.view(tokens, hq, d), k.view(tokens, hkv, d)


def rotary_bound(x: torch.Tensor, s: float, dtype: torch.dtype) -> torch.Tensor:
    """x: the input heads [T, H, D]; s: scaling. The two fp32 cos (sin) differ by <= 2.5 u32
    absolute (SLEEF within 1 ulp, numpy 1.5); times s, rounded in fp32 and then to the dtype, by
    <= (4.5 u32 + 2u) s. A product x_i * cos, rounded on each side, by <= (4.5 u32 + 4u) s |x_i|,
    and the sum of two, rounded, by <= (5 u32 + 6u) s (|x1| + |x2|), on both halves."""
    half = x.shape[-1] // 2
    x = x.double().abs()
    pair = x[..., :half] + x[..., half:]
    return (6 * U[dtype] + 5 * U32) * s * torch.cat((pair, pair), dim=-1) + 4 * tiny(dtype)


def cos_sin_agree(positions: torch.Tensor, inv_freq: torch.Tensor, s: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """[T, 1, D]: where the cos and sin the kernel rounds (numpy's in the interpreter; torch's,
    compiled) times s and rounded to the dtype, equal the reference's."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # fp32, as both compute them
    if DEVICE.type == "cuda":
        same = torch.ones_like(angles, dtype=torch.bool)
    else:
        same = ((torch.from_numpy(np.cos(angles.numpy())) * s).to(dtype)
                == (angles.cos() * s).to(dtype))
        same &= ((torch.from_numpy(np.sin(angles.numpy())) * s).to(dtype)
                 == (angles.sin() * s).to(dtype))
    return torch.cat((same, same), dim=-1)[:, None, :]


@pytest.mark.parametrize("scaling", [1.0, 1.2], ids=["plain", "yarn-scaled"])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("hq,hkv,d", ROTARY_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype, hq, hkv, d, pos_dtype, scaling):
    qkv, q, k = qkv_views(6, hq, hkv, d, dtype, seed=d)
    ref_qkv, ref_q, ref_k = qkv_views(6, hq, hkv, d, dtype, seed=d)
    x_q, x_k = q.clone(), k.clone()
    positions = torch.tensor([0, 1, 17, 1000, 32767, 131071], dtype=pos_dtype, device=DEVICE)
    # in the model's dtype, as Module.to(dtype) leaves it; the ops read it as fp32
    inv_freq = RotaryEmbedding(d, 10000.0, {}, 4096).inv_freq.to(dtype).to(DEVICE)
    kernels.apply_rotary_(q, k, positions, inv_freq, scaling)
    reference.apply_rotary_(ref_q, ref_k, positions, inv_freq, scaling)
    v_cols = slice((hq + hkv) * d, None)
    assert torch.equal(qkv[:, v_cols], ref_qkv[:, v_cols])  # v, between the views, untouched
    same = cos_sin_agree(positions, inv_freq, scaling, dtype)
    assert_exact_where(q, ref_q, same, rotary_bound(x_q, scaling, dtype))
    assert_exact_where(k, ref_k, same, rotary_bound(x_k, scaling, dtype))


# --- SiLU-and-multiply -------------------------------------------------------------------------

def silu_bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The two exps differ by <= 4.5 ulp (torch's CPU silu: SLEEF within 2, numpy within 2.5),
    i.e. 9 u32 relative, damped by e / (1 + e) <= 1; 1 + e and the division round once on each
    side (4 u32): silu(g) differs by <= 13 u32 relative. Rounded to the dtype it may flip one
    ulp (2u), and rounding its product with up adds u on each side: (4u + 13 u32) |ref|."""
    return (4 * U[dtype] + 13 * U32) * ref.double().abs() + 4 * tiny(dtype)


def silu_agrees(gate: torch.Tensor) -> torch.Tensor:
    """Where silu(gate) as the kernel computes it (numpy's exp in the interpreter; torch's,
    compiled), rounded to the dtype, equals torch's silu."""
    if DEVICE.type == "cuda":
        return torch.ones_like(gate, dtype=torch.bool)
    g = gate.float().numpy()
    with np.errstate(over="ignore"):
        mine = torch.from_numpy(g / (np.float32(1) + np.exp(-g)))
    return mine.to(gate.dtype) == torch.nn.functional.silu(gate)


@pytest.mark.parametrize("size", [1536, 333])  # the embedded model's intermediate size (2 blocks)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's, on purpose
def test_silu_mul_matches_reference(dtype, size):
    wide = randn(4, 2 * size + 8, dtype=dtype, seed=size, scale=4.0)
    wide[0, 8:14] = torch.tensor([-100.0, -88.0, -0.0, 0.0, 88.0, 100.0])  # exp over/underflow
    gate_up = wide[:, 8:]  # strided rows
    out, ref = kernels.silu_mul(gate_up), reference.silu_mul(gate_up)
    same = silu_agrees(gate_up[:, :size])
    assert_exact_where(out, ref, same, silu_bound(ref, dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_rows_do_not_depend_on_the_batch(dtype, threads):
    """Deterministic mode's CPU activations: each row as it is alone, for contiguous and strided
    rows, in runs past one thread's share; torch's own ops are not (the check would catch it)."""
    torch.set_num_threads(threads)
    wide = (torch.randn(400, 310, generator=torch.Generator().manual_seed(threads)) * 3).to(dtype)
    gelu = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    differs = 0
    for x in (wide[:, :300].contiguous(), wide[:, 5:301]):
        for fn in (gelu, torch.nn.functional.silu, torch.tanh):
            alone = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
            assert torch.equal(reference.rowwise(fn, x), alone)
            differs += not torch.equal(fn(x), alone)
    assert differs, "torch's ops were batch-invariant here: the test shows nothing"


# --- dispatch and CUDA graphs ------------------------------------------------------------------

def op_inputs(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """x, residual, weight, qkv, q, k, positions, inv_freq, gate_up (q, k: views of qkv)."""
    x, residual, weight = rms_inputs(3, 576, dtype, exact_sums=False, seed=seed)
    qkv, q, k = qkv_views(3, 9, 3, 64, dtype, seed=seed)
    positions = torch.arange(3, device=DEVICE) + 100 * seed
    inv_freq = RotaryEmbedding(64, 10000.0, {}, 4096).inv_freq.to(DEVICE)
    return [x, residual, weight, qkv, q, k, positions, inv_freq,
            randn(3, 3072, dtype=dtype, seed=seed)]


def run_all(ops, x, residual, weight, qkv, q, k, positions, inv_freq, gate_up):
    """Every op of a fused-ops module once -> their results (qkv after the in-place rotary)."""
    ops.apply_rotary_(q, k, positions, inv_freq, 1.0)
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    return [ops.rms_norm(x, weight, 1e-6), normed, summed, qkv.clone(), ops.silu_mul(gate_up)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_by_device(dtype):
    """CPU tensors run the reference (the exactness promise), CUDA tensors the kernels."""
    expected = kernels if DEVICE.type == "cuda" else reference
    got, want = run_all(fused, *op_inputs(dtype, 0)), run_all(expected, *op_inputs(dtype, 0))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_ops_replay_in_cuda_graphs():
    """Captured once, replayed on new values in the same buffers: the eager results."""
    static = op_inputs(torch.bfloat16, 0)
    run_all(kernels, *op_inputs(torch.bfloat16, 0))  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_all(kernels, *static)
    for buf, value in zip(static, op_inputs(torch.bfloat16, 1), strict=True):
        buf.copy_(value)
    graph.replay()
    eager = run_all(kernels, *op_inputs(torch.bfloat16, 1))
    assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))


def test_imports_and_runs_on_cpu_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, prefixserve.model.llama\n"
            "from prefixserve.model import fused\n"
            "x = torch.randn(2, 8)\n"
            "fused.add_rms_norm(fused.rms_norm(x, torch.ones(8), 1e-6), x, torch.ones(8), 1e-6)\n"
            "fused.silu_mul(x)\n"
            "q, k = torch.randn(2, 2, 4), torch.randn(2, 1, 4)\n"
            "fused.apply_rotary_(q, k, torch.arange(2), torch.ones(2), 1.0)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_rotary_inv_freq_stays_fp32_when_the_model_is_cast():
    from prefixserve.model.layers import RotaryEmbedding
    rotary = RotaryEmbedding(64, 10000.0, {}, 2048)
    before = rotary.inv_freq.clone()
    rotary.to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, before)
