"""`python scripts/bench [flags]`, the same as `python scripts/bench.py [flags]`."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: import the package from scripts/, not from inside it
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.main import main

main(sys.argv[1:])
