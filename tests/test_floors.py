"""benchmarks/floors.py, the open issues' bench floors, on the bench's own problem list (no
GPU): every floor finds its rows, each floor's row passes just inside its threshold and fails
just outside it, and the command line reads a run and a run before."""
import importlib.util
import json
from pathlib import Path

import pytest

from prims_ts import bench

spec = importlib.util.spec_from_file_location("floors", Path(__file__).parent.parent / "benchmarks" / "floors.py")
floors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floors)

# the issues' "Done when" floors, restated: (issue, family, kind, peer, threshold) in FLOORS' order
ISSUES = [
    (17, "prefill", "speed", "sdpa_cudnn", 0.85),  # B8 S1024, dense and causal
    (17, "prefill", "speed", "sdpa_cudnn", 0.95),  # S4096 and S16384, D128 and D256
    (17, "paged_prefill", "speed", "prims_ts_contiguous", 0.95),  # pages 16-128
    (17, "block_sparse", "speed", "flex", 1.25),  # block 128, every density
    (19, "mla", "rate", None, 550.0),  # B128 L4096 H128, TFLOP/s
    (19, "mla", "rate", None, 3.95),  # B64 L8192 H16, TB/s
    (19, "decode", "time", "sdpa", 1.1),  # B1 L1024: at most 1.1x SDPA's graph-replay time
    (19, "decode", "speed", "sdpa", 1.0),  # every other decode row
]
PEERS = {"prefill": "sdpa_cudnn", "paged_prefill": "prims_ts_contiguous", "block_sparse": "flex", "decode": "sdpa",
         "mla": "torch"}


def _run():
    """A run of every bench problem: ours at 1 ms, the family's peer at 2 (MLA: ours at twice
    its floor's rate)."""
    rows = []
    for p in bench.select_problems(False):
        ms = 1.0
        if p.family == "mla":
            ms = p.work / (2 * (550.0 if p.unit == "TFLOP/s" else 3.95) * 1e12) * 1e3
        rows.append({"family": p.family, "problem": p.name, "work": p.work, "unit": p.unit,
                     "runners": {"prims_ts": {"ms": ms}, PEERS[p.family]: {"ms": 2.0}}})
    return rows


def _floor_of(row):
    """The issues' floor (ISSUES) of the first of FLOORS that matches `row`, or None."""
    hits = [i for i, f in enumerate(floors.FLOORS) if f[1] == row["family"] and floors.re.search(f[2], row["problem"])]
    return ISSUES[hits[0]] if hits else None


def _at(row, floor, margin):
    """`row`'s figures set `margin` of the way past its floor's threshold (> 1: inside)."""
    _, _, kind, peer, thr = floor
    ours = row["runners"]["prims_ts"]["ms"]
    if kind == "speed":  # peer ms / ours >= thr
        row["runners"][peer]["ms"] = ours * thr * margin
    elif kind == "time":  # ours / peer ms <= thr
        row["runners"][peer]["ms"] = ours * margin / thr
    else:  # work / ms >= thr
        row["runners"]["prims_ts"]["ms"] = row["work"] / (thr * margin * 1e12) * 1e3


def test_every_floor_finds_its_rows():
    assert [(i, fam, kind, peer, thr) for i, fam, _, kind, peer, thr in floors.FLOORS] == ISSUES
    rows = _run()
    counts = [sum(1 for r in rows if r["family"] == fam and floors.re.search(pat, r["problem"]))
              for _, fam, pat, *_ in floors.FLOORS]
    # B8 S1024 x2; S4096 / S16384 x6; paged: two problems x dense / causal x four pages; block 128
    # at four densities; MLA's two; decode's latency row; its five uniform rows (not the skewed one)
    assert counts == [2, 6, 16, 4, 1, 1, 1, 5], counts
    assert all(ok for *_, ok in floors.check(rows, {})), "ours twice the peers' speed, MLA twice its floors"


@pytest.mark.parametrize("margin, passes", [(1.01, True), (0.99, False)])
def test_each_floor_at_its_threshold(margin, passes):
    rows = _run()
    for r in rows:
        f = _floor_of(r)
        if f is not None:
            _at(r, f, margin)
    results = {name: ok for _, name, _, ok in floors.check(rows, {})}
    for r in rows:
        if _floor_of(r) is not None:
            assert results[f"{r['family']} {r['problem']}"] is passes, (r["family"], r["problem"], margin)


def test_the_command_line(tmp_path, capsys):
    rows = _run()
    path, base = tmp_path / "bench.json", tmp_path / "base.json"
    path.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "rows": rows}))
    assert floors.main([str(path)]) == 0  # met; "no slower" not checked without --base
    out = capsys.readouterr().out
    assert "FAIL" not in out and "SKIP  #17" in out and "issue 17: every floor met; 1 not checked" in out
    # the run before: a decode row 5% faster then (beyond the drift), and an MLA row the run now lacks
    before = json.loads(json.dumps(rows))
    dec = next(r for r in before if r["family"] == "decode")
    dec["runners"]["prims_ts"]["ms"] /= 1.05
    gone = next(r for r in rows if r["family"] == "mla")
    rows.remove(gone)
    path.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "rows": rows}))
    base.write_text(json.dumps({"env": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": before}))
    assert floors.main([str(path), "--base", str(base)]) == 1
    out = capsys.readouterr().out
    assert "compares two GPUs" in out and "SKIP" not in out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    # the decode row against its past, the MLA row missing now and missing from its floor
    assert len(fails) == 3 and any(dec["problem"] in f and "before" in f for f in fails), fails
    assert any(gone["problem"] in f and "no figure now" in f for f in fails), fails
    assert "issue 17: 2 floor(s) not met" in out and "issue 19: 1 floor(s) not met" in out
