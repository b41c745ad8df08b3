"""Small `.pt` files written by real torch.save, for the tests of moshi_mlx.checkpoints.torch_zip.

Run with any Python that has torch (the reference environment has it):

    /opt/venvs/ref/bin/python scripts/make_torch_zip_fixtures.py      # tests/fixtures/torch_zip

Each NAME.pt comes with NAME.npz: its tensors as numpy arrays (bfloat16 as float32, which is
exact), keyed by their path in the saved object ("views/0", "nested/b/1/x", ...). The non-tensor
values are spelled out in the tests.
"""

from __future__ import annotations

import argparse
import io
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch


def voice(generator: torch.Generator) -> dict:
    """A PersonaPlex voice prompt's layout: embeddings (T, 1, 1, D) in bf16, cache (1, 17, 4)."""
    embeddings = torch.randn(5, 1, 1, 16, generator=generator)
    embeddings[0, 0, 0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40])
    cache = torch.randint(-(2**40), 2**40, (1, 17, 4), generator=generator)
    return {"embeddings": embeddings.to(torch.bfloat16), "cache": cache}


def persona_voice(generator: torch.Generator) -> dict:
    """A voice that the tests' tiny PersonaPlex model (tests/helpers/tiny_moshi.py: dim 64, 17 streams,
    max delay 1) takes: embeddings (4, 1, 1, 64) in bf16, a delayed-token buffer (1, 17, 4) of valid
    tokens (text below 100, audio below 2048)."""
    embeddings = 0.1 * torch.randn(4, 1, 1, 64, generator=generator)
    cache = torch.randint(0, 2048, (1, 17, 4), generator=generator)
    cache[:, 0] = torch.randint(0, 100, (1, 4), generator=generator)
    return {"embeddings": embeddings.to(torch.bfloat16), "cache": cache}


def dtypes(generator: torch.Generator) -> dict:
    values = torch.randn(2, 3, generator=generator) * 100
    kinds = [torch.float32, torch.float16, torch.float64, torch.int32, torch.int16, torch.int8]
    tensors = {str(kind).removeprefix("torch."): values.to(kind) for kind in kinds}
    tensors["uint8"] = values.abs().to(torch.uint8)
    tensors["bool"] = values > 0
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 3)
    return tensors


def views(generator: torch.Generator) -> list:
    """Non-contiguous tensors; the first three share one storage (saved once)."""
    base = torch.randn(4, 6, generator=generator)
    return [base, base.t(), base[1:, ::2], torch.arange(24).reshape(2, 3, 4).permute(2, 0, 1)]


def nested(generator: torch.Generator) -> OrderedDict:
    """Containers and scalars around tensors; saved through a file object (top folder 'archive')."""
    return OrderedDict(
        a=[1, -2.5, "text", None, True, False, 2**70],
        b=(torch.ones(2, dtype=torch.float16), {"x": torch.randn(3, generator=generator)}),
        c=OrderedDict(d=[], e=()),
    )


def flat_arrays(value: object, prefix: str = "") -> dict[str, np.ndarray]:
    """Every tensor in `value`, as numpy, keyed by its path."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            value = value.float()
        return {prefix.rstrip("/"): value.numpy()}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return {}
    return {k: v for key, item in items for k, v in flat_arrays(item, f"{prefix}{key}/").items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/torch_zip"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for make in (voice, dtypes, views, nested, persona_voice):  # new ones last: same files
        value = make(generator)
        path = args.out / f"{make.__name__}.pt"
        if make is nested:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            path.write_bytes(buffer.getvalue())
        else:
            torch.save(value, path)
        np.savez(args.out / f"{make.__name__}.npz", **flat_arrays(value))
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
