"""`python -m moshi_mlx.tts`: see `moshi_mlx.cli.tts`."""

import sys

from moshi_mlx.cli.tts import main

sys.exit(main())
