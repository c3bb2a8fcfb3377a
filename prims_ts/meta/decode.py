"""Fakes of prims_ts::batch_decode and prims_ts::batch_decode_out."""
from typing import Optional

import torch

from ..ops._validate import code_dtype


@torch.library.register_fake("prims_ts::batch_decode")
def _batch_decode_fake(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    workspace: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    seq_len_q: int,
    max_seq_len_q: int,
    max_seq_len: int,
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    return torch.empty(query.shape, dtype=code_dtype(out_dtype), device=query.device)


@torch.library.register_fake("prims_ts::batch_decode_out")
def _batch_decode_out_fake(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr,
                           seq_len_q, max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale,
                           output_scale, tuning="") -> None:
    return None
