"""``python -m prims_ts {info,check,bench,warmup}`` — see ``prims_ts/cli.py``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
