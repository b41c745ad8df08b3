"""Write a tiny random chat LLM in mlx-lm's layout (llama, byte-level BPE, ChatML template).

    python scripts/make_tiny_llm.py OUT_FOLDER [--seed N]

`mlx_lm.load(OUT_FOLDER)` and `python -m moshi_mlx serve --llm OUT_FOLDER` load it offline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moshi_mlx.testing.llm import write_tiny_llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    print(write_tiny_llm(args.folder, seed=args.seed))


if __name__ == "__main__":
    main()
