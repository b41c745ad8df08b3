"""`python -m moshi_mlx.run_inference`: see `moshi_mlx.cli.infer`."""

import sys

from moshi_mlx.cli.infer import main

if __name__ == "__main__":
    sys.exit(main())
