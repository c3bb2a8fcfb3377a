"""Fakes of prims_ts::batch_prefill and prims_ts::batch_prefill_out."""
from typing import Optional

import torch

from ..ops._validate import code_dtype


@torch.library.register_fake("prims_ts::batch_prefill")
def _batch_prefill_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    kv_indptr: Optional[torch.Tensor],
    window_starts: Optional[torch.Tensor],
    window_ends: Optional[torch.Tensor],
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


@torch.library.register_fake("prims_ts::batch_prefill_out")
def _batch_prefill_out_fake(q, k, v, out, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type,
                            window_left, sm_scale, output_scale, max_q_len, tuning="") -> None:
    return None
