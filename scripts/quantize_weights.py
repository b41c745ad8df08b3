#!/usr/bin/env python3
"""Convert / quantize a Moshi LM checkpoint; same as `python -m moshi_mlx quantize`."""

import sys

from moshi_mlx.cli.quantize import main

if __name__ == "__main__":
    sys.exit(main())
