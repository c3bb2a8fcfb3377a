"""The bench driver's row logic on the CPU (timing stubbed): timing rounds in alternating
runner order, each cell the median of its rounds, a runner that fails in setup, in its
first call or while timed shows its error and no figure, skipped runners, errors vs the
reference runner. And our runners' call sites (plan/run of each family's wrapper, in the
new signatures) on tiny CPU problems, against a float64 attention computed here from the
family's logical (contiguous) inputs."""
import math

import pytest
import torch

from prims_ts import bench
from prims_ts.testing import TOLERANCE, rel_err

F64 = torch.float64


def _family(calls, fail_setup=False, fail_timing=False):
    def runner(name, value, setup_raises=False):
        def setup(prob, inputs):
            if setup_raises:
                raise RuntimeError(f"{name} setup failed")

            def fn():
                calls.append(name)
                if fail_timing and name == "prims_ts" and calls.count(name) > 1:
                    raise RuntimeError("launch failed")
                return inputs * value
            return fn
        return bench.Runner(name, setup)

    return bench.Family(
        name="toy", problems=lambda: [], make_inputs=lambda prob, dev: torch.ones(4),
        runners=[runner("prims_ts", 1.001), runner("peer", 1.0), runner("broken", 2.0, setup_raises=fail_setup)],
        reference="peer")


def _run(monkeypatch, fam, runners=None, times=None):
    order = []
    figures = iter(times or [])

    def fake_time(fn, rep_ms=100):
        order.append(fn)
        fn()
        return next(figures)

    monkeypatch.setattr(bench, "time_ms", fake_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    prob = bench.Problem("toy", "toy row", {}, work=2e12, unit="TFLOP/s")
    return bench._run_problem(fam, prob, torch.device("cpu"), {"gemm_bf16_TFLOPs": 1000.0}, runners), order


def test_rounds_alternate_and_cells_are_medians(monkeypatch):
    calls = []
    fam = _family(calls)
    # rounds: (peer, broken, prims_ts), then reversed, then forward again; figures in call order
    times = [1.0, 5.0, 2.0, 4.0, 7.0, 1.5, 3.0, 6.0, 9.0]
    row, _ = _run(monkeypatch, fam, times=times)
    assert bench.TIMING_ROUNDS == 3
    timed = calls[3:]  # after the three first (output) calls
    assert timed == ["peer", "broken", "prims_ts", "prims_ts", "broken", "peer", "peer", "broken", "prims_ts"]
    # peer 1.0, 1.5, 3.0; broken 5.0, 7.0, 6.0; prims_ts 2.0, 4.0, 9.0
    assert row.cells["peer"].ms == 1.5 and row.cells["broken"].ms == 6.0 and row.cells["prims_ts"].ms == 4.0
    # each round's figures and order kept (the JSON's rounds_ms and round_orders)
    assert row.cells["prims_ts"].rounds == [2.0, 4.0, 9.0] and row.cells["peer"].rounds == [1.0, 1.5, 3.0]
    assert row.orders == [timed[0:3], timed[3:6], timed[6:9]]
    js = bench.results_json({}, {}, [row])["rows"][0]
    assert js["runners"]["broken"]["rounds_ms"] == [5.0, 7.0, 6.0] and js["round_orders"] == row.orders
    assert abs(row.cells["prims_ts"].rate - 2e12 / 4e-3 / 1e12) < 1e-9
    assert abs(row.cells["prims_ts"].frac - row.cells["prims_ts"].rate / 1000.0) < 1e-12
    assert row.cells["prims_ts"].err is not None and 0 < row.cells["prims_ts"].err < 2e-3
    assert row.cells["peer"].err is None  # the reference itself


def test_failures_and_skips_leave_no_figure(monkeypatch):
    calls = []
    fam = _family(calls, fail_setup=True, fail_timing=True)
    row, _ = _run(monkeypatch, fam, times=[1.0] * 9)
    assert "setup failed" in row.cells["broken"].error and row.cells["broken"].ms is None
    assert "launch failed" in row.cells["prims_ts"].error and row.cells["prims_ts"].ms is None
    assert row.cells["peer"].ms == 1.0 and not row.cells["peer"].error
    assert calls.count("prims_ts") == 2  # its output call, then the failed timing: no further rounds

    calls.clear()
    fam = _family(calls)
    row, _ = _run(monkeypatch, fam, runners=["prims_ts", "peer"], times=[1.0] * 6)
    assert row.cells["broken"].error == "skipped" and row.cells["broken"].ms is None
    assert "broken" not in calls


# ----------------------------------------------------------------------------
# Our runners' call sites on tiny CPU problems
# ----------------------------------------------------------------------------


def _attend64(q, k, v, mask, scale):
    """float64 softmax(q k^T * scale) v over [B, H, S, D] tensors; masked-out keys never seen."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(F64), k.to(F64)) * scale
    s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, dim=-1) @ v.to(F64)

def _causal(sq, sk):
    return torch.arange(sk).view(1, -1) <= sk - sq + torch.arange(sq).view(-1, 1)

def _ref_prefill(x):
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))  # [B, H, S, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = _causal(q.shape[2], k.shape[2]) if x.causal else torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    return _attend64(q, k, v, mask, 1 / math.sqrt(q.shape[-1])).transpose(1, 2)

def _ref_bsr(x):
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    bs = x.block_size
    m = x.routes.repeat_interleave(bs, 2).repeat_interleave(bs, 3).repeat_interleave(group, 1)
    out = _attend64(q, k, v, m, 1 / math.sqrt(q.shape[-1]))
    return torch.nan_to_num(out, nan=0.0).transpose(1, 2)

def _ref_decode(x):
    q, k, v = x.contiguous()  # [B, Hq, 1, D], [B, Hkv, L, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return _attend64(q, k, v, x.key_mask(), 1 / math.sqrt(q.shape[-1]))[:, :, 0]  # ragged: the padding masked

def _ref_mla(x):
    q, kv = x.contiguous()  # [B, SQ * H, 576] token-major, [B, L, 576]
    b, sq, h, _ = x.q.shape
    mask = _causal(sq, kv.shape[1]).repeat_interleave(h, 0)
    out = _attend64(q.unsqueeze(1), kv.unsqueeze(1), kv[..., :bench.MLA_DV].unsqueeze(1), mask, x.scale)
    return out[:, 0].view(b, sq, h, bench.MLA_DV)

SMOKE = [
    ("prefill", dict(B=2, Sq=48, Sk=48, Hq=4, Hkv=2, D=128, causal=True, dtype="bf16"), _ref_prefill),
    ("paged_prefill", dict(B=2, Sq=48, Sk=48, Hq=4, Hkv=2, D=128, causal=True, page_size=16, dtype="bf16"),
     _ref_prefill),
    ("decode", dict(B=3, L=70, Hq=8, Hkv=2, D=128, page_size=32, graph=False, dtype="bf16"), _ref_decode),
    ("decode", dict(B=4, L=150, short=33, Hq=8, Hkv=2, D=128, page_size=32, graph=False, dtype="bf16"),
     _ref_decode),
    ("mla", dict(B=2, L=70, H=8, SQ=2, page_size=64, graph=False, dtype="bf16"), _ref_mla),
    ("block_sparse", dict(B=2, Sq=64, Sk=64, Hq=4, Hkv=2, D=128, causal=False, page_size=16, block_size=32,
                          density=0.5, selected=0.5, seed=3, dtype="bf16"), _ref_bsr),
]

@pytest.mark.parametrize("family,params,ref", SMOKE, ids=[s[0] + ("_skewed" if "short" in s[1] else "") for s in SMOKE])
def test_our_runners_call_the_public_api(family, params, ref):
    """Each family's prims_ts runner plans and runs its wrapper on tiny CPU inputs (no CUDA graph): the
    output matches the float64 attention of the same logical problem, and a second call repeats it."""
    fam = bench.FAMILIES[family]
    prob = bench.Problem(family, "tiny", params, work=1.0)
    x = fam.make_inputs(prob, torch.device("cpu"))
    ours = next(r for r in fam.runners if r.name == fam.ours)
    fn = ours.setup(prob, x)
    out = fn()
    want = ref(x)
    assert out.shape == want.shape
    assert rel_err(out, want) <= TOLERANCE[torch.bfloat16]
    out2 = fn()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_rounds_tool_reads_each_round_and_its_predecessor(monkeypatch):
    """benchmarks/rounds.py on a row the driver timed: every round's figure, after the runner
    timed just before it (across rounds too)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("rounds", Path(__file__).parent.parent / "benchmarks" / "rounds.py")
    rounds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rounds)
    calls = []
    row, _ = _run(monkeypatch, _family(calls), times=[1.0, 5.0, 2.0, 4.0, 7.0, 1.5, 3.0, 6.0, 9.0])
    got = rounds.rounds(bench.results_json({}, {}, [row])["rows"][0])
    assert [(k, n, p) for k, n, p, _ in got] == [
        (0, "peer", None), (0, "broken", "peer"), (0, "prims_ts", "broken"),
        (1, "prims_ts", "prims_ts"), (1, "broken", "prims_ts"), (1, "peer", "broken"),
        (2, "peer", "peer"), (2, "broken", "peer"), (2, "prims_ts", "broken")]
    assert [ms for *_, ms in got] == [1.0, 5.0, 2.0, 4.0, 7.0, 1.5, 3.0, 6.0, 9.0]
