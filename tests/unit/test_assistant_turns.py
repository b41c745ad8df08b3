"""The assistant's turn logic (`TurnTaker`), its history and the LLM text cleaned for speech,
as pure functions of scripted inputs."""

from __future__ import annotations

from moshi_mlx.assistant.history import CUT_OFF_MARK, GREETING_REQUEST, History
from moshi_mlx.assistant.speech_text import SpokenWords, clean_for_speech
from moshi_mlx.assistant.turns import (
    AnswerEnded,
    CloseSpeech,
    FlushStt,
    Speak,
    StartReply,
    State,
    StopReply,
    TurnRules,
    TurnTaker,
    UserSaid,
    UserStarted,
)

SPEAKING = (0.0, 0.0, 0.01)  # the pause heads: head 2 says "not done"
DONE = (0.0, 0.0, 0.9)
UNSURE = (0.0, 0.0, 0.3)


def _user_turn(turns: TurnTaker, text: str, start: float = 2.0) -> list:
    """The user says `text`, one word a step, then pauses; the flush ends."""
    actions = []
    for i, word in enumerate(text.split()):
        actions += turns.listen(start + 0.08 * i, [word], SPEAKING)
    actions += turns.listen(start + 1.0, [], DONE)
    return actions + turns.flushed()


def test_the_turn_ends_when_the_pause_head_passes_the_threshold():
    turns = TurnTaker(History("Be brief."))
    assert turns.listen(2.0, ["hello"], SPEAKING) == [UserStarted(2.0)]
    assert turns.state is State.USER_SPEAKING
    assert turns.listen(2.08, [], UNSURE) == []  # 0.3 < 0.6: a breath
    assert turns.listen(2.16, [], DONE) == [FlushStt()]
    assert turns.state is State.FLUSHING
    assert turns.listen(2.2, ["there"], DONE) == []  # the flush brings the last word out
    actions = turns.flushed()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    assert actions == [UserSaid("hello there"), StartReply(messages)]
    assert turns.state is State.ANSWERING


def test_the_first_second_of_the_stream_and_silence_without_words_end_no_turn():
    turns = TurnTaker(History(""), TurnRules(ignore_start=1.0))
    assert turns.listen(0.5, [], DONE) == []  # nobody spoke
    assert turns.listen(0.6, ["hi"], SPEAKING) == [UserStarted(0.6)]
    assert turns.listen(0.9, [], DONE) == []  # inside the first second: not read
    assert turns.listen(1.0, [], DONE) == [FlushStt()]


def test_without_pause_heads_a_gap_between_words_ends_the_turn():
    """kyutai/stt-2.6b-en has no pause heads: `word_gap` seconds without a word end the turn;
    while answering, a word barges in."""
    turns = TurnTaker(History(""), TurnRules(word_gap=1.0))
    assert turns.listen(0.5, [], ()) == []  # nobody spoke
    assert turns.listen(3.0, ["hello"], ()) == [UserStarted(3.0)]
    assert turns.listen(3.5, ["there"], ()) == []
    assert turns.listen(4.42, [], ()) == []  # 0.92 s since the last word
    assert turns.listen(4.5, [], ()) == [FlushStt()]
    assert turns.listen(4.58, ["friend"], ()) == []  # the flush brings the last word
    assert turns.flushed()[0] == UserSaid("hello there friend")
    assert turns.state is State.ANSWERING
    assert turns.listen(4.66, [], ()) == []  # silence does not stop the answer
    assert turns.listen(9.08, ["wait"], ()) == [UserStarted(9.08), StopReply("")]


def test_the_thresholds_are_settings():
    turns = TurnTaker(History(""), TurnRules(pause_threshold=0.2, ignore_start=0.0))
    turns.listen(0.0, ["hi"], SPEAKING)
    assert turns.listen(0.08, [], UNSURE) == [FlushStt()]


def test_a_flush_that_brings_no_words_goes_back_to_listening():
    turns = TurnTaker(History(""))
    turns.listen(2.0, [" "], SPEAKING)  # blank words are no words
    assert turns.state is State.LISTENING
    turns.state = State.FLUSHING
    assert turns.flushed() == []
    assert turns.state is State.LISTENING


def test_llm_words_stream_into_the_tts_whole_and_clean_and_the_answer_joins_the_history():
    turns = TurnTaker(History(""))
    _user_turn(turns, "tell me")
    spoken = []
    for piece in ["**Sure", "!** Here", " is", " a [link](http://x.y) 😀", " and `code`"]:
        spoken += turns.reply_text(piece)
    spoken += turns.reply_ended()
    assert spoken == [
        Speak("Sure! "),
        Speak("Here "),
        Speak("is a link "),
        Speak("and "),
        CloseSpeech("code"),
    ]
    assert turns.state is State.ANSWERING  # until the speaker has played it
    assert turns.speech_done() == [AnswerEnded("Sure! Here is a link and code", cut_off=False)]
    assert turns.history.messages()[-1] == {
        "role": "assistant",
        "content": "Sure! Here is a link and code",
    }
    assert turns.state is State.LISTENING


def test_barge_in_stops_the_answer_and_keeps_what_was_heard_marked_cut_off():
    turns = TurnTaker(History(""))
    _user_turn(turns, "tell me a story")
    turns.reply_text("Once upon a time there was ")
    turns.heard("Once upon")
    assert turns.listen(5.0, [], DONE) == []  # the user is silent: no barge-in
    actions = turns.listen(5.08, ["wait"], SPEAKING)
    cut = AnswerEnded("Once upon", cut_off=True)
    assert actions == [UserStarted(5.08), StopReply("Once upon"), cut]
    assert turns.state is State.USER_SPEAKING
    assert turns.reply_text("a dragon ") == []  # the cancelled LLM's last piece is ignored
    actions = _user_turn(turns, "stop", start=5.16)
    assert actions[:2] == [FlushStt(), UserSaid("wait stop")]
    assert turns.history.messages() == [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": f"Once upon{CUT_OFF_MARK}"},
        {"role": "user", "content": "wait stop"},
    ]


def test_a_confident_speaking_from_the_pause_head_barges_in_too():
    turns = TurnTaker(History(""), TurnRules(barge_in_below=0.05))
    _user_turn(turns, "hello")
    assert turns.listen(4.0, [], UNSURE) == []
    # nothing heard yet: no answer
    assert turns.listen(4.08, [], SPEAKING) == [UserStarted(4.08), StopReply()]
    assert turns.state is State.USER_SPEAKING
    off = TurnTaker(History(""), TurnRules(barge_in_below=0.0))
    _user_turn(off, "hello")
    assert off.listen(4.08, [], SPEAKING) == []


def test_an_answer_cut_before_it_was_heard_leaves_the_user_turns_joined():
    turns = TurnTaker(History(""))
    _user_turn(turns, "what is")
    turns.listen(4.0, ["the"], SPEAKING)
    _user_turn(turns, "time", start=4.08)
    assert turns.history.messages() == [{"role": "user", "content": "what is the time"}]


def test_an_answer_that_cannot_be_spoken_goes_back_to_listening_and_leaves_no_trace():
    turns = TurnTaker(History(""))
    _user_turn(turns, "hello")
    turns.reply_text("Hi the")
    turns.reply_failed()
    assert turns.state is State.LISTENING
    assert turns.reply_text("re.") == [] and turns.speech_done() == []
    actions = _user_turn(turns, "anyone", start=4.0)
    assert actions[-1] == StartReply([{"role": "user", "content": "hello anyone"}])


def test_greeting_asks_the_llm_to_speak_first():
    turns = TurnTaker(History("sys"))
    [start] = turns.greet()
    assert start.messages[-1] == {"role": "user", "content": GREETING_REQUEST}
    assert turns.state is State.ANSWERING


def test_a_long_history_loses_its_oldest_turns_never_the_system_prompt():
    history = History("system prompt")
    for i in range(6):
        history.add("user", f"question {i}")
        history.add("assistant", f"answer {i}")

    def count(messages):
        return sum(len(m["content"].split()) for m in messages)

    turns = TurnTaker(history, count_tokens=count, token_limit=12)
    [*_, start] = _user_turn(turns, "last one")
    assert start.messages[0] == {"role": "system", "content": "system prompt"}
    assert start.messages[1]["role"] == "user"
    assert start.messages[-1] == {"role": "user", "content": "last one"}
    assert count(start.messages) <= 12
    assert len(start.messages) == 6  # system, 2 old pairs, the new question
    assert turns.trimmed_turns == 8


def test_spoken_words_wait_for_a_space_and_for_a_link_to_close():
    words = SpokenWords()
    assert words.add("Hel") == ""
    assert words.add("lo wor") == "Hello "
    assert words.add("ld, see [the") == "world, see "
    assert words.add(" docs](https://a.b/c d) now") == "the docs "
    assert words.finish() == "now"


def test_clean_for_speech_drops_markdown_and_emoji():
    text = "# Title\n- one 🎉\n2. two **bold** _it_ ~~x~~ > quote 👍🏽 ok"
    assert clean_for_speech(text).strip() == "Title one two bold it x quote ok"


def test_a_client_drives_the_turns():
    """`/v1/realtime` with turn detection off: the head never ends the turn, `commit` does,
    and no answer starts until `respond`; `cancel` stops it as heard."""
    rules = TurnRules(ignore_start=0.0, ends_turns=False, replies=False)
    turns = TurnTaker(History("Be brief."), rules)
    assert turns.listen(0.0, ["hi"], SPEAKING) == [UserStarted(0.0)]
    assert turns.listen(0.08, [], DONE) == []  # the head is not read
    assert turns.commit() == [FlushStt()]
    assert turns.flushed() == [UserSaid("hi")]  # no answer yet
    assert turns.state is State.LISTENING
    actions = turns.respond()
    assert len(actions) == 1 and isinstance(actions[0], StartReply)
    assert turns.respond() == []  # one answer at a time
    turns.reply_text("Hello there friend ")
    turns.heard("Hello")
    assert turns.cancel() == [StopReply("Hello"), AnswerEnded("Hello", cut_off=True)]
    assert turns.state is State.LISTENING and turns.cancel() == []


def test_an_empty_commit_says_so_and_clear_forgets_words():
    turns = TurnTaker(History(""), TurnRules(ignore_start=0.0, replies=False))
    assert turns.commit() == [FlushStt()]
    assert turns.flushed() == [UserSaid("")]  # the client learns its commit is done
    turns.listen(0.0, ["lost"], SPEAKING)
    turns.clear()
    assert turns.state is State.LISTENING
    turns.listen(0.08, ["kept"], SPEAKING)
    turns.commit()
    assert turns.flushed() == [UserSaid("kept")]


def test_no_barge_in_when_the_rules_say_so():
    turns = TurnTaker(History(""), TurnRules(ignore_start=0.0, barge_in=False))
    turns.respond()
    assert turns.listen(1.0, ["wait"], SPEAKING) == []
    assert turns.state is State.ANSWERING


def test_a_response_with_no_user_turn_greets_and_takes_its_own_instructions():
    turns = TurnTaker(History("Be brief."), TurnRules(replies=False))
    (start,) = turns.respond("Say hello in French.")
    assert start.messages == [
        {"role": "system", "content": "Say hello in French."},
        {"role": "user", "content": GREETING_REQUEST},
    ]
    assert turns.history.system == "Be brief."  # for this answer only
