"""`python -m moshi_mlx.quantize`: see `moshi_mlx.cli.quantize`."""

import sys

from moshi_mlx.cli.quantize import main

if __name__ == "__main__":
    sys.exit(main())
