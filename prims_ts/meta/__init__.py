"""Fake (meta) implementations of every prims_ts op: shapes and dtypes only.

They never read tensor data, so torch.compile, torch.export and AOTInductor can
trace the ops with fake tensors.
"""
from . import block_sparse, decode, mla, prefill, prefill_paged  # noqa: F401
