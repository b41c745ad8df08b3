"""Golden outputs of Kyutai's PyTorch Mimi for the parity tests of our MLX Mimi.

Run with the reference environment (torch + Kyutai's `moshi`):

    /opt/venvs/ref/bin/python scripts/make_mimi_fixtures.py            # tests/fixtures/mimi
    /opt/venvs/ref/bin/python scripts/make_mimi_fixtures.py --full --weights W --out DIR

It builds the reference MimiModel (the small test config by default, or the published config
with --full), gives it random weights (or loads --weights), saves the weights in the published
PyTorch layout, and saves for a short odd-length input: the unquantized latent, the codes, the
PCM decoded from those codes and the PCM decoded from fixed random codes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from moshi.models.loaders import _mimi_config, get_mimi
from safetensors.torch import load_file, save_file

NUM_CODEBOOKS = 8
TAIL_SAMPLES = 1000  # the input ends mid-frame: the encoder pads it to a whole frame

# Same as `MimiConfig.tiny()` in moshi_mlx, in Kyutai's config layout.
TINY_CONFIG = {
    "sample_rate": 24000,
    "channels": 1,
    "frame_rate": 12.5,
    "seanet": {**_mimi_config["seanet"], "dimension": 32, "n_filters": 4},
    "transformer": {
        **_mimi_config["transformer"],
        "d_model": 32,
        "num_heads": 4,
        "num_layers": 2,
        "dim_feedforward": 64,
        "input_dimension": 32,
        "output_dimensions": [32],
    },
    "quantizer": {
        **_mimi_config["quantizer"],
        "dimension": 16,
        "bins": 64,
        "n_q": 8,
        "input_dimension": 32,
        "output_dimension": 32,
    },
}


def published_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the published file's names (legacy attention names)."""
    state = {}
    for name, tensor in model.state_dict().items():
        name = name.replace("self_attn.in_projs.0.weight", "self_attn.in_proj_weight")
        name = name.replace("self_attn.out_projs.0.weight", "self_attn.out_proj.weight")
        state[name] = tensor.detach().contiguous().clone()
    return state


def test_signal(frames: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    t = np.arange((frames - 1) * 1920 + TAIL_SAMPLES) / 24000
    pcm = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1375 * t)
    pcm = pcm * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.normal(size=t.shape)
    return torch.tensor(pcm, dtype=torch.float32).view(1, 1, -1)


@torch.no_grad()
def randomize(model, pcm: torch.Tensor, seed: int) -> None:
    """Random weights that make every part matter: strong layer scales, non-trivial norms,
    codebooks spread like the latents they quantize."""
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "layer_scale" in name:
            param.uniform_(0.2, 0.6)
        elif ".norm" in name:
            param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(param))
        elif name.endswith("bias"):
            param.uniform_(-0.05, 0.05)
    latent = model._encode_to_unquantized_latent(pcm)
    for rvq in (model.quantizer.rvq_first, model.quantizer.rvq_rest):
        projected = rvq.input_proj(latent)
        spread = projected.std().item()
        for k, layer in enumerate(rvq.vq.layers):
            book = layer._codebook
            usage = torch.rand_like(book.cluster_usage) * 1.5 + 0.5
            vectors = torch.randn_like(book.embedding_sum) * spread * 0.7**k
            book.cluster_usage.copy_(usage)
            book.embedding_sum.copy_(vectors * usage[:, None])
            book._initialized.fill_(1.0)
            book.register_buffer("_embedding", None, persistent=False)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/mimi"))
    parser.add_argument("--full", action="store_true", help="the published (full-size) config")
    parser.add_argument("--weights", type=Path, help="load these weights instead of random ones")
    parser.add_argument("--frames", type=int, default=8, help="frames of input (the last partial)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = _mimi_config if args.full else TINY_CONFIG
    torch.manual_seed(args.seed)  # the default initialisation too, for reproducible fixtures
    model = get_mimi(None, config, num_codebooks=NUM_CODEBOOKS)
    model.eval()
    pcm = test_signal(args.frames, args.seed)
    if args.weights:
        model.load_state_dict(load_file(str(args.weights)))
    else:
        randomize(model, pcm, args.seed)

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.weights:
        save_file(published_state_dict(model), str(args.out / "weights.safetensors"))
    (args.out / "config.json").write_text(json.dumps(config, indent=1))

    latent = model._encode_to_unquantized_latent(pcm)
    codes = model.encode(pcm)
    generator = torch.Generator().manual_seed(args.seed + 1)
    bins = config["quantizer"]["bins"]
    given_codes = torch.randint(0, bins, codes.shape, generator=generator)
    np.savez(
        args.out / "golden.npz",
        pcm=pcm.numpy(),
        latent=latent.numpy(),
        codes=codes.numpy().astype(np.int32),
        decoded=model.decode(codes).numpy(),
        given_codes=given_codes.numpy().astype(np.int32),
        decoded_given=model.decode(given_codes).numpy(),
    )
    print(f"wrote {args.out}: latent {tuple(latent.shape)}, codes {tuple(codes.shape)}")


if __name__ == "__main__":
    main()
