"""`python -m moshi_mlx.tts`: see `moshi_mlx.tts.command`."""

import sys

from moshi_mlx.tts.command import main

sys.exit(main())
