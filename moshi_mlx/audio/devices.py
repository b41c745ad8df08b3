"""Finding sound devices through `sounddevice` (PortAudio), with user-facing errors."""

from __future__ import annotations

from types import ModuleType

from moshi_mlx.errors import AudioError, Setting

LIST_DEVICES = Setting("format_devices()")  # where the devices are listed (a flag: --list-devices)

_PORTAUDIO_HINT = (
    "install PortAudio (Debian/Ubuntu: apt install libportaudio2; macOS: brew install portaudio)"
)


def import_sounddevice() -> ModuleType:
    """Import `sounddevice`, turning a missing PortAudio library into an `AudioError`."""
    try:
        import sounddevice
    except OSError as exc:  # raised by sounddevice when libportaudio cannot be loaded
        raise AudioError(f"PortAudio is not available ({exc}); {_PORTAUDIO_HINT}") from None
    except ImportError:
        raise AudioError("the sounddevice package is missing: pip install sounddevice") from None
    return sounddevice


def _devices(sd: ModuleType) -> list[dict]:
    try:
        return [dict(d) for d in sd.query_devices()]
    except sd.PortAudioError as exc:
        raise AudioError(
            f"PortAudio cannot list sound devices ({exc}); {_PORTAUDIO_HINT}"
        ) from None


def format_devices() -> str:
    """A table of all sound devices, marking the defaults with '*'."""
    sd = import_sounddevice()
    devices = _devices(sd)
    if not devices:
        return "no sound devices found"
    default_in, default_out = sd.default.device
    lines = ["  idx  in  out  name"]
    for i, dev in enumerate(devices):
        mark = "*" if i in (default_in, default_out) else " "
        lines.append(
            f"{mark}{i:4d} {dev['max_input_channels']:3d} {dev['max_output_channels']:4d}  "
            f"{dev['name']}"
        )
    return "\n".join(lines)


def resolve_device(spec: str | int | None, kind: str) -> int:
    """The index of the `kind` ("input" or "output") device given by index or name substring.

    With no `spec`, the system default device of that kind.
    """
    sd = import_sounddevice()
    devices = _devices(sd)
    channels_key = f"max_{kind}_channels"
    parameter = f"{kind}_device"
    usable = [i for i, dev in enumerate(devices) if dev[channels_key] > 0]
    if not usable:
        what = "microphone" if kind == "input" else "speaker or headphones"
        raise AudioError(
            f"no audio {kind} device found; connect a {what} "
            "(or start your sound server) and check with ",
            LIST_DEVICES,
        )
    if spec is None or spec == "":
        default = sd.default.device[0 if kind == "input" else 1]
        if isinstance(default, int) and default in usable:
            return default
        return usable[0]
    if isinstance(spec, int) or str(spec).isdigit():
        index = int(spec)
        if index not in usable:
            raise AudioError(
                f"device {index} is not an {kind} device; pick one of ",
                LIST_DEVICES,
                " as ",
                Setting(parameter),
                parameter=parameter,
            )
        return index
    needle = str(spec).lower()
    matches = [i for i in usable if needle in devices[i]["name"].lower()]
    exact = [i for i in matches if devices[i]["name"].lower() == needle]
    if exact:
        return exact[0]
    if not matches:
        raise AudioError(
            f"no {kind} device name contains {spec!r}; see ",
            LIST_DEVICES,
            " and pass ",
            Setting(parameter),
            parameter=parameter,
        )
    return matches[0]


def device_name(index: int) -> str:
    """The name of device `index`."""
    sd = import_sounddevice()
    return str(sd.query_devices(index)["name"])


def open_failure(kind: str, index: int, reason: Exception) -> AudioError:
    """The one-line error for a `kind` ("input" or "output") device that PortAudio cannot open
    in Moshi's format (24 kHz mono)."""
    return AudioError(
        f"cannot open {kind} device {index} ({device_name(index)}) at 24000 Hz, "
        f"mono: {reason}; choose another ",
        Setting(f"{kind}_device"),
        " (see ",
        LIST_DEVICES,
        ")",
        parameter=f"{kind}_device",
    )
