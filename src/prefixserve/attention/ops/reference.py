"""PyTorch reference ops: the CPU path and the oracle for the Triton kernels in `ops/triton/`.

Every op here gets a Triton twin with the same signature, so signatures take tensors (plus a
few Python scalars that a kernel launcher also needs) and never host objects. Conventions:

    T  query rows of this step        Hq = G * Hkv query heads; query head h reads KV head h // G
    N  chunks in the pool, C slots    D  head dim
    I  work items, E kv entries       P  partial rows written by the items

Index tensors are int32 (positions, chunk ids, CSR offsets) except `slots`, which is int64.
Partials are fp32: `o` [*, Hq, D] and `lse` [*, Hq], the natural-log sum of exp(scaled scores).
A row that sees no key has o = 0 and lse = -inf, which the merge treats as an empty partial.

A work item (the unit a kernel program processes) pairs a contiguous range of query rows with
a list of kv entries, each a slot range of one chunk. Every schedule is a list of items:

    item i:  q rows  [item_q_start[i], item_q_start[i] + item_q_len[i])
             entries [item_kv_indptr[i], item_kv_indptr[i+1])
             writes partial rows [item_out_start[i], item_out_start[i] + item_q_len[i])
    entry e: slots [kv_lo[e], kv_hi[e]) of chunk kv_chunk[e]; slot kv_lo[e] holds position kv_pos[e]

Causality is by position alone: query row r sees key position p iff p <= q_pos[r], and with
a sliding `window` W (a sliding layer's) also p > q_pos[r] - W: the window is a per-row lower
bound on the key position, W keys including the row's own. The partials of one query row are
then merged by `merge_partials` (CSR: row -> partial rows).

fp8 caches (`--kv-cache-dtype fp8`): k_cache, v_cache hold float8_e4m3fn and every op that
touches them takes `kv_scale` [4, Hkv] fp32 (rows `K_SCALE`, `V_SCALE` dequantize, `K_INV`,
`V_INV` quantize; all powers of two, fixed per layer and KV head: `kvcache.scales`). A stored
value is q8 = e4m3(clamp(x * inv, +-448)) and reads back as q8 * scale. Since the scales are
powers of two, every product with them is exact: attention over the fp8 cache is attention
over the dequantized values, whether the scale multiplies the keys, the scores or the output.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
_ROW_BLOCK = 256  # query rows per product in attend_items: scores are [Hkv, 256 * G, L] fp32
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
K_SCALE, V_SCALE, K_INV, V_INV = range(4)  # rows of a layer's kv_scale [4, Hkv]


def quantize(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] (any float) -> e4m3 of x * inv (inv [Hkv] fp32), saturated at +-448."""
    return (x.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def kv_scales(kv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(K, V) dequantization scales [Hkv] of an fp8 layer's kv_scale, (None, None) otherwise."""
    return (None, None) if kv_scale is None else (kv_scale[K_SCALE], kv_scale[V_SCALE])


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values x [L, Hkv, D] as the attention reads them: x * scale [Hkv] in fp32 for an
    fp8 cache (exact), else x itself."""
    return x if scale is None else x.float() * scale[:, None]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Write new keys/values into their cache slots, in place.

    k_cache, v_cache: [N, C, Hkv, D] (contiguous); k, v: [T, Hkv, D];
    slots: [T] int64, flat slot chunk * C + offset; kv_scale: an fp8 cache's (module docstring).
    """
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.shape == v.shape and k.shape[1:] == k_cache.shape[2:] and slots.shape == k.shape[:1]
    assert (kv_scale is not None) == (k_cache.dtype == FP8), "an fp8 cache, and only it, has scales"
    if kv_scale is not None:  # index_copy_ has no fp8 kernel: copy the bytes
        k, v = (quantize(x, kv_scale[i]).view(torch.uint8) for x, i in ((k, K_INV), (v, V_INV)))
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float,
                      window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of n query rows over L gathered keys, as fp32 partials.

    q: [n, Hq, D]; k, v: [L, Hkv, D]; q_pos: [n]; k_pos: [L] (int32 or int64); window: None
    (causal) or W (causal, and key positions > q_pos - W).
    Returns o: [n, Hq, D] fp32, lse: [n, Hq] fp32.

    GQA: the G query heads of one KV head, for all n rows, form the rows of one matrix, so each
    KV head costs one [n*G, D] x [D, L] product; with n rows from many sequences over one shared
    K block this is RelayAttention's / Hydragen's batched product.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    assert hq % hkv == 0 and k.shape == v.shape and k.shape[2] == d
    g = hq // hkv
    qh = q.float().reshape(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
    scores = torch.bmm(qh, k.float().permute(1, 2, 0)) * scale  # [Hkv, n*G, L]
    visible = k_pos.long()[None, :] <= q_pos.long()[:, None]  # [n, L]
    if window is not None:
        visible &= k_pos.long()[None, :] > q_pos.long()[:, None] - window
    scores = scores.masked_fill(~visible.repeat_interleave(g, dim=0), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, n*G]; -inf where nothing is visible
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse[..., None])  # exactly 0 on masked keys
    o = torch.bmm(probs, v.float().permute(1, 0, 2))  # [Hkv, n*G, D]
    o = o.reshape(hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, hq, d)
    lse = lse.reshape(hkv, n, g).permute(1, 0, 2).reshape(n, hq)
    return o, lse


def _expand_entries(chunk_size: int, kv_chunk: torch.Tensor, kv_lo: torch.Tensor,
                    kv_hi: torch.Tensor, kv_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries -> per-key flat slots [K] int64, positions [K] int64, entry offsets [E+1] int64."""
    counts = (kv_hi - kv_lo).long()
    key_indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=key_indptr[1:])
    within = torch.arange(int(key_indptr[-1]), device=counts.device)
    within = within - torch.repeat_interleave(key_indptr[:-1], counts)
    slots = torch.repeat_interleave(kv_chunk.long() * chunk_size + kv_lo.long(), counts) + within
    pos = torch.repeat_interleave(kv_pos.long(), counts) + within
    return slots, pos, key_indptr


def attend_items(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_pos: torch.Tensor, item_q_start: torch.Tensor, item_q_len: torch.Tensor,
                 item_out_start: torch.Tensor, item_kv_indptr: torch.Tensor,
                 kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
                 kv_pos: torch.Tensor, scale: float, num_out_rows: int,
                 window: int | None = None,
                 kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All work items of a schedule (one kernel launch on GPU); see the module docstring.

    q: [T, Hq, D]; k_cache, v_cache: [N, C, Hkv, D]; q_pos: [T] int32;
    item_q_start, item_q_len, item_out_start: [I] int32; item_kv_indptr: [I+1] int32;
    kv_chunk, kv_lo, kv_hi, kv_pos: [E] int32 (0 <= kv_lo < kv_hi <= C); kv_scale: an fp8
    cache's [4, Hkv] (module docstring).
    Returns o: [num_out_rows, Hq, D] fp32, lse: [num_out_rows, Hq] fp32; partial rows no item
    writes stay (0, -inf).
    """
    hkv, d = k_cache.shape[2:]
    k_deq, v_deq = kv_scales(kv_scale)
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    slots, k_pos, key_indptr = _expand_entries(k_cache.shape[1], kv_chunk, kv_lo, kv_hi, kv_pos)
    key_bounds = key_indptr[item_kv_indptr.long()].tolist()  # [I+1]: item -> key range
    o = q.new_zeros((num_out_rows, *q.shape[1:]), dtype=torch.float32)
    lse = q.new_full((num_out_rows, q.shape[1]), NEG_INF, dtype=torch.float32)
    items = zip(item_q_start.tolist(), item_q_len.tolist(), item_out_start.tolist(), strict=True)
    for i, (qs, n, out) in enumerate(items):
        keys = slots[key_bounds[i]:key_bounds[i + 1]]
        k, v = dequantize(flat_k[keys], k_deq), dequantize(flat_v[keys], v_deq)
        pos = k_pos[key_bounds[i]:key_bounds[i + 1]]
        for r in range(0, n, _ROW_BLOCK):  # rows are independent; blocks bound the scores' size
            m = min(_ROW_BLOCK, n - r)
            o[out + r:out + r + m], lse[out + r:out + r + m] = partial_attention(
                q[qs + r:qs + r + m], k, v, q_pos[qs + r:qs + r + m], pos, scale, window)
    return o, lse


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, row_indptr: torch.Tensor,
                   row_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partials into T rows (CSR: row r merges partial rows
    row_parts[row_indptr[r]:row_indptr[r+1]]).

    o_parts: [P, Hq, D] fp32; lse_parts: [P, Hq] fp32; row_indptr: [T+1] int32;
    row_parts: [M] int32. Returns o: [T, Hq, D] fp32, lse: [T, Hq] fp32:
        m = max_i lse_i;  o = sum_i e^(lse_i - m) o_i / sum_i e^(lse_i - m);  lse = m + log(sum ...)
    -inf partials weigh 0; a row with no finite partial gets (0, -inf).
    """
    num_rows = row_indptr.numel() - 1
    counts = (row_indptr[1:] - row_indptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(num_rows, device=counts.device), counts)  # [M]
    parts = row_parts.long()
    lse_in, o_in = lse_parts[parts], o_parts[parts]
    m = lse_in.new_full((num_rows, lse_in.shape[1]), NEG_INF)
    m = m.scatter_reduce(0, rows[:, None].expand_as(lse_in), lse_in, "amax")
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # only -inf rows are inf
    w = torch.exp(lse_in - m[rows])  # [M, Hq]; 0 for -inf partials
    denom = torch.zeros_like(m).index_add_(0, rows, w)
    o = torch.zeros((num_rows, *o_in.shape[1:]), dtype=o_in.dtype, device=o_in.device)
    o.index_add_(0, rows, w[..., None] * o_in)
    # denom is 0 (no finite partial, o stays 0) or >= 1 (the max partial weighs exactly 1)
    return o / denom.clamp_min(1.0)[..., None], m + torch.log(denom)


# ---- deterministic mode (attention/cells.py): every item's keys lie in one cell -----------------
CELL_ROWS = 16  # query rows x G heads per product of attend_cells (fewer when G does not divide it)


def attend_cells(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_pos: torch.Tensor, item_q_start: torch.Tensor, item_q_len: torch.Tensor,
                 item_out_start: torch.Tensor, item_kv_indptr: torch.Tensor,
                 kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
                 kv_pos: torch.Tensor, scale: float, num_out_rows: int, cell: int,
                 window: int | None = None,
                 kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_items` of a cell schedule, with every (row, cell) partial computed on the same
    shapes whatever the item: a BLAS's sum order follows the shape (rows, keys), so a row's bits
    would depend on how many rows and keys it was batched with. Each item's keys go to their
    places in a [CELL] key block (absent keys: 0, at a position no row reaches), and its rows,
    R = CELL_ROWS // G at a time (the last block padded with rows that see nothing), go through
    `partial_attention`: one shape for every product of the model."""
    hkv, d = k_cache.shape[2:]
    hq = q.shape[1]
    rows = max(1, CELL_ROWS // (hq // hkv))
    k_deq, v_deq = kv_scales(kv_scale)
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    slots, k_pos, key_indptr = _expand_entries(k_cache.shape[1], kv_chunk, kv_lo, kv_hi, kv_pos)
    bounds = key_indptr[item_kv_indptr.long()].tolist()
    o = q.new_zeros((num_out_rows, hq, d), dtype=torch.float32)
    lse = q.new_full((num_out_rows, hq), NEG_INF, dtype=torch.float32)
    items = zip(item_q_start.tolist(), item_q_len.tolist(), item_out_start.tolist(), strict=True)
    for i, (qs, n, out) in enumerate(items):
        pos = k_pos[bounds[i]:bounds[i + 1]]
        base = int(pos[0]) // cell * cell
        assert int(pos[-1]) < base + cell, "an item of a cell schedule reads one cell"
        k = q.new_zeros((cell, hkv, d), dtype=q.dtype if kv_scale is None else torch.float32)
        v = torch.zeros_like(k)
        keys = slots[bounds[i]:bounds[i + 1]]
        k[pos - base], v[pos - base] = dequantize(flat_k[keys], k_deq), dequantize(flat_v[keys], v_deq)
        block_pos = torch.full((cell,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=q.device)
        block_pos[pos - base] = pos
        for r in range(0, n, rows):
            m = min(rows, n - r)
            qp = torch.full((rows,), -1, dtype=torch.int64, device=q.device)  # padding rows see no key
            qp[:m] = q_pos[qs + r:qs + r + m].long()
            qb = q.new_zeros((rows, hq, d))
            qb[:m] = q[qs + r:qs + r + m]
            ob, lb = partial_attention(qb, k, v, qp, block_pos, scale, window)
            o[out + r:out + r + m], lse[out + r:out + r + m] = ob[:m], lb[:m]
    return o, lse


def merge_in_order(o_parts: torch.Tensor, lse_parts: torch.Tensor, row_indptr: torch.Tensor,
                   row_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_partials` with each row's partials folded in in CSR order, one at a time (the
    Triton merge's online form and order): the result's bits depend on that order only.

        m' = max(m, lse_i);  acc = acc e^(m - m') + e^(lse_i - m') o_i;  den = den e^(m - m') + e^(lse_i - m')
    """
    num_rows = row_indptr.numel() - 1
    counts = (row_indptr[1:] - row_indptr[:-1]).long()
    hq, d = o_parts.shape[1:]
    m = o_parts.new_full((num_rows, hq), NEG_INF)
    den = o_parts.new_zeros((num_rows, hq))
    acc = o_parts.new_zeros((num_rows, hq, d))
    for j in range(int(counts.max()) if num_rows else 0):
        has = counts > j  # rows with a j-th partial
        part = row_parts.long()[row_indptr[:-1].long()[has] + j]
        lse_j, o_j = lse_parts[part], o_parts[part]
        m_new = torch.maximum(m[has], lse_j)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha, w = torch.exp(m[has] - m_safe), torch.exp(lse_j - m_safe)
        acc[has] = acc[has] * alpha[..., None] + w[..., None] * o_j
        den[has] = den[has] * alpha + w
        m[has] = m_new
    seen = den > 0
    o = acc / torch.where(seen, den, 1.0)[..., None]
    return o, torch.where(seen, m + torch.log(torch.where(seen, den, 1.0)), NEG_INF)
