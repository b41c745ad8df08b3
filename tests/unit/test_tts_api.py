"""The TTS API (`TtsModel.synthesize`, `TtsModel.stream`) on the tiny random checkpoint of
tests/fixtures/tts (PyTorch's greedy runs in golden_generate.json) with a random full-size
Mimi: text streamed in word by word, batches of voices, and the refusals of bad voices and
options."""

from __future__ import annotations

import itertools
import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file
from tiny_moshi import load_tiny_tts

from moshi_mlx.checkpoints.hub import WEIGHTS_ENV
from moshi_mlx.errors import MoshiError, TtsError
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.tts.synthesizer import SKIPPED_FRAMES, TtsModel, TtsRequest, TtsRun, TtsStream
from moshi_mlx.tts.voices import DEFAULT_VOICE, voice_file_name

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts"
ALICE = FIXTURES / "voices" / "alice.safetensors"
BOB = FIXTURES / "voices" / "bob.safetensors"
# Row 0 of PyTorch's "batch" run: alice, cfg 2.0, greedy; a pause in the middle.
GOLDEN = json.loads((FIXTURES / "golden_generate.json").read_text())["runs"]["batch"]["rows"][0]


@pytest.fixture(scope="module")
def model(full_mimi_checkpoint) -> TtsModel:
    return load_tiny_tts(full_mimi_checkpoint)


def _first_audio_step(model: TtsModel) -> int:
    """The step whose frame is the first one played."""
    return model.config.max_delay + model.delay_steps + SKIPPED_FRAMES


# --- streaming text in ---------------------------------------------------------------------

STREAMED = "Hello there, how are you today?"


def test_speech_starts_before_the_last_word_arrives(model):
    """Words come one every GAP steps (pushed between the frames the stream yields, on this
    thread); the audio of the first words plays while later ones have not come, and after
    `close` the stream ends with every word spoken."""
    words = STREAMED.split()
    gap = 6
    stream = model.stream(ALICE, text_sampling=GREEDY, audio_sampling=GREEDY, seed=3)
    stream.push(words[0] + " ")
    pushed, heard, yields = 1, [], []
    heard_at_last_word = spoken_at_last_word = None
    for frame in stream.frames():
        yields.append(frame)
        if frame is not None:
            assert frame.shape == (FRAME_SIZE,) and frame.dtype == np.float32
            heard.append(frame)
        if pushed < len(words) and stream.run.step_index >= pushed * gap:
            if pushed == len(words) - 1:
                heard_at_last_word = len(heard) * FRAME_SIZE / 24_000  # seconds
                spoken_at_last_word = list(stream.words)
            stream.push(words[pushed] + " ")
            pushed += 1
            if pushed == len(words):
                stream.close()
    assert pushed == len(words) and stream.run.finished
    # Audio was out before the last word came, and it held the first word's start.
    assert heard_at_last_word > 0, "no audio before the last word was pushed"
    assert 0 < len(spoken_at_last_word) < len(words)
    assert spoken_at_last_word[0][0] == "Hello"
    assert spoken_at_last_word[-1][1] < heard_at_last_word
    # None only while waiting before the audio starts: then one frame per step, no gaps.
    # (The first word waits for the one two ahead, the model's lookahead: Nones first.)
    first = next(i for i, frame in enumerate(yields) if frame is not None)
    assert first > 0 and all(frame is not None for frame in yields[first:])
    assert [word for word, _ in stream.words] == words
    times = [start for _, start in stream.words]
    assert times == sorted(times) and len(set(times)) == len(times)
    # The audio is the stream's `end_step` frames, the last word's start inside it.
    end_step = stream.run.schedules[0].end_step
    assert len(heard) == end_step
    assert times[-1] < end_step * FRAME_SIZE / 24_000
    pcm = np.concatenate(heard)
    assert np.isfinite(pcm).all() and np.abs(pcm).max() <= 1


def _pushed_at_once(stream: TtsStream, step: int) -> None:
    if step == 0:
        stream.push(GOLDEN["text"])
        stream.close()


def _word_by_word_ahead(stream: TtsStream, step: int) -> None:
    """One push per word (the break tag's two halves included), all before step 0."""
    if step == 0:
        for word in GOLDEN["text"].split(" "):
            stream.push(word + " ")
        stream.close()


def _word_by_word_just_in_time(stream: TtsStream, step: int) -> None:
    """Each word pushed at the step the model would otherwise wait for it."""
    queue = vars(stream).setdefault("test_queue", GOLDEN["text"].split(" "))
    schedule = stream.run.schedules[0]
    while schedule.needs_text and not schedule.closed:
        if queue:
            stream.push(queue.pop(0) + " ")
        else:
            stream.close()


def _split_inside_a_word(stream: TtsStream, step: int) -> None:
    if step == 0:
        text = GOLDEN["text"]
        assert text.startswith("Hello ")
        for fragment in ("Hel", "lo ", text[len("Hello ") :]):
            stream.push(fragment)
        stream.close()


def _split_inside_the_break_tag(stream: TtsStream, step: int) -> None:
    """The text cut in the middle of `<break time="0.5s"/>`, the second half late."""
    text = GOLDEN["text"]
    cut = text.index("0.5s")
    if step == 0:
        stream.push(text[:cut])
    elif step == 6:
        stream.push(text[cut:])
        stream.close()


FEEDS: dict[str, Callable[[TtsStream, int], None]] = {
    "at_once": _pushed_at_once,
    "word_by_word_ahead": _word_by_word_ahead,
    "word_by_word_just_in_time": _word_by_word_just_in_time,
    "split_word": _split_inside_a_word,
    "split_break_tag": _split_inside_the_break_tag,
}


@pytest.mark.parametrize("feed", FEEDS)
def test_text_pushed_in_pieces_gives_pytorchs_greedy_tokens(model, feed):
    """However the text comes (in time), the stream's entries are those of the whole text (the
    speaker token only on the first word) and its greedy tokens are PyTorch's, step for step,
    until this request's own end (PyTorch's row ran on with a longer one beside it)."""
    stream = model.stream(
        ALICE, cfg_coef=GOLDEN["cfg"], text_sampling=GREEDY, audio_sampling=GREEDY
    )
    logged, frames = [], []
    while not stream.run.finished:
        FEEDS[feed](stream, stream.run.step_index)
        tokens = stream.run.step_tokens()
        logged.append([tokens.predicted[0], tokens.fed[0]])
        if tokens.frame is not None:
            frames.append(np.array(tokens.frame[0]).tolist())
    schedule = stream.run.schedules[0]
    assert schedule._entries == model.entries(GOLDEN["text"])
    assert [
        {"tokens": list(entry.tokens), "text": entry.text, "padding": entry.padding}
        for entry in schedule._entries
    ] == GOLDEN["entries"]
    steps = GOLDEN["end_step"] + model.delay_steps + 4  # Kyutai's final padding
    assert len(logged) == steps
    assert logged == GOLDEN["logged_text_tokens"][:steps]
    assert frames == GOLDEN["frames"][: len(frames)] and len(frames) == steps - 2
    assert schedule.end_step == GOLDEN["end_step"]
    assert schedule.consumption_times == GOLDEN["consumption_times"]
    assert [list(word) for word in schedule.transcript] == GOLDEN["transcript"]


def test_words_are_cut_at_spaces_outside_break_tags(model):
    """Complete words enter the schedule at once; a word or a break tag not ended yet waits;
    `<` and `>` that start no break tag are text."""
    stream = model.stream(ALICE)
    schedule = stream.run.schedules[0]

    def texts() -> list[str]:
        return [entry.text for entry in schedule._entries]

    stream.push("3 > 2 and 1 <")
    assert texts() == ["3", ">", "2", "and", "1"]
    stream.push(" 2 is tr")
    assert texts()[-3:] == ["<", "2", "is"]
    stream.push('ue <break time="0')
    assert texts()[-1] == "true"
    stream.push('.5s"/> ok')
    assert texts()[-2:] == ["true", ""]  # the pause
    assert schedule._entries[-1].padding == 6
    stream.close()
    assert texts()[-1] == "ok" and schedule.closed
    with pytest.raises(TtsError, match="after the end of the text"):
        stream.push("more ")


# --- batches ---------------------------------------------------------------------------------

TEXTS = ("Hello there.", "How are you?")


def _end_steps(model: TtsModel, requests: list[TtsRequest], seed: int) -> list[int | None]:
    """The end steps of a run like `synthesize`'s, without decoding audio."""
    run = TtsRun(model, requests, seed=seed)
    for request, schedule in zip(requests, run.schedules):
        schedule.push(model.entries(request.text))
        schedule.close()
    while not run.finished:
        run.step_tokens()
    return [schedule.end_step for schedule in run.schedules]


def test_synthesize_a_batch_of_two_voices(model):
    requests = [TtsRequest(TEXTS[0], (ALICE,)), TtsRequest(TEXTS[1], (BOB,), cfg_coef=1.5)]
    speeches = model.synthesize(requests, seed=5)
    end_steps = _end_steps(model, requests, seed=5)
    assert len(speeches) == 2
    for speech, text, end_step in zip(speeches, TEXTS, end_steps):
        assert speech.complete and end_step is not None
        assert speech.pcm.dtype == np.float32 and speech.pcm.shape == (end_step * FRAME_SIZE,)
        assert np.isfinite(speech.pcm).all() and np.abs(speech.pcm).max() <= 1
        assert np.abs(speech.pcm).max() > 0
        assert [word for word, _ in speech.words] == text.split()
        times = [start for _, start in speech.words]
        assert times[0] == 0.0 and all(a < b for a, b in itertools.pairwise(times))
        assert times[-1] < end_step * FRAME_SIZE / 24_000
    assert not np.array_equal(speeches[0].pcm[:FRAME_SIZE], speeches[1].pcm[:FRAME_SIZE])


def test_a_stream_speaks_as_synthesize_does(model):
    """One request, one seed: the stream given all the text at once yields `synthesize`'s
    audio and words."""
    [speech] = model.synthesize([TtsRequest("Hi.", (BOB,))], seed=5)
    stream = model.stream(BOB, seed=5)
    stream.push("Hi.")
    stream.close()
    frames = list(stream.frames())
    assert all(frame is not None for frame in frames)
    np.testing.assert_array_equal(np.concatenate(frames), speech.pcm)
    assert stream.words == speech.words


def test_a_step_budget_too_small_gives_incomplete_speech(model):
    max_steps = _first_audio_step(model) + 3
    [speech] = model.synthesize([TtsRequest(TEXTS[1], (ALICE,))], seed=1, max_steps=max_steps)
    assert not speech.complete
    assert speech.pcm.shape == (3 * FRAME_SIZE,)
    assert len(speech.words) < len(TEXTS[1].split())


# --- refusals --------------------------------------------------------------------------------


class _Trap:
    """Unpickling this creates the file `marker`: a stand-in for code in a voice file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _voice(path: Path, array: np.ndarray, name: str = "speaker_wavs") -> Path:
    save_file({name: array}, str(path))
    return path


def _junk(path: Path) -> Path:
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    return path


def _nan_voice(path: Path) -> Path:
    values = np.zeros((1, 16, 4), np.float32)
    values[0, 3, 2] = np.nan
    return _voice(path, values)


VOICES = {  # name: (write the file in a folder, what the error says)
    "missing": (lambda d: d / "nope.safetensors", "nope.safetensors not found"),
    "not_safetensors": (lambda d: _junk(d / "junk.safetensors"), "is not a readable safetensors"),
    "no_speaker_wavs": (
        lambda d: _voice(d / "other.safetensors", np.zeros((1, 16, 4), np.float32), "other"),
        "holds no 'speaker_wavs' tensor",
    ),
    "wrong_dim": (
        lambda d: _voice(d / "dim.safetensors", np.zeros((1, 8, 4), np.float32)),
        "has shape [1, 8, 4], this model needs [1, 16, frames]",
    ),
    "no_frames": (
        lambda d: _voice(d / "empty.safetensors", np.zeros((1, 16, 0), np.float32)),
        "has shape [1, 16, 0]",
    ),
    "nan": (lambda d: _nan_voice(d / "nan.safetensors"), "must hold finite floats"),
    "integers": (
        lambda d: _voice(d / "int.safetensors", np.zeros((1, 16, 4), np.int32)),
        "must hold finite floats",
    ),
}


@pytest.mark.parametrize("case", VOICES)
def test_a_bad_voice_file_is_refused_in_one_line(model, tmp_path, case):
    write, message = VOICES[case]
    path = write(tmp_path)
    with pytest.raises(TtsError) as caught:
        model.synthesize([TtsRequest("Hello.", (ALICE, path))])
    assert message in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)
    with pytest.raises(TtsError, match=message.replace("[", r"\[")):
        model.stream(path)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_a_half_precision_voice_is_cast_to_float32(model, tmp_path, dtype):
    """Kyutai's loader takes a voice of any floating dtype: so do we, cast to float32."""
    values = mx.load(str(ALICE))["speaker_wavs"].astype(dtype)
    path = tmp_path / "half.safetensors"
    mx.save_safetensors(str(path), {"speaker_wavs": values})
    voice = model.voice(path)
    assert voice.dtype == mx.float32
    assert mx.array_equal(voice, values[0].T.astype(mx.float32)).item()


def test_the_default_voice_comes_from_local_folders_or_is_named_in_one_line(
    model, tmp_path, monkeypatch
):
    """No voice given and no hub: the default voice's file in the weights folder or in a
    voice repo that is a folder; else one line naming the file, never a hub URL."""
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "weights"))
    name = voice_file_name(DEFAULT_VOICE, model.config)
    folder = tmp_path / "voices"
    folder.mkdir()
    local = replace(model, voice_repo=str(folder))
    with pytest.raises(TtsError) as caught:
        local.voice(DEFAULT_VOICE)
    message = str(caught.value)
    assert "no voice was given" in message and name in message and "\n" not in message
    assert "huggingface.co" not in message
    with pytest.raises(TtsError, match=f"{folder} has no expresso/other.0badf00d@7.safetensors"):
        local.voice("expresso/other")
    (folder / name).parent.mkdir(parents=True)
    shutil.copy(ALICE, folder / name)
    alice = model.voice(ALICE)
    assert mx.array_equal(local.voice(DEFAULT_VOICE), alice).item()
    in_weights = tmp_path / "weights" / name
    in_weights.parent.mkdir(parents=True)
    shutil.copy(BOB, in_weights)  # the weights folder comes first, for any voice repo
    assert mx.array_equal(model.voice(DEFAULT_VOICE), model.voice(BOB)).item()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_pickle_given_as_a_voice_is_never_loaded(model, tmp_path, suffix):
    marker = tmp_path / "code_ran"
    path = tmp_path / f"voice{suffix}"
    path.write_bytes(pickle.dumps(_Trap(marker)))
    with pytest.raises(TtsError) as caught:
        model.synthesize([TtsRequest("Hello.", (path,))])
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    if suffix == ".pt":
        assert "is not a .safetensors embedding" in str(caught.value)
    assert not marker.exists()


def test_bad_requests_are_refused_in_one_line(model):
    def refusal(requests) -> str:
        with pytest.raises(MoshiError) as caught:
            model.synthesize(requests)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "1 to 5 voices, got 6" in refusal([TtsRequest("Hello.", (ALICE,) * 6)])
    assert "1 to 5 voices, got 0" in refusal([TtsRequest("Hello.", ())])
    line = refusal([TtsRequest("Hello.", (ALICE,), cfg_coef=2.2)])
    assert "'cfg'" in line and "2.2" in line
    assert "1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0" in line
    assert "no request" in refusal([])
    assert "not a number of seconds" in refusal([TtsRequest('a <break time="1x5s"/> b', (ALICE,))])
