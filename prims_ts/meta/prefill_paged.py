"""Fakes of prims_ts::batch_prefill_paged and prims_ts::batch_prefill_paged_out."""
from typing import Optional

import torch

from ..ops._validate import code_dtype


@torch.library.register_fake("prims_ts::batch_prefill_paged")
def _batch_prefill_paged_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    work: Optional[torch.Tensor],
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=code_dtype(out_dtype), device=q.device)


@torch.library.register_fake("prims_ts::batch_prefill_paged_out")
def _batch_prefill_paged_out_fake(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type,
                                  window_left, sm_scale, output_scale, max_q_len, tuning="") -> None:
    return None
