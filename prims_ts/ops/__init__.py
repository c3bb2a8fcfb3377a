"""Public functions, wrappers and torch.library op definitions, one module per API family."""
from .prefill import BatchPrefillTSWrapper, batch_prefill  # noqa: F401
from .prefill_paged import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache  # noqa: F401
from .decode import (  # noqa: F401
    BatchDecodePagedTSWrapper,
    batch_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_workspace_size,
    prims_ts_batch_decode_with_kv_cache,
)
from .mla import (  # noqa: F401
    BatchMLADecodePagedTSWrapper,
    batch_decode_mla_with_paged_kv_cache,
    batch_mla_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_mla_workspace_size,
    prims_ts_batch_decode_with_kv_cache_mla,
)
from .block_sparse import (  # noqa: F401
    BlockSparsePagedTSWrapper,
    BlockSparseTSWrapper,
    block_sparse_attention,
    block_sparse_attention_with_paged_kv_cache,
)
