"""batch_prefill on the GPU against the float64 reference (the correctness grid).

Every compute test takes ``ring_variant`` (conftest: a ``prims_ts.Tuning`` of the producer
ring) and runs through a ``BatchPrefillTSWrapper`` planned with it; the planned kernel key
must be the one ``PrefillKey.choose`` builds for that tuning. Under the first variant
(``loop0``, the one every device runs) the one-shot ``batch_prefill`` (the default tuning)
runs the same cells too. Outputs are NaN-poisoned first; NaN never passes.

``DEVICE`` is a module global: a dry run may set it to "cpu" and call the test functions
with a Tuning directly (the CPU path of every API is the pure-PyTorch reference).
"""
import itertools

import pytest
import torch

import prims_ts
from prims_ts import reference as R
from prims_ts.cuda.catalog import RING_VARIANTS
from prims_ts.cuda.keys import device_limits
from prims_ts.cuda.prefill import PrefillKey
from prims_ts.testing import TOLERANCE, rel_err, stable_seed

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
NAN = float("nan")
# the ring variant whose cells also run the one-shot (the default tuning): every device runs it
ONESHOT_TUNING = RING_VARIANTS["loop0"]

MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 100), ("variable_window", -1)]
FIXED_LENGTHS = [(1, 1), (7, 7), (127, 129), (129, 1000), (1000, 1033)]
PACKED_Q = [1, 7, 127, 129, 1000]
PACKED_KV = [1, 9, 127, 300, 1040]


def sync():
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def _gen(seed):
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def _windows(B, Sq, Sk, g):
    a = torch.randint(0, Sk, (B, Sq), generator=g, device=DEVICE, dtype=torch.int32)
    b = torch.randint(0, Sk, (B, Sq), generator=g, device=DEVICE, dtype=torch.int32)
    return torch.minimum(a, b), torch.maximum(a, b)


def check_key(w, dtype, d, mask, tuning):
    """The plan keeps `tuning`, and (on CUDA) its prepared launch is the kernel that
    PrefillKey.choose builds for it; on sm_90a that key takes the tuning's ring choices."""
    plan = w._plan
    assert plan.static.tuning == tuning
    assert plan.tuning_code == tuning.encode()
    arch = device_limits(plan.device)[0]
    key = PrefillKey.choose(dtype, d, mask, arch, tuning=tuning, packed=plan.packed)
    if arch == "sm_90a" and tuning.portable:
        assert key.arch == 80, key.name  # the portable engine on a Hopper GPU
    elif arch == "sm_90a":
        assert key.arch == 90 and key.loop == tuning.loop_for(d) and key.copy_tpr == tuning.copy_for(d), key.name
        assert key.persistent == (tuning.persistent and mask != "variable_window"), key.name
        assert key.tma == (tuning.tma and not plan.packed), key.name  # persistent CTAs too
        assert key.lean == tuning.lean_for(d), key.name
    if plan.launch is not None:
        assert plan.launch.key == key, (plan.launch.key.name, key.name)


def run_entries(tuning, q, k, v, *, out_dtype=None, **kw):
    """[(label, out)]: the wrapper planned with `tuning` (run into a NaN-poisoned out) and,
    under ONESHOT_TUNING, the one-shot (default tuning) the same way. `kw`: plan's keywords."""
    odt = out_dtype or q.dtype
    w = prims_ts.BatchPrefillTSWrapper(tuning=tuning)
    w.plan(q, k, v, out_dtype=out_dtype, **kw)
    check_key(w, q.dtype, q.shape[-1], kw.get("mask_type", "dense"), tuning)
    out = torch.full(q.shape, NAN, dtype=odt, device=q.device)
    assert w.run(q, k, v, out=out) is out
    results = [("wrapper", out)]
    if tuning == ONESHOT_TUNING:
        one = torch.full(q.shape, NAN, dtype=odt, device=q.device)
        assert prims_ts.batch_prefill(q, k, v, out_dtype=out_dtype, out=one, **kw) is one
        results.append(("one-shot", one))
    sync()
    return results


def assert_close_to(results, ref, tol, what=""):
    for label, out in results:
        err = rel_err(out, ref)
        assert err <= tol, f"{label} {what}: rel err {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS, ids=[f"{m}{w}" for m, w in MASKS])
def test_fixed_grid(ring_variant, mask, window, d, group, dtype):
    g = _gen(stable_seed(mask, window, d, group, str(dtype)))
    hkv = 2
    hq = hkv * group
    for sq, sk in FIXED_LENGTHS:
        if mask == "causal" and sq > sk:
            continue
        B = 2
        q = _randn((B, sq, hq, d), dtype, g)
        k = _randn((B, sk, hkv, d), dtype, g)
        v = _randn((B, sk, hkv, d), dtype, g)
        starts = ends = None
        if mask == "variable_window":
            starts, ends = _windows(B, sq, sk, g)
        results = run_entries(ring_variant, q, k, v, mask_type=mask, window_left=window,
                              variable_window_token_starts=starts, variable_window_token_ends=ends)
        ref = R.batch_prefill(q, k, v, mask_type=mask, window_left=window, window_starts=starts, window_ends=ends,
                              compute_dtype=torch.float64)
        assert_close_to(results, ref, TOLERANCE[dtype], f"Sq={sq} Sk={sk}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS[:4], ids=[f"{m}{w}" for m, w in MASKS[:4]])
def test_packed_grid(ring_variant, mask, window, d, group, dtype):
    g = _gen(stable_seed("packed", mask, window, d, group, str(dtype)))
    hkv = 2
    hq = hkv * group
    qo = torch.tensor([0] + list(itertools.accumulate(PACKED_Q)), dtype=torch.int32, device=DEVICE)
    kvo = torch.tensor([0] + list(itertools.accumulate(PACKED_KV)), dtype=torch.int32, device=DEVICE)
    q = _randn((int(qo[-1]), hq, d), dtype, g)
    k = _randn((int(kvo[-1]), hkv, d), dtype, g)
    v = _randn((int(kvo[-1]), hkv, d), dtype, g)
    results = run_entries(ring_variant, q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
    ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window,
                          compute_dtype=torch.float64)
    assert_close_to(results, ref, TOLERANCE[dtype])
    qo_l = qo.tolist()
    for b in range(len(PACKED_Q)):  # per request too: a short one must not hide behind the long ones
        s = slice(qo_l[b], qo_l[b + 1])
        assert_close_to([(label, out[s]) for label, out in results], ref[s], TOLERANCE[dtype], f"request {b}")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_dtype_and_scales(ring_variant, out_dtype):
    g = _gen(7)
    q = _randn((2, 300, 8, 128), torch.bfloat16, g)
    k = _randn((2, 333, 4, 128), torch.bfloat16, g)
    v = _randn((2, 333, 4, 128), torch.bfloat16, g)
    kw = dict(mask_type="causal", sm_scale=0.05, output_scale=1.7)
    ref = R.batch_prefill(q, k, v, compute_dtype=torch.float64, **kw)
    results = run_entries(ring_variant, q, k, v, out_dtype=out_dtype, **kw)
    assert all(out.dtype == out_dtype for _, out in results)
    assert_close_to(results, ref, 2e-2)
    # the functional forms (no out): the wrapper's run, and the one-shot
    w = prims_ts.BatchPrefillTSWrapper(tuning=ring_variant)
    w.plan(q, k, v, out_dtype=out_dtype, **kw)
    res = [("wrapper functional", w.run(q, k, v))]
    if ring_variant == ONESHOT_TUNING:
        res.append(("one-shot functional", prims_ts.batch_prefill(q, k, v, out_dtype=out_dtype, **kw)))
    sync()
    assert all(out.dtype == out_dtype and out.shape == q.shape for _, out in res)
    assert_close_to(res, ref, 2e-2)


def test_strided_views(ring_variant):
    """q/k/v as views into a fused QKV projection (outer strides != contiguous)."""
    g = _gen(11)
    B, S, hq, hkv, d = 2, 257, 8, 2, 128
    qkv = _randn((B, S, hq + 2 * hkv, d), torch.bfloat16, g)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    assert not q.is_contiguous() and not k.is_contiguous()
    results = run_entries(ring_variant, q, k, v, mask_type="causal")
    ref = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=torch.float64)
    assert_close_to(results, ref, 2e-2)


def test_runs_after_the_first_take_new_addresses_and_strides():
    """A plan's later runs whose operands are laid out as its last checked run's (the fast path,
    ``cuda.keys.Accepted``): new q, k, v and out tensors give the reference; views of a fused
    projection (other strides) are checked and relaunched, and contiguous tensors after them are
    right again; an out overlapping q, or a misaligned one, is still refused."""
    g = _gen(23)
    B, S, hq, hkv, d = 2, 257, 8, 2, 128
    fresh = lambda: tuple(_randn((B, S, h, d), torch.bfloat16, g) for h in (hq, hkv, hkv))  # noqa: E731
    w = prims_ts.BatchPrefillTSWrapper()
    w.plan(*fresh(), mask_type="causal")
    qkv = _randn((B, S, hq + 2 * hkv, d), torch.bfloat16, g)
    cases = [fresh(), fresh(), (qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]), fresh()]
    for i, (q, k, v) in enumerate(cases):
        out = torch.full(q.shape, NAN, dtype=q.dtype, device=DEVICE)
        assert w.run(q, k, v, out=out) is out
        sync()
        ref = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=torch.float64)
        assert_close_to([(f"run {i}", out)], ref, 2e-2)
    q, k, v = cases[-1]
    with pytest.raises(ValueError, match="out must not overlap q"):
        w.run(q, k, v, out=q)
    spare = torch.empty(q.numel() + 8, dtype=q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(q, k, v, out=spare[1:1 + q.numel()].view(q.shape))


def test_large_scores_no_overflow(ring_variant):
    """Large logits must not overflow the online softmax."""
    g = _gen(3)
    q = _randn((1, 200, 4, 128), torch.bfloat16, g) * 8
    k = _randn((1, 500, 4, 128), torch.bfloat16, g) * 8
    v = _randn((1, 500, 4, 128), torch.bfloat16, g)
    results = run_entries(ring_variant, q, k, v)
    ref = R.batch_prefill(q, k, v, compute_dtype=torch.float64)
    assert_close_to(results, ref, 2e-2)


def test_wrapper_replay_changed_offsets(ring_variant):
    """plan(q, k, v, packed offsets) binds the offsets: a CUDA-graph replay (eager run off CUDA)
    reads their new values, within the planned totals and longest query count."""
    g = _gen(5)
    hq, hkv, d = 8, 2, 128
    q_lens, kv_lens = [100, 300, 37], [200, 300, 500]
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEVICE)
    kvo = torch.tensor([0] + list(itertools.accumulate(kv_lens)), dtype=torch.int32, device=DEVICE)
    q = _randn((int(qo[-1]), hq, d), torch.bfloat16, g)
    k = _randn((int(kvo[-1]), hkv, d), torch.bfloat16, g)
    v = _randn((int(kvo[-1]), hkv, d), torch.bfloat16, g)
    w = prims_ts.BatchPrefillTSWrapper(tuning=ring_variant)
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    check_key(w, torch.bfloat16, d, "causal", ring_variant)
    out = torch.full_like(q, NAN)
    assert w.run(q, k, v, out=out) is out
    sync()
    ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2
    graph = None
    if q.is_cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w.run(q, k, v, out=out)
    # new offsets: same totals, every q length within the planned longest (300), Sq <= Sk
    new_q, new_kv = [200, 137, 100], [250, 350, 400]
    assert sum(new_q) == sum(q_lens) and sum(new_kv) == sum(kv_lens) and max(new_q) <= max(q_lens)
    qo.copy_(torch.tensor([0] + list(itertools.accumulate(new_q)), dtype=torch.int32))
    kvo.copy_(torch.tensor([0] + list(itertools.accumulate(new_kv)), dtype=torch.int32))
    out.fill_(NAN)
    if graph is not None:
        graph.replay()
    else:
        w.run(q, k, v, out=out)
    sync()
    ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2
    out.fill_(NAN)  # an eager run after the replay reads them too
    assert w.run(q, k, v, out=out) is out
    sync()
    assert rel_err(out, ref) <= 2e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(ring_variant):
    global DEVICE
    saved = DEVICE
    DEVICE = "cuda:1"
    try:
        dev = torch.device(DEVICE)
        g = _gen(0)
        q = _randn((2, 130, 8, 128), torch.bfloat16, g)
        k = _randn((2, 140, 2, 128), torch.bfloat16, g)
        v = _randn((2, 140, 2, 128), torch.bfloat16, g)
        ref = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=torch.float64)
        out = prims_ts.batch_prefill(q, k, v, mask_type="causal")  # the one-shot: the default tuning
        assert out.device == dev
        assert rel_err(out, ref) <= 2e-2
        results = run_entries(ring_variant, q, k, v, mask_type="causal")
        assert all(o.device == dev for _, o in results)
        assert_close_to(results, ref, 2e-2)
        qo = torch.tensor([0, 100, 260], dtype=torch.int32, device=dev)
        kvo = torch.tensor([0, 120, 280], dtype=torch.int32, device=dev)
        qp, kp, vp = q.reshape(260, 8, 128), k.reshape(280, 2, 128), v.reshape(280, 2, 128)
        refp = R.batch_prefill(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal",
                               compute_dtype=torch.float64)
        outp = prims_ts.batch_prefill(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
        assert rel_err(outp, refp) <= 2e-2
        results = run_entries(ring_variant, qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
        assert_close_to(results, refp, 2e-2)
    finally:
        DEVICE = saved
