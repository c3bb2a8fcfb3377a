"""benchmarks/floors.py, the open issues' bench floors, on the bench's own problem list (no
GPU): every floor finds its rows, and a run passes or fails by the figures it holds."""
import importlib.util
import json
from pathlib import Path

from prims_ts import bench

spec = importlib.util.spec_from_file_location("floors", Path(__file__).parent.parent / "benchmarks" / "floors.py")
floors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floors)

PEERS = {"prefill": "sdpa_cudnn", "paged_prefill": "prims_ts_contiguous", "block_sparse": "flex", "decode": "sdpa",
         "mla": "torch"}


def _run(ours_ms=1.0, peer_ms=2.0):
    """A run of every bench problem, ours at `ours_ms` (MLA's rows at their floor's rate x 1.1)
    and the family's peer at `peer_ms`."""
    rows = []
    for p in bench.select_problems(False):
        ms = ours_ms
        if p.family == "mla":
            ms = p.work / (1.1 * (550.0 if p.unit == "TFLOP/s" else 3.95) * 1e12) * 1e3
        rows.append({"family": p.family, "problem": p.name, "work": p.work, "unit": p.unit,
                     "runners": {"prims_ts": {"ms": ms}, PEERS[p.family]: {"ms": peer_ms}}})
    return rows


def test_every_floor_finds_its_rows():
    rows = _run()
    counts = [sum(1 for r in rows if r["family"] == fam and floors.re.search(pat, r["problem"]))
              for _, fam, pat, *_ in floors.FLOORS]
    # B8 S1024 x2; S4096 / S16384 x6; paged: two problems x dense / causal x four pages; block 128
    # at four densities; MLA's two; decode's latency row; its five uniform rows (not the skewed one)
    assert counts == [2, 6, 16, 4, 1, 1, 1, 5], counts


def test_a_run_passes_or_fails_by_its_figures(tmp_path, capsys):
    rows = _run()
    assert all(ok for *_, ok in floors.check(rows))  # ours twice the peers' speed, MLA 1.1x its floors
    latency = next(r for r in rows if r["family"] == "decode" and r["problem"].endswith("graphs"))
    latency["runners"]["sdpa"]["ms"] = 0.95  # ours 1.0: 1.05x SDPA's time, within 1.1
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "rows": rows}))
    assert floors.main([str(path)]) == 0
    assert "FAIL" not in capsys.readouterr().out
    # one paged row at 0.94x our contiguous kernel, the latency row at 1.18x SDPA's time, MLA
    # B128 missing: three failures, exit 1
    paged = next(r for r in rows if r["family"] == "paged_prefill")
    paged["runners"]["prims_ts_contiguous"]["ms"] = 0.94
    latency["runners"]["sdpa"]["ms"] = 0.85
    rows[:] = [r for r in rows if not (r["family"] == "mla" and r["problem"].startswith("B128"))]
    path.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "rows": rows}))
    assert floors.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 3 and "issue 17: 1 floor(s) not met" in out and "no such row" in out
    assert "issue 19: 2 floor(s) not met" in out
    # --base: a decode row 3% slower than before fails issue 17's "no slower"
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"rows": [dict(r, runners={"prims_ts": {"ms": 0.97}}) for r in rows
                                         if r["family"] == "decode"][:1]}))
    results = floors.check(rows, {(r["family"], r["problem"]): 0.97 for r in json.loads(base.read_text())["rows"]})
    assert [ok for i, name, what, ok in results if "before" in what] == [False]
