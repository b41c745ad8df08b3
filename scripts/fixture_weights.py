"""The reference fixture scripts' PyTorch models: their kwargs from a config.json and their
random weights (run in the scripts' venvs); and the numpy-only random file writers of
`moshi_mlx.testing` that the fixtures share with the tests and the bench (`write_voice`,
`random_voice`), importable without MLX; `print_sizes` of what a script wrote."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the reference venvs do not install moshi_mlx
    sys.path.insert(0, str(ROOT))

from moshi_mlx.testing.voices import random_voice, write_voice

__all__ = ["lm_kwargs", "mlx_names", "print_sizes", "random_voice", "round_to_bf16", "write_voice"]

KYUTAI_PYTHON = Path("/opt/venvs/kyutai/bin/python")  # Kyutai's moshi_mlx 0.3.0

# Keys that Kyutai's CheckpointInfo.from_hf_repo pops before the rest become LMModel kwargs.
CHECKPOINT_KEYS = (
    "moshi_name",
    "mimi_name",
    "mimi_config_name",
    "tokenizer_name",
    "lora_name",
    "model_type",
    "lm_gen_config",
    "tts_config",
    "stt_config",
    "model_id",
)


def lm_kwargs(config: dict) -> dict:
    """The LMModel kwargs of a config.json, as CheckpointInfo.from_hf_repo leaves them."""
    kwargs = copy.deepcopy(config)  # get_conditioner writes into the conditioner dicts
    for key in CHECKPOINT_KEYS:
        kwargs.pop(key, None)
    return kwargs


def round_to_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (seeded, float32) with its layer-scale `alpha`s drawn near 1 and every value a
    bf16 value, so the committed bf16 files lose nothing; in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".alpha"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model.eval()


def mlx_names(config_path: Path, out: Path) -> None:
    """Kyutai's moshi_mlx parameter names for config_path, written by its own venv."""
    if not KYUTAI_PYTHON.exists():
        print(f"skipped {out.name}: {KYUTAI_PYTHON} is missing")
        return
    script = Path(__file__).resolve().parent / "list_kyutai_mlx_names.py"
    subprocess.run([str(KYUTAI_PYTHON), str(script), str(config_path), str(out)], check=True)


def print_sizes(folder: Path) -> None:
    """Print each file of `folder` as `folder/name: N bytes`."""
    for path in sorted(folder.iterdir()):
        print(f"{folder.name}/{path.name}: {path.stat().st_size} bytes")
