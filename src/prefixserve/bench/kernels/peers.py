"""The peers of `prefixserve bench kernels`, measured in the same run as our backends.

    sdpa                 PyTorch FlashAttention on dense per-sequence K/V: SDPA forced to
                         SDPBackend.FLASH_ATTENTION (`sdpa_backend` says which ran; where
                         FlashAttention cannot run the shape, PyTorch's own pick, with a note).
                         GQA: a sequence's G query heads per KV head are G query rows. Rows whose
                         dense K/V exceed DENSE_CAP_BYTES run on a prefix of the batch, scaled up
                         linearly (`scaled`).
    hydragen-pub         Hydragen as published: each shared level attended by the queries of all
                         sequences below each node (heads folded into rows), the private tail
                         per sequence, through FlashAttention-2 with LSE
                         (aten._scaled_dot_product_flash_attention), merged by LSE in PyTorch.
    hydragen-cudnn       the same algorithm on cuDNN's LSE attention op (a stronger peer than the
                         issue names: reported beside it, never instead of it).
    hydragen-efficient   the same on the memory-efficient op (kept for completeness).
    flashinfer-decode    FlashInfer paged decode and multi-level cascade over the very same chunk
    flashinfer-cascade   pool (flashinfer.py), where `import flashinfer` works.

PEERS are the issue's peers (the bars); ALL_PEERS adds the two extra Hydragen ops, so the
speedups against every peer measured are reported too. Each peer's output is checked against
the paged backend's; only a peer whose error is under ERR_TOL (`counted`) is compared.
"""

from __future__ import annotations

import torch

from .flashinfer import flashinfer_peers
from .rows import Row
from .timing import measure_call

PEERS = ("sdpa", "hydragen-pub", "flashinfer-decode", "flashinfer-cascade")
ALL_PEERS = PEERS + ("hydragen-cudnn", "hydragen-efficient")
HYDRAGEN_OPS = {"hydragen-pub": "flash", "hydragen-cudnn": "cudnn", "hydragen-efficient": "efficient"}
DENSE_CAP_BYTES = 12 << 30  # dense per-sequence K+V of the sdpa peer
_FAILURES = (RuntimeError, NotImplementedError, ValueError, torch.OutOfMemoryError)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: " + str(e).split("\n")[0][:200]


def _dense(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather [..., L] slots of a [N, C, Hkv, D] cache into contiguous [..., Hkv, L, D]."""
    flat = cache.view(-1, *cache.shape[2:])[slots.reshape(-1).to(cache.device)]
    x = flat.view(*slots.shape, *cache.shape[2:])  # [..., L, Hkv, D]
    return x.transpose(-3, -2).contiguous()


# ---------------------------------------------------------------- sdpa

def _sdpa_backend(q, k, v, scale: float):
    """(SDPBackend, note): FlashAttention where it can run these inputs, else PyTorch's pick.
    torch._fused_sdp_choice is the dispatcher's own choice under the enabled backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch._fused_sdp_choice(q, k, v, scale=scale)
        return SDPBackend.FLASH_ATTENTION, {}
    except RuntimeError as e:
        chosen = SDPBackend(torch._fused_sdp_choice(q, k, v, scale=scale))
        return chosen, {"note": f"FlashAttention cannot run this shape ({_reason(e)}); "
                                f"PyTorch's dispatch picked {chosen.name}"}


def sdpa_peer(row: Row):
    """(fn, scale factor, info): SDPA per sequence on dense K/V (a batch prefix if too big)."""
    from torch.nn.attention import sdpa_kernel
    w, b = row.w, row.w.batch
    per_seq = 2 * (w.context + 1) * w.kv_heads * w.head_dim * row.q.element_size()
    b_run = max(1, min(b, DENSE_CAP_BYTES // per_seq))
    slots = torch.cat([*(torch.stack([lv[i * len(lv) // b] for i in range(b_run)])
                         for lv in row.level_slots), row.private_slots[:b_run]], dim=1)
    kd, vd = _dense(row.k_cache, slots), _dense(row.v_cache, slots)
    q = row.q[:b_run].view(b_run, w.kv_heads, w.heads // w.kv_heads, w.head_dim)
    backend, info = _sdpa_backend(q, kd, vd, row.shape.scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        with sdpa_kernel(backend):
            return sdpa(q, kd, vd, scale=row.shape.scale).view(b_run, w.heads, w.head_dim)
    return run, b / b_run, {"sdpa_backend": backend.name, **info}


def measure_sdpa(row: Row, device: torch.device, ref: torch.Tensor) -> dict:
    try:
        fn, factor, info = sdpa_peer(row)
        return {**measure_call(fn, device, ref, row.vmax, factor), "scaled": factor != 1, **info}
    except _FAILURES as e:
        return {"error": _reason(e)}


# ---------------------------------------------------------------- hydragen

def lse_op(name: str, device: torch.device):
    """An aten attention op returning (out [B,H,M,D], lse [B,H,M] fp32) by variant name.
    On a CPU only FlashAttention exists (its CPU kernel): the others raise."""
    aten = torch.ops.aten
    if device.type != "cuda":
        if name != "flash":
            raise NotImplementedError(f"aten's {name} attention op runs on CUDA only")
        return lambda q, k, v, scale: aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, scale=scale)

    def flash(q, k, v, scale):
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]

    def cudnn(q, k, v, scale):
        o, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                          scale=scale)[:2]
        return o, lse.reshape(q.shape[:3])

    def efficient(q, k, v, scale):
        o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                              scale=scale)[:2]
        return o, lse[..., :q.shape[2]]
    return {"flash": flash, "cudnn": cudnn, "efficient": efficient}[name]


def hydragen_peer(row: Row, attn):
    """Hydragen as published: per shared level one batched attention (with LSE) of the queries
    below each node; the suffix per sequence; an LSE merge in PyTorch."""
    w, b = row.w, row.w.batch
    g, d, hkv = w.heads // w.kv_heads, w.head_dim, w.kv_heads
    levels = [(len(lv), _dense(row.k_cache, torch.stack(lv)), _dense(row.v_cache, torch.stack(lv)))
              for lv in row.level_slots]
    kp, vp = _dense(row.k_cache, row.private_slots), _dense(row.v_cache, row.private_slots)
    scale, q = row.shape.scale, row.q

    def run():
        outs, lses = [], []
        for n, kd, vd in levels:  # queries of node j's b/n sequences x G heads as rows
            ql = q.view(n, b // n, hkv, g, d).transpose(1, 2).reshape(n, hkv, b // n * g, d)
            o, lse = attn(ql, kd, vd, scale)
            outs.append(o.view(n, hkv, b // n, g, d).transpose(1, 2).reshape(b, w.heads, d))
            lses.append(lse.view(n, hkv, b // n, g).transpose(1, 2).reshape(b, w.heads))
        o, lse = attn(q.view(b, hkv, g, d), kp, vp, scale)
        outs.append(o.reshape(b, w.heads, d))
        lses.append(lse.reshape(b, w.heads))
        lse_all = torch.stack(lses)  # [levels + 1, b, Hq]
        wts = torch.exp(lse_all - lse_all.amax(0))
        return ((torch.stack(outs).float() * wts[..., None]).sum(0)
                / wts.sum(0)[..., None]).to(q.dtype)
    return run


def measure_hydragen(row: Row, device: torch.device, ref: torch.Tensor) -> dict:
    """hydragen-pub / -cudnn / -efficient: one entry per LSE op, each with its `op`."""
    peers = {}
    for peer, op in HYDRAGEN_OPS.items():
        try:
            peers[peer] = {**measure_call(hydragen_peer(row, lse_op(op, device)), device, ref,
                                          row.vmax), "op": op}
        except _FAILURES as e:
            peers[peer] = {"error": _reason(e), "op": op}
    return peers


def measure_peers(row: Row, device: torch.device, ref: torch.Tensor) -> dict:
    """Every peer of ALL_PEERS: a measured entry (us, max_err_vs_paged, counted, timing) or
    an entry with the `error` that kept it from running (an fp8 row: FlashInfer's only)."""
    if row.kv_scale is not None:
        why = {"error": "reads 16-bit K/V only (no fp8 cache path)"}
        return {"sdpa": why, **{p: why for p in HYDRAGEN_OPS}, **flashinfer_peers(row, device, ref)}
    return {"sdpa": measure_sdpa(row, device, ref), **measure_hydragen(row, device, ref),
            **flashinfer_peers(row, device, ref)}
