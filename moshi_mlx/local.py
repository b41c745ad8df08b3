"""`python -m moshi_mlx.local`: see `moshi_mlx.cli.local`."""

import sys

from moshi_mlx.cli.local import main

if __name__ == "__main__":
    sys.exit(main())
