"""Public functions, wrappers and torch.library op definitions, one module per API family."""
from .prefill import BatchPrefillTSWrapper, batch_prefill  # noqa: F401
from .prefill_paged import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache  # noqa: F401
