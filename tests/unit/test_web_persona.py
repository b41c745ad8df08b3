"""`moshi_mlx.serve.chat.persona`: what a client may choose on `/api/chat`, and `/api/persona`'s JSON.
(The server with a PersonaPlex model: tests/e2e/test_web_server.py.)"""

from __future__ import annotations

import pytest

from moshi_mlx.chat.persona.role import DEFAULT_ROLE, EXAMPLE_ROLES
from moshi_mlx.serve.chat.persona import MAX_ROLE_CHARS, PersonaOptions, prompt_choice
from moshi_mlx.serve.chat.protocol import ProtocolError

PERSONAPLEX = PersonaOptions(prompted=True, voices=("NATF2", "NATM1"))
MOSHI = PersonaOptions()


def test_a_published_voice_with_or_without_pt_and_any_role():
    assert prompt_choice({}, PERSONAPLEX) == (None, None)  # the server's defaults
    assert prompt_choice({"voice_prompt": "NATM1.pt"}, PERSONAPLEX) == ("NATM1", None)
    assert prompt_choice({"voice_prompt": "NATM1"}, PERSONAPLEX) == ("NATM1", None)
    assert prompt_choice({"voice_prompt": ""}, PERSONAPLEX) == (None, None)
    query = {"voice_prompt": "NATF2.pt", "text_prompt": "You are a tutor. Ça va ? 🙂"}
    assert prompt_choice(query, PERSONAPLEX) == ("NATF2", "You are a tutor. Ça va ? 🙂")
    assert prompt_choice({"text_prompt": ""}, PERSONAPLEX) == (None, "")  # no role, as NVIDIA's
    assert prompt_choice({"text_prompt": "x" * MAX_ROLE_CHARS}, PERSONAPLEX)[1] is not None


@pytest.mark.parametrize(
    "voice",
    [
        "../x",
        "/etc/passwd",
        "NATF2/../../x",
        "NATF2.pt/../NATF2.pt",
        "..",
        "./NATF2.pt",
        "voices/NATF2.pt",
        "NATF2.wav",
        "NATF2.pt.pt",
        "natf2",
        "NOPE",
        "C:\\NATF2",
        "NATF2\x00",
        "x" * 5000,
    ],
)
def test_a_voice_is_only_a_published_name(voice):
    with pytest.raises(ProtocolError) as refused:
        prompt_choice({"voice_prompt": voice}, PERSONAPLEX)
    reason = str(refused.value)
    assert "voice_prompt must name a voice (NATF2, NATM1)" in reason, reason
    assert "\n" not in reason and len(reason) < 200, reason


@pytest.mark.parametrize(
    ("role", "reason"),
    [
        ("x" * (MAX_ROLE_CHARS + 1), f"is {MAX_ROLE_CHARS + 1} characters long; the limit is"),
        ("You are\na tutor.", "control characters"),
        ("tab\there", "control characters"),
        ("bell\x07", "control characters"),
        ("@/etc/passwd", "may not start with @"),
    ],
)
def test_bad_roles_are_refused(role, reason):
    with pytest.raises(ProtocolError, match=reason):
        prompt_choice({"text_prompt": role}, PERSONAPLEX)


def test_moshi_refuses_a_persona_but_not_empty_parameters():
    assert prompt_choice({"voice_prompt": "", "text_prompt": ""}, MOSHI) == (None, None)
    for query in ({"voice_prompt": "NATF2.pt"}, {"text_prompt": "You are a tutor."}):
        with pytest.raises(ProtocolError, match="this server's model is Moshi, which takes"):
            prompt_choice(query, MOSHI)


def test_the_endpoints_json():
    assert MOSHI.as_json() == {"prompted": False, "voices": []}
    assert PERSONAPLEX.as_json() == {
        "prompted": True,
        "voices": ["NATF2", "NATM1"],
        "default_voice": "NATF2",
        "default_role": DEFAULT_ROLE,
        "example_roles": list(EXAMPLE_ROLES),
        "max_role_chars": MAX_ROLE_CHARS,
    }
