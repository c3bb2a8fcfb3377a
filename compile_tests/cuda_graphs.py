"""CUDA-graph helpers shared by the compile test files.

The graph tests also run on the CPU, where no graph exists: ``warm_and_capture`` then runs the
call once and returns an :class:`EagerReplay` whose ``replay()`` runs the same call again (the
same wrapper, the same live metadata tensors, the same output), so every step of a test (setup,
metadata rewrites, references, assertions) executes on a machine without a GPU; only the
capture itself, and the no-allocation / no-sync check, are CUDA's.
"""
import torch


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
