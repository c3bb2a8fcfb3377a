"""prims_ts: task-scheduled attention kernels for LLM serving.

Every public function dispatches to ``torch.ops.prims_ts.*`` custom ops whose
CUDA kernels are compiled at run time through NVRTC; on CPU tensors the ops run
the pure-PyTorch reference (``prims_ts.reference``).
"""
from . import ops as _ops  # noqa: F401  (defines the ops)
from . import meta as _meta  # noqa: F401  (registers their fakes)
from .ops.prefill import BatchPrefillTSWrapper, batch_prefill
from .ops.decode import (
    BatchDecodePagedTSWrapper,
    batch_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_workspace_size,
    prims_ts_batch_decode_with_kv_cache,
)
from .ops.mla import (
    BatchMLADecodePagedTSWrapper,
    batch_decode_mla_with_paged_kv_cache,
    batch_mla_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_mla_workspace_size,
    prims_ts_batch_decode_with_kv_cache_mla,
)
from .ops.prefill_paged import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache
from .ops.block_sparse import (
    BlockSparsePagedTSWrapper,
    BlockSparseTSWrapper,
    block_sparse_attention,
    block_sparse_attention_with_paged_kv_cache,
)
from .cuda.keys import Tuning

__version__ = "0.1.0"

__all__ = [
    "batch_prefill",
    "BatchPrefillTSWrapper",
    "batch_prefill_with_paged_kv_cache",
    "BatchPrefillPagedTSWrapper",
    "prims_ts_batch_decode_with_kv_cache",
    "get_prims_ts_batch_decode_workspace_size",
    "BatchDecodePagedTSWrapper",
    "batch_decode_with_paged_kv_cache",
    "batch_mla_decode_with_paged_kv_cache",
    "batch_decode_mla_with_paged_kv_cache",
    "BatchMLADecodePagedTSWrapper",
    "prims_ts_batch_decode_with_kv_cache_mla",
    "get_prims_ts_batch_decode_mla_workspace_size",
    "block_sparse_attention",
    "BlockSparseTSWrapper",
    "block_sparse_attention_with_paged_kv_cache",
    "BlockSparsePagedTSWrapper",
    "Tuning",
    "__version__",
]
