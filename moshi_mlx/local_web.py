"""`python -m moshi_mlx.local_web`: see `moshi_mlx.cli.web`."""

import sys

from moshi_mlx.cli.web import main

if __name__ == "__main__":
    sys.exit(main())
