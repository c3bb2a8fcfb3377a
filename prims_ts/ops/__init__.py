"""Public functions, wrappers and torch.library op definitions, one module per API family."""
from .prefill import BatchPrefillTSWrapper, batch_prefill  # noqa: F401
