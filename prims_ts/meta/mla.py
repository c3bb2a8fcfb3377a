"""Fakes of prims_ts::batch_mla_decode and prims_ts::batch_mla_decode_out."""
from typing import Optional

import torch

from ..ops._validate import code_dtype

MLA_DIM_V = 512


@torch.library.register_fake("prims_ts::batch_mla_decode")
def _batch_mla_decode_fake(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    max_seq_len_q: int,
    max_seq_len: int,
    mask_type: str,
    sm_scale: float,
    output_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    return torch.empty(tuple(query.shape[:-1]) + (MLA_DIM_V,), dtype=code_dtype(out_dtype), device=query.device)


@torch.library.register_fake("prims_ts::batch_mla_decode_out")
def _batch_mla_decode_out_fake(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q,
                               max_seq_len, mask_type, sm_scale, output_scale, tuning="") -> None:
    return None
