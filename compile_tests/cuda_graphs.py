"""CUDA-graph helpers shared by the compile test files.

The graph tests also run on the CPU, where no graph exists: ``warm_and_capture`` then runs the
call once and returns an :class:`EagerReplay` whose ``replay()`` runs the same call again (the
same wrapper, the same live metadata tensors, the same output), so every step of a test (setup,
metadata rewrites, references, assertions) executes on a machine without a GPU; only the
capture itself, and the no-allocation / no-sync check, are CUDA's.
"""
import torch

from prims_ts.testing import rel_err


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


class EagerReplay:
    """A CPU stand-in for a captured graph: ``replay()`` calls ``fn`` eagerly."""

    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


def warm_and_capture(fn, device="cuda"):
    """Warm once on a side stream (compiles and loads the kernel), then capture fn into a graph.
    Off CUDA: one eager call, and an EagerReplay of fn."""
    if not is_cuda(device):
        fn()
        return EagerReplay(fn)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def synchronize(device="cuda"):
    if is_cuda(device):
        torch.cuda.synchronize()


def assert_no_allocation_no_sync(fn, device="cuda"):
    """A warmed run with out= given neither allocates device memory nor synchronises with the host
    (off CUDA: fn runs once, unchecked; there is no device memory or stream to watch)."""
    if not is_cuda(device):
        fn()
        return
    torch.cuda.synchronize()
    n0 = torch.cuda.memory_stats()["allocation.all.allocated"]
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == n0, "run(out=...) allocated device memory"


def check_standalone_replays(launch, out, pb, data, new_data, steps, packed, reference, tol, device, seed):
    """A standalone call's graph over metadata rewritten in place: capture `launch` (one call into
    `out`), check the warm call and a replay against `reference()`; then before each further
    replay rewrite `pb`'s metadata (``pb.rewrite_metadata(lengths, g, query counts if packed)``
    for each (lengths, query counts) of `steps`) and copy `new_data` into `data` (the cache):
    the whole output and each request's rows (``pb.rows(b)``: a short request must not hide
    behind a long one) must match the new reference, which must differ from the first."""
    graph = warm_and_capture(launch, device)
    assert_no_allocation_no_sync(launch, device)
    assert rel_err(out, reference()) <= tol
    out.fill_(float("nan"))
    graph.replay()
    synchronize(device)
    first = reference()
    assert rel_err(out, first) <= tol
    g = torch.Generator().manual_seed(seed)
    for new_lens, new_q in steps:
        pb.rewrite_metadata(new_lens, g, new_q if packed else None)
        data.copy_(new_data)
        out.fill_(float("nan"))
        graph.replay()
        synchronize(device)
        ref = reference()
        assert rel_err(first.float(), ref) > 0.1
        assert rel_err(out, ref) <= tol, (new_lens, new_q)
        for b in range(len(new_lens)):
            s = pb.rows(b)
            assert rel_err(out[s], ref[s]) <= tol, (b, new_lens)
