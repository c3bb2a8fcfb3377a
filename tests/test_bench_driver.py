"""The bench driver's row logic on the CPU (timing stubbed): timing rounds in alternating
runner order, each cell the median of its rounds, a runner that fails in setup, in its
first call or while timed shows its error and no figure, skipped runners, errors vs the
reference runner."""
import torch

from prims_ts import bench


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
