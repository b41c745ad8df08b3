"""`python -m moshi_mlx <command>`: see `moshi_mlx.cli.main`."""

import sys

from moshi_mlx.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
