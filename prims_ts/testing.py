"""Accuracy helpers shared by the self-check, the benchmarks and the test suites.

The project's accuracy rule: ‖out − ref‖ / ‖ref‖ against a float64 reference, at most
``TOLERANCE[input dtype]``; NaN or Inf in the output never passes.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Iterator, List, Optional, Sequence
from unittest import mock

import torch

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN/Inf anywhere in ``out`` gives NaN (never passes)."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} differs from the reference's {tuple(r.shape)}")
    if not bool(torch.isfinite(o).all()):
        return float("nan")
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``relative_error`` for tests: fails outright on NaN/Inf (an unwritten element, a poisoned
    slot read, or bad math) instead of returning NaN."""
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element, a poisoned slot read, or bad math)"
    assert torch.isfinite(out).all(), "Inf in the output"
    return relative_error(out, ref)


def stable_seed(*parts) -> int:
    """A seed that is stable across processes (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def cumsum0(xs: Sequence[int]) -> List[int]:
    """Offsets ``[0, x0, x0+x1, ...]`` of a list of lengths (an indptr)."""
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def assert_opcheck_passed(result, names=OPCHECK_TESTS) -> None:
    """``torch.library.opcheck``'s result dict: exactly ``names`` ran, each a SUCCESS."""
    assert set(result) == set(names), result
    bad = {k: v for k, v in result.items() if v != "SUCCESS"}
    assert not bad, bad


def check_launch_policy(prepared, pol) -> None:
    """A prepared decode or MLA launch's policy (``prepared``: a plan's ``launch``) against the
    problem's static policy ``pol``: the same, or fewer splits of equal whole tiles launched as
    thread block clusters (``decode.launch_shape``: clusters of the policy's splits would need a
    second wave, or the twin MLA tile's splits past a cluster's: one cluster, or two levels)."""
    from .cuda import decode

    got, cluster = prepared.policy, prepared.launch.cluster
    assert got == pol or (got == decode.with_splits(pol, got.splits, prepared.static.max_seq_len)
                          and 2 <= got.splits < pol.splits and cluster > 1 and got.splits % cluster == 0), (got, pol)


def merged_in_cluster(prepared) -> bool:
    """Whether a prepared decode or MLA launch (a plan's ``launch``) merges its splits within
    one cluster a row tile (the workspace untouched), not by the ticket or in two levels."""
    return prepared.policy.splits > 1 and prepared.launch.cluster == prepared.policy.splits


def check_decode_cluster(plan, key, tuning, pol) -> None:
    """A decode or MLA plan's launch shape (``plan``: a wrapper's ``_plan`` with a prepared
    launch; ``key``: the kernel key the tests expect; ``pol``: the problem's static policy): its
    policy (``check_launch_policy``), grid, cluster and shared memory those of
    ``decode.launch_shape`` with the driver asked again here; and on their own: the splits as
    one thread block cluster only on sm_90a with 2-8 splits under ``tuning.cluster_merge``, the
    partials past the key's bytes (the twin MLA tile's over its own: the key's bytes); clusters
    smaller than the splits (two levels) only the twin's."""
    from .cuda import decode, runtime
    from .cuda.decode import CLUSTER_MAX_SPLITS
    from .cuda.keys import device_limits

    arch, sms, limit = device_limits(plan.device)
    prepared, launch = plan.launch, plan.launch.launch
    st = prepared.static
    check_launch_policy(prepared, pol)

    def held(grid, cluster, smem):
        return runtime.PreparedLaunch(launch.kernel, launch.name, grid, launch.params, cluster, smem).active_clusters()

    want = decode.launch_shape(key, pol, arch, tuning, limit, sms, st.num_kv_heads, st.batch, st.max_seq_len, held)
    assert (prepared.policy, launch.cluster, launch.smem) == want, (prepared.policy, launch.cluster, want, key.name)
    got = prepared.policy
    assert launch.grid == decode.decode_grid(got, st.num_kv_heads, st.batch)
    twin = getattr(key, "twin", False)
    may = arch == "sm_90a" and tuning.cluster_merge and not got.balanced
    if launch.cluster not in (1, got.splits):  # two levels: the twin's
        assert twin and 2 <= launch.cluster < got.splits and got.splits % launch.cluster == 0, (launch.cluster, got)
    assert launch.cluster == 1 or (may and 2 <= launch.cluster <= CLUSTER_MAX_SPLITS), (launch.cluster, got, key.name)
    assert (launch.smem > key.smem) == (launch.cluster > 1 and not twin)


def on_sm90_gpu(device) -> bool:
    """`device` is a CUDA device of compute capability 9.0 (where the sm_90a kernels run)."""
    return torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def check_decode_workspace(workspace: torch.Tensor, clustered: bool) -> None:
    """A standalone split-KV decode call's workspace after it (synchronised): untouched by the
    cluster merge, holding the ticket merge's partials otherwise."""
    assert (workspace.count_nonzero().item() == 0) == clustered, clustered


def huge_page_stride(pool: torch.Tensor) -> torch.Tensor:
    """A one-page view of a paged pool whose page stride is 2**31 elements (nothing past
    page 0 is touched, so no storage is needed for it): the validation tests' pool whose
    page addresses would overflow int32."""
    return pool.as_strided((1,) + tuple(pool.shape[1:]), (2**31,) + pool.stride()[1:])


def assign_pages(n_live: Sequence[int], kind: str, extra_pages: int,
                 generator: torch.Generator) -> "tuple[int, List[List[int]]]":
    """Page IDs for requests of ``n_live`` pages each, and the pool size: ``"perm"`` gives every
    request its own pages of a non-identity permutation of the pool; ``"repeated"`` draws IDs
    from a small shared set (repeated within and across requests, at least one ID shared by
    two requests). ``extra_pages`` pool pages are left unused."""
    if kind == "repeated":
        shared = max(2, max(n_live) // 2 + 1)
        live = [torch.randint(0, shared, (n,), generator=generator).tolist() for n in n_live]
        live[-1][0] = live[0][0]  # at least one ID shared by two requests
        return shared + extra_pages, live
    pool = sum(n_live) + extra_pages
    perm = torch.randperm(pool, generator=generator).tolist()
    if perm == sorted(perm):
        perm = perm[::-1]
    live, at = [], 0
    for n in n_live:
        live.append(perm[at:at + n])
        at += n
    return pool, live


# ----------------------------------------------------------------------------
# "No host reads": what the capturable (trusted-metadata) paths must never do
# ----------------------------------------------------------------------------

HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "__iter__")


def _host_read(*args, **kwargs):
    raise AssertionError("a tensor value was read on the host")


def _kernel_must_not_run(*args, **kwargs):
    raise AssertionError("the CPU kernel (reference) ran although validation should have failed first")


@contextlib.contextmanager
def reference_must_not_run(*names: str) -> Iterator[None]:
    """Within the block, the named ``prims_ts.reference`` functions (the CPU kernels) fail if called."""
    import prims_ts.reference as reference

    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(reference, name, _kernel_must_not_run))
        yield


@contextlib.contextmanager
def chosen_splits() -> Iterator[list]:
    """Within the block, the Tuning that each decode or MLA plan resolved by its lengths
    (``prims_ts.cuda.decode.balanced_by_lengths``'s results), in call order."""
    from .cuda import decode as cuda_decode

    got: list = []
    real = cuda_decode.balanced_by_lengths

    def record(*args, **kwargs):
        got.append(real(*args, **kwargs))
        return got[-1]

    with mock.patch.object(cuda_decode, "balanced_by_lengths", record):
        yield got


class OpRecorder:
    """Stands in for ``torch.ops.prims_ts.<op>`` and ``<op>_out``: records each call's name
    and arguments, launches nothing (the functional form returns an empty output shaped
    like the first argument, its last dimension ``out_dim`` when given, of the dtype that
    the output-dtype code before the last argument (the tuning) names)."""

    def __init__(self, op: str, out_dim: Optional[int] = None):
        self.op = op
        self.out_dim = out_dim
        self.calls: list = []

    def functional(self, *args):
        self.calls.append((self.op, args))
        shape = tuple(args[0].shape) if self.out_dim is None else tuple(args[0].shape[:-1]) + (self.out_dim,)
        from .ops._validate import code_dtype

        return torch.empty(shape, dtype=code_dtype(args[-2]))

    def out(self, *args):
        self.calls.append((self.op + "_out", args))


@contextlib.contextmanager
def recording_no_host_reads(op: str, reference: str, out_dim: Optional[int] = None) -> Iterator[OpRecorder]:
    """Within the block: the op pair ``prims_ts::<op>`` / ``<op>_out`` is an :class:`OpRecorder`
    (yielded), the CPU kernel ``prims_ts.reference.<reference>`` fails if called, and any host
    read of a tensor's values (``tolist``, ``item``, ``int()``, ``bool()``, ...) raises."""
    rec = OpRecorder(op, out_dim)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.ops.prims_ts, op, rec.functional))
        stack.enter_context(mock.patch.object(torch.ops.prims_ts, op + "_out", rec.out))
        stack.enter_context(reference_must_not_run(reference))
        for name in HOST_READS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, _host_read))
        try:
            torch.zeros(2).tolist()
        except AssertionError:
            pass
        else:
            raise AssertionError("the host-read patches are not live")
        yield rec
