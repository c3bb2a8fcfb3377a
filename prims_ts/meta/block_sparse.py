"""Fakes of prims_ts::block_sparse_attention{,_out} (paged) and
prims_ts::block_sparse_attention_contiguous{,_out}."""
from typing import Optional

import torch

from ..ops._validate import code_dtype


@torch.library.register_fake("prims_ts::block_sparse_attention")
def _block_sparse_attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    valid_bits: Optional[torch.Tensor],
    q_block_size: int,
    kv_block_size: int,
    mask_type: str,
    sm_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=code_dtype(out_dtype), device=q.device)


@torch.library.register_fake("prims_ts::block_sparse_attention_out")
def _block_sparse_attention_out_fake(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices,
                                     seq_lens, valid_bits, q_block_size, kv_block_size, mask_type, sm_scale,
                                     tuning="") -> None:
    return None


@torch.library.register_fake("prims_ts::block_sparse_attention_contiguous")
def _block_sparse_attention_contiguous_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    valid_bits: Optional[torch.Tensor],
    q_block_size: int,
    kv_block_size: int,
    mask_type: str,
    sm_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=code_dtype(out_dtype), device=q.device)


@torch.library.register_fake("prims_ts::block_sparse_attention_contiguous_out")
def _block_sparse_attention_contiguous_out_fake(q, k, v, out, block_indptr, block_indices, valid_bits, q_block_size,
                                                kv_block_size, mask_type, sm_scale, tuning="") -> None:
    return None
