"""`python -m moshi_mlx.stt`: see `moshi_mlx.cli.stt`."""

import sys

from moshi_mlx.cli.stt import main

sys.exit(main())
