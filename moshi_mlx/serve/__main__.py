"""`python -m moshi_mlx.serve`: see `moshi_mlx.cli.serve`."""

import sys

from moshi_mlx.cli.serve import main

sys.exit(main())
