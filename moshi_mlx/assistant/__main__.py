"""`python -m moshi_mlx.assistant`: see `moshi_mlx.cli.assistant`."""

import sys

from moshi_mlx.cli.assistant import main

if __name__ == "__main__":
    sys.exit(main())
