#!/usr/bin/env bash
# Builds the reference environments that some tests and the bench compare against:
#   /opt/venvs/ref          PyTorch (CPU) + Kyutai's `moshi` 0.2.13 and `hibiki-zero` 0.0.4: the
#                           truth for numerics
#   /opt/venvs/kyutai       Kyutai's `moshi_mlx` 0.3.0 on mlx 0.26.5: side-by-side speed
#   /opt/venvs/personaplex  PyTorch (CPU) + NVIDIA's PersonaPlex package (its `moshi/` folder,
#                           not on PyPI: clone https://github.com/NVIDIA/personaplex and pass
#                           the clone as PERSONAPLEX_SRC=/path/to/personaplex)
#   /opt/venvs/unmute       Kyutai's Unmute backend on Python 3.12, pinned by its uv.lock (clone
#                           https://github.com/kyutai-labs/unmute, pass UNMUTE_SRC=/path/to/it;
#                           see scripts/make_unmute_env.sh)
# Tests that need one skip without it and name this script. Usage (as root, ~2 GB each):
#   ./scripts/make_reference_envs.sh [ref|kyutai|personaplex|unmute]...   (default: ref and kyutai)
set -euo pipefail
root=${MOSHI_MLX_REFERENCE_ENVS:-/opt/venvs}
targets=("$@")
[ "${#targets[@]}" -gt 0 ] || targets=(ref kyutai)
pip_quiet=(-q --disable-pip-version-check)
for target in "${targets[@]}"; do
    case "$target" in
    ref)
        python3 -m venv "$root/ref"
        # The CPU build; where that index cannot be reached, a locally provided torch 2.13.0.
        "$root/ref/bin/pip" install "${pip_quiet[@]}" --retries 0 --timeout 10 torch \
            --index-url https://download.pytorch.org/whl/cpu \
            || "$root/ref/bin/pip" install "${pip_quiet[@]}" torch==2.13.0
        "$root/ref/bin/pip" install "${pip_quiet[@]}" --no-deps moshi==0.2.13
        # moshi 0.2.13's own pins (its bitsandbytes is for CUDA and not needed here)
        "$root/ref/bin/pip" install "${pip_quiet[@]}" "numpy>=1.26,<2.3" "safetensors>=0.4,<0.8" \
            einops sentencepiece "huggingface_hub>=0.24,<1.0" "aiohttp>=3.10.5,<3.12" sphn \
            sounddevice==0.5
        # Hibiki-Zero's inference code (hibiki_zero/inference.py drives LMGen); its gradio and
        # jupyter pins are for its demo and notebooks, IPython is what its modules import.
        "$root/ref/bin/pip" install "${pip_quiet[@]}" --no-deps hibiki-zero==0.0.4
        "$root/ref/bin/pip" install "${pip_quiet[@]}" ipython typer
        ;;
    kyutai)
        python3 -m venv "$root/kyutai"
        extra=()
        [ "$(uname -s)" = Linux ] && extra=(mlx-cpu==0.26.5)
        "$root/kyutai/bin/pip" install "${pip_quiet[@]}" mlx==0.26.5 "${extra[@]}"
        "$root/kyutai/bin/pip" install "${pip_quiet[@]}" --no-deps moshi_mlx==0.3.0
        # moshi_mlx 0.3.0's own pins
        "$root/kyutai/bin/pip" install "${pip_quiet[@]}" "numpy>=2.1,<2.3" "safetensors>=0.4,<0.6" \
            sentencepiece==0.2 sounddevice==0.5 "huggingface_hub>=0.24,<0.29" \
            "aiohttp>=3.10.5,<3.12" rustymimi sphn
        ;;
    personaplex)
        src=${PERSONAPLEX_SRC:?set PERSONAPLEX_SRC to a clone of github.com/NVIDIA/personaplex}
        [ -f "$src/moshi/pyproject.toml" ] || { echo "no moshi/pyproject.toml in $src" >&2; exit 2; }
        python3 -m venv "$root/personaplex"
        "$root/personaplex/bin/pip" install "${pip_quiet[@]}" --retries 0 --timeout 10 torch \
            --index-url https://download.pytorch.org/whl/cpu \
            || "$root/personaplex/bin/pip" install "${pip_quiet[@]}" torch==2.13.0
        # Its pins ask for torch < 2.5, which has no build for this Python: its code runs on
        # the torch above. pyloudnorm (voice prompts) and tqdm are imported but not declared.
        "$root/personaplex/bin/pip" install "${pip_quiet[@]}" --no-deps "$src/moshi"
        "$root/personaplex/bin/pip" install "${pip_quiet[@]}" "numpy>=1.26,<2.2" \
            "safetensors>=0.4,<0.5" einops sentencepiece "huggingface_hub>=0.24,<0.25" \
            "sphn>=0.1.4,<0.2" "aiohttp>=3.10.5,<3.11" sounddevice pyloudnorm tqdm
        ;;
    unmute)
        MOSHI_MLX_REFERENCE_ENVS="$root" "$(dirname "$0")/make_unmute_env.sh"
        ;;
    *) echo "unknown environment '$target' (ref, kyutai, personaplex or unmute)" >&2; exit 2 ;;
    esac
done
