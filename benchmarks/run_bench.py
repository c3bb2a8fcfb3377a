"""Thin wrapper: ``python benchmarks/run_bench.py [ARGS]`` == ``python -m prims_ts bench [ARGS]``.

The benchmark code lives in the package (``prims_ts/bench.py``) so that the CLI works
from an installed wheel too; this script only puts the checkout first on the path.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prims_ts.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
