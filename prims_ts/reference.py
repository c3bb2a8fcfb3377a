"""Pure-PyTorch semantics of every prims_ts API.

These functions are the CPU kernels of the custom ops and the oracle of the tests
(call them with ``compute_dtype=torch.float64``). They are written for clarity, one
request at a time; they never read anything the CUDA kernels would not.

Mask rules (row ``i`` of a request with ``sq`` queries and ``sk`` keys):

* ``dense``: keys ``0 .. sk-1``;
* ``causal`` (bottom-right aligned): keys ``j <= sk - sq + i``;
* ``window_left = w >= 0`` (with causal): additionally ``j >= sk - sq + i - w``;
* ``variable_window``: ``starts[i] <= j <= ends[i]``.

A row that sees no key writes zeros.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

MASK_TYPES = ("dense", "causal", "variable_window")


def visible_keys(
    sq: int,
    sk: int,
    mask_type: str,
    window_left: int = -1,
    starts: Optional[torch.Tensor] = None,
    ends: Optional[torch.Tensor] = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean ``[sq, sk]`` matrix: which key each query row may attend to."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    if mask_type == "dense":
        vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    elif mask_type == "causal":
        diag = sk - sq + i
        vis = j <= diag
        if window_left >= 0:
            vis = vis & (j >= diag - window_left)
    elif mask_type == "variable_window":
        assert starts is not None and ends is not None
        vis = (j >= starts.to(device).long().unsqueeze(1)) & (j <= ends.to(device).long().unsqueeze(1))
    else:
        raise ValueError(f"mask_type: unknown mask {mask_type!r}")
    return vis


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    output_scale: float,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """One request: q ``[sq, hq, d]``, k ``[sk, hkv, dk]``, v ``[sk, hkv, dv]``.

    Returns ``[sq, hq, dv]`` in ``compute_dtype``. Rows with no visible key are zero.
    """
    sq, hq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qc = q.to(compute_dtype).permute(1, 0, 2)  # [hq, sq, d]
    kc = k.to(compute_dtype).permute(1, 0, 2).repeat_interleave(group, dim=0)  # [hq, sk, d]
    vc = v.to(compute_dtype).permute(1, 0, 2).repeat_interleave(group, dim=0)
    s = torch.matmul(qc, kc.transpose(1, 2)) * sm_scale  # [hq, sq, sk]
    s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
    row_has_key = visible.any(dim=1)  # [sq]
    m = s.amax(dim=2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=2, keepdim=True)
    o = torch.matmul(p, vc) / torch.where(l > 0, l, torch.ones_like(l))
    o = o * output_scale
    o = o * row_has_key.view(1, sq, 1).to(compute_dtype)
    return o.permute(1, 0, 2)


def batch_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    kv_indptr: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    window_left: int = -1,
    window_starts: Optional[torch.Tensor] = None,
    window_ends: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    output_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Contiguous prefill (SPEC §1): fixed ``[B, S, H, D]`` or packed ``[T, H, D]``.

    Returns the output in ``compute_dtype`` with q's leading shape.
    """
    d = q.shape[-1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    packed = qo_indptr is not None
    if packed:
        qo = [int(x) for x in qo_indptr.tolist()]
        kvo = [int(x) for x in kv_indptr.tolist()]
        out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
        for b in range(len(qo) - 1):
            qb, kb, vb = q[qo[b]:qo[b + 1]], k[kvo[b]:kvo[b + 1]], v[kvo[b]:kvo[b + 1]]
            vis = visible_keys(qb.shape[0], kb.shape[0], mask_type, window_left, device=q.device)
            out[qo[b]:qo[b + 1]] = attend(qb, kb, vb, vis, sm_scale, output_scale, compute_dtype)
        return out
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    for b in range(q.shape[0]):
        starts = window_starts[b] if window_starts is not None else None
        ends = window_ends[b] if window_ends is not None else None
        vis = visible_keys(q.shape[1], k.shape[1], mask_type, window_left, starts, ends, device=q.device)
        out[b] = attend(q[b], k[b], v[b], vis, sm_scale, output_scale, compute_dtype)
    return out


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Logical rows ``0 .. length-1`` of one request from an HND pool ``[P, H, ps, D]``: ``[length, H, D]``."""
    rows = cache[pages.long()]  # [n, H, ps, D]
    return rows.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:length]


def batch_prefill_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask_type: str = "dense",
    window_left: int = -1,
    sm_scale: Optional[float] = None,
    output_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed Q ``[T, Hq, D]`` over HND page pools (SPEC §2). Returns ``[T, Hq, D]`` in ``compute_dtype``."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    ps = k_cache.shape[2]
    qo = [int(x) for x in qo_indptr.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    for b in range(len(qo) - 1):
        sk = lens[b]
        pages = block_tables[b, : (sk + ps - 1) // ps].to(k_cache.device)
        kb, vb = gather_pages(k_cache, pages, sk), gather_pages(v_cache, pages, sk)
        qb = q[qo[b]:qo[b + 1]]
        vis = visible_keys(qb.shape[0], sk, mask_type, window_left, device=q.device)
        out[qo[b]:qo[b + 1]] = attend(qb, kb, vb, vis, sm_scale, output_scale, compute_dtype)
    return out


def batch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    window_left: int = -1,
    sm_scale: Optional[float] = None,
    output_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode over CSR pages (SPEC §3). ``query``: ``[B, Hq, D]``, ``[B, SQ, Hq, D]`` or packed
    ``[T, Hq, D]`` with ``qo_indptr``; pools ``[P, Hkv, ps, D]``. Returns query's shape."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(query.shape[-1])
    ps = k_cache.shape[2]
    indptr = [int(x) for x in paged_kv_indptr.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    if qo_indptr is not None:
        qo = [int(x) for x in qo_indptr.tolist()]
        rows = [(slice(qo[b], qo[b + 1]),) for b in range(len(qo) - 1)]
    elif query.dim() == 3:
        rows = [(slice(b, b + 1),) for b in range(query.shape[0])]
    else:
        rows = [(b,) for b in range(query.shape[0])]
    for b, sel in enumerate(rows):
        sk = lens[b]
        pages = paged_kv_indices[indptr[b]: indptr[b] + (sk + ps - 1) // ps].to(k_cache.device)
        kb, vb = gather_pages(k_cache, pages, sk), gather_pages(v_cache, pages, sk)
        qb = query[sel]
        vis = visible_keys(qb.shape[0], sk, mask_type, window_left, device=query.device)
        out[sel] = attend(qb, kb, vb, vis, sm_scale, output_scale, compute_dtype)
    return out


MLA_DIM_QK = 576  # kv_lora_rank (512) + qk_rope_head_dim (64)
MLA_DIM_V = 512  # kv_lora_rank


def batch_mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    mask_type: str = "causal",
    sm_scale: float = 1.0,
    output_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """MLA decode over a paged latent cache (SPEC §4).

    ``query``: fixed ``[B, SQ, H, 576]`` or packed ``[T, H, 576]`` with ``qo_indptr``.
    ``kv_cache``: ``[P, page_size, 576]`` or ``[P, 1, page_size, 576]``: one latent row per
    token, shared by all H heads; K is the whole 576-wide row, V its first 512 values.
    Request ``b``'s pages are ``block_tables[b, :ceil(seq_lens[b] / page_size)]``.
    Returns ``query.shape[:-1] + (512,)`` in ``compute_dtype``; memory is O(H * SQ * Sk) per
    request (the latent row is never repeated per head).
    """
    cache = kv_cache[:, 0] if kv_cache.dim() == 4 else kv_cache  # [P, ps, 576]
    ps = cache.shape[1]
    lens = [int(x) for x in seq_lens.tolist()]
    out = torch.zeros(tuple(query.shape[:-1]) + (MLA_DIM_V,), dtype=compute_dtype, device=query.device)
    if qo_indptr is not None:
        qo = [int(x) for x in qo_indptr.tolist()]
        rows = [slice(qo[b], qo[b + 1]) for b in range(len(qo) - 1)]
    else:
        rows = list(range(query.shape[0]))
    for b, sel in enumerate(rows):
        sk = lens[b]
        pages = block_tables[b, : (sk + ps - 1) // ps].to(cache.device).long()
        kv = cache[pages].reshape(-1, cache.shape[-1])[:sk].to(compute_dtype)  # [sk, 576]
        qb = query[sel].to(compute_dtype)  # [sq, H, 576]
        sq = qb.shape[0]
        vis = visible_keys(sq, sk, mask_type, device=query.device)  # [sq, sk]
        s = torch.einsum("qhd,kd->hqk", qb, kv) * sm_scale  # [H, sq, sk]
        s = s.masked_fill(~vis.unsqueeze(0), float("-inf"))
        m = s.amax(dim=2, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        l = p.sum(dim=2, keepdim=True)
        o = torch.matmul(p, kv[:, :MLA_DIM_V]) / torch.where(l > 0, l, torch.ones_like(l))  # [H, sq, 512]
        o = o * output_scale * vis.any(dim=1).view(1, sq, 1).to(compute_dtype)
        out[sel] = o.permute(1, 0, 2)
    return out


def valid_bit_mask(words: torch.Tensor, sk: int) -> torch.Tensor:
    """Keys ``0 .. sk-1`` of one request's ``kv_valid_bits`` row (uint32 or int32 words):
    key ``j`` is valid when bit ``j % 32`` of word ``j // 32`` is set."""
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(sk, device=words.device)
    return ((w[j // 32] >> (j % 32)) & 1).bool()


def block_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    q_block_size: int,
    kv_block_size: int,
    seq_lens_kv: torch.Tensor,
    *,
    kv_valid_bits: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    sm_scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """BSR block-sparse attention over CSR pages (SPEC §5). ``q``: ``[B, Sq, Hq, D]``; pools
    ``[P, Hkv, ps, D]``; route row r of (request b, K/V head h) — query tokens
    ``[r * q_block_size, (r + 1) * q_block_size)`` of h's query heads — sees the keys of the
    blocks ``block_indices[block_indptr[b, h, r]:block_indptr[b, h, r + 1]]`` (block c: keys
    ``[c * kv_block_size, (c + 1) * kv_block_size)``), intersected with the mask and the
    valid bits. Returns ``[B, Sq, Hq, D]``; a row with no visible key is zero."""
    batch, sq, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    ps = k_cache.shape[2]
    indptr = [int(x) for x in paged_kv_indptr.tolist()]
    lens = [int(x) for x in seq_lens_kv.tolist()]
    bptr = block_indptr.to("cpu", torch.int64)
    blocks = block_indices.to("cpu", torch.int64)
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    for b in range(batch):
        sk = lens[b]
        pages = paged_kv_indices[indptr[b]: indptr[b] + (sk + ps - 1) // ps].to(k_cache.device)
        kb, vb = gather_pages(k_cache, pages, sk), gather_pages(v_cache, pages, sk)
        base = visible_keys(sq, sk, mask_type, device=q.device)
        if kv_valid_bits is not None:
            base = base & valid_bit_mask(kv_valid_bits[b], sk).unsqueeze(0)
        for h in range(hkv):
            routes = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
            for r in range(bptr.shape[2] - 1):
                t0, t1 = r * q_block_size, min(sq, (r + 1) * q_block_size)
                for c in blocks[int(bptr[b, h, r]): int(bptr[b, h, r + 1])].tolist():
                    routes[t0:t1, c * kv_block_size: min(sk, (c + 1) * kv_block_size)] = True
            heads = slice(h * group, (h + 1) * group)
            out[b, :, heads] = attend(q[b, :, heads], kb[:, h: h + 1], vb[:, h: h + 1], base & routes, sm_scale, 1.0,
                                      compute_dtype)
    return out


def block_sparse_attention_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    q_block_size: int,
    kv_block_size: int,
    *,
    kv_valid_bits: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    sm_scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """BSR block-sparse attention over contiguous K/V ``[B, Skv, Hkv, D]``: the paged form
    (``block_sparse_attention``) over identity pages, one page of Skv slots per request (the
    pools ``[B, Hkv, Skv, D]`` are K and V transposed), every request Skv keys long."""
    batch, skv = k.shape[:2]
    ids = torch.arange(batch, dtype=torch.int32)
    return block_sparse_attention(q, k.transpose(1, 2), v.transpose(1, 2), torch.arange(batch + 1, dtype=torch.int32),
                                  ids, block_indptr, block_indices, q_block_size, kv_block_size,
                                  torch.full((batch,), skv, dtype=torch.int32), kv_valid_bits=kv_valid_bits,
                                  mask_type=mask_type, sm_scale=sm_scale, compute_dtype=compute_dtype)
