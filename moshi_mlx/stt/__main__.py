"""`python -m moshi_mlx.stt`: see `moshi_mlx.stt.command`."""

import sys

from moshi_mlx.stt.command import main

sys.exit(main())
