"""moshi_mlx: Kyutai's Moshi family (Moshi, PersonaPlex, Hibiki, STT, TTS) on MLX.

    import moshi_mlx

    model = moshi_mlx.load("kyutai/moshiko-mlx-q4")  # or a local folder laid out like a repo

`load`, `MoshiModel`, `SttModel` and `TtsModel` are imported on first use, so that
`import moshi_mlx.errors` stays light.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moshi_mlx.api import load
    from moshi_mlx.chat.model import MoshiModel
    from moshi_mlx.stt.transcriber import SttModel
    from moshi_mlx.tts.synthesizer import TtsModel

__version__ = "0.1.0"
__all__ = ["MoshiModel", "SttModel", "TtsModel", "load"]
_LAZY = {
    "load": "moshi_mlx.api",
    "MoshiModel": "moshi_mlx.chat.model",
    "SttModel": "moshi_mlx.stt.transcriber",
    "TtsModel": "moshi_mlx.tts.synthesizer",
}


def __getattr__(name: str) -> Any:
    """PEP 562: the public API, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'moshi_mlx' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
