"""Names a user could have typed that were renamed or removed answer with what replaced them."""

import importlib

import pytest

MOVED = [
    ("moshi_mlx.runtime.sampling", "SamplingConfig", "Sampling"),
    ("moshi_mlx.chat.generate", "LmGen", "ChatStepper"),
    ("moshi_mlx.chat.generate", "LmGenStep", "StepOutput"),
    ("moshi_mlx.chat.generate", "StepFunctions", "ChatStepFunction"),
    ("moshi_mlx.chat.generate", "step_functions", "ChatStepFunction"),
    ("moshi_mlx.stt.stepper", "ListenStepper", "SttStepper"),
    ("moshi_mlx.stt.stepper", "ListenStepFunction", "SttStepFunction"),
    ("moshi_mlx.stt.stepper", "ListenStep", "StepOutput"),
    ("moshi_mlx.stt.stepper", "TextSampling", "Sampling"),
    ("moshi_mlx.tts.stepper", "TtsSampling", "Sampling"),
    ("moshi_mlx.tts.stepper", "TtsStepFunctions", "TtsStepFunction"),
    ("moshi_mlx.tts.stepper", "TtsStepOutput", "StepOutput"),
]


@pytest.mark.parametrize(("module", "name", "replacement"), MOVED)
def test_a_removed_name_says_what_replaced_it(module, name, replacement):
    with pytest.raises(ImportError, match=rf"^{name}\b.* is now .*{replacement}") as raised:
        exec(f"from {module} import {name}", {})  # noqa: S102 (the statement a user types)
    assert "\n" not in str(raised.value)  # one line
    with pytest.raises(ImportError, match=replacement):
        getattr(importlib.import_module(module), name)


def test_other_missing_names_are_plain_attribute_errors():
    module = importlib.import_module("moshi_mlx.chat.generate")
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        module.Nothing  # noqa: B018
    assert not hasattr(module, "Nothing")
