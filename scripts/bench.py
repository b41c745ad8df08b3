"""Speed of moshi_mlx's streaming loop on random weights: `python scripts/bench.py [flags]`.

The bench is the `bench/` package beside this file (its docstring says what each part
measures; `--help` lists the flags); this file runs its `main` with the same flags.
"""

import sys

from bench.main import main

if __name__ == "__main__":
    main(sys.argv[1:])
