"""Kyutai's MLX parameter names for a config.json, for tests/manifests/.

Run with Kyutai's moshi_mlx (0.3.0) environment; scripts/make_stt_fixtures.py calls it:

    /opt/venvs/kyutai/bin/python scripts/list_kyutai_mlx_names.py CONFIG_JSON OUT_TSV

It builds `moshi_mlx.models.Lm(LmConfig.from_config_dict(config))`, the model that Kyutai's
`run_inference.py` loads a `-mlx` repo's weights into (strictly), and writes every parameter
as `name<TAB>shape` (shape comma-separated), sorted by name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlx.utils import tree_flatten

from moshi_mlx import models  # Kyutai's package of the same name, in its own venv


def main(config_path: str, out_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    model = models.Lm(models.LmConfig.from_config_dict(config))
    rows = sorted(tree_flatten(model.parameters()))
    lines = ["name\tshape"] + [f"{name}\t{','.join(map(str, a.shape))}" for name, a in rows]
    Path(out_path).write_text("\n".join(lines) + "\n")
    print(f"{out_path}: {len(rows)} parameters")


if __name__ == "__main__":
    main(*sys.argv[1:])
