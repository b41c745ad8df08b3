"""Golden word times from Kyutai's own timing function, for tests/parity/test_stt_words.py.

Run with the reference environment (torch + sentencepiece), from the repository root, after
fetching github.com/kyutai-labs/delayed-streams-modeling (a bare git directory will do):

    /opt/venvs/ref/bin/python scripts/make_word_time_fixtures.py \
        [--kyutai-git /work/.mirror/kyutai-labs+delayed-streams-modeling/repo]

It reads `tokens_to_timestamped_text` (and the `TimestampedText` it returns) out of
scripts/stt_from_file_pytorch.py at the pinned commit, runs it on the token sequences below with
the tiny tokenizer of tests/fixtures/personaplex (<unk> 0, <s> 1, </s> 2, <pad> 3: Kyutai's
layout) and the offset Kyutai's `main` computes, and writes tests/fixtures/stt_words/golden.json:

    {"source": {"repository", "commit", "path", "function"},
     "tokenizer": path of the tokenizer, from the repository root,
     "cases": [{"name", "audio_delay", "silence_prefix", "tokens": [id, ...],
                "words": [[text, start, end], ...]          (what Kyutai's function returns)
                or "kyutai_error": "TypeError: ..."}]}      (when it raises instead)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import sentencepiece
import torch

KYUTAI_GIT = Path("/work/.mirror/kyutai-labs+delayed-streams-modeling/repo")
KYUTAI_COMMIT = "f6074cb684fcf3c46161f1c3abda3c0805e10d18"
KYUTAI_PATH = "scripts/stt_from_file_pytorch.py"
KYUTAI_FUNCTION = "tokens_to_timestamped_text"
TOKENIZER = "tests/fixtures/personaplex/tokenizer.model"
OUT = Path("tests/fixtures/stt_words/golden.json")

FRAME_RATE = 12.5
STT_1B = {"audio_delay": 0.5, "silence_prefix": 0.0}  # kyutai/stt-1b-en_fr's stt_config
STT_2B = {"audio_delay": 2.5, "silence_prefix": 1.0}  # kyutai/stt-2.6b-en's stt_config
MARKS = {"_": 3, "|": 0, "<s>": 1, "</s>": 2}  # padding, end of padding, start and end of text


def pad(n: int) -> list[str]:
    return ["_"] * n


CASES = [
    ("one_word_per_segment", STT_1B, pad(8) + ["|", "▁the", *pad(3), "|", "▁", "he", "ll", "o", *pad(2), "|", "▁you", *pad(7)]),
    ("padding_runs_and_empty_segments", STT_1B, pad(5) + ["|", *pad(4), "|", "|", "▁model", *pad(6), "|", "▁are", *pad(9)]),
    ("several_words_in_a_segment", STT_1B, pad(6) + ["|", "▁the", "▁model", "▁", "w", "eat", "her", *pad(2), "|", "▁nice", *pad(7)]),
    ("tokens_before_the_first_boundary_dropped", STT_1B, ["▁the", "▁model", *pad(4), "|", "▁talk", *pad(7)]),
    ("word_at_the_very_end", STT_1B, pad(7) + ["|", "▁and", *pad(2), "|", "▁speech"]),
    ("boundary_at_the_very_end", STT_1B, pad(7) + ["|", "▁like", *pad(3), "|"]),
    ("last_segment_cut_at_end_of_text", STT_1B, pad(7) + ["|", "▁moshi", "_", "</s>", "▁the", "_"]),
    ("start_and_end_tokens_inside_a_segment", STT_1B, pad(7) + ["|", "▁to", "<s>", "</s>", "_", "|", "▁you", *pad(3)]),
    ("times_clipped_at_zero", STT_1B, ["|", "▁the", "_", "|", "▁model", *pad(7)]),
    ("no_boundary_no_words", STT_1B, pad(3) + ["▁the", *pad(4)]),
    ("stray_word_marker", STT_1B, pad(7) + ["|", "▁", "he", "▁", "_", "|", "▁to", *pad(6)]),
    ("stt_2b_last_segment_under_a_second", STT_2B, pad(50) + ["|", "▁the", *pad(4), "|", "▁weather", *pad(6)]),
    ("stt_2b_several_words_and_end_of_text", STT_2B, pad(46) + ["|", "▁you", "▁like", "▁", "d", *pad(3), "|", "▁speech", *pad(2), "</s>", *pad(30)]),
    ("stt_2b_last_segment_over_a_second", STT_2B, pad(46) + ["|", "▁talk", *pad(5), "|", "▁to", "▁", "mo", "shi", *pad(32)]),
]  # fmt: skip


def load_kyutai_function(git_dir: Path, folder: Path):
    """Kyutai's timing function, imported from their script's definitions alone (its other
    imports need packages the reference environment lacks), written to `folder`."""
    source = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{KYUTAI_COMMIT}:{KYUTAI_PATH}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    tree = ast.parse(source)
    wanted = {"TimestampedText", KYUTAI_FUNCTION}
    tree.body = [node for node in tree.body if getattr(node, "name", None) in wanted]
    module_file = folder / "kyutai_stt_from_file.py"
    module_file.write_text("import dataclasses\nimport torch\n\n" + ast.unparse(tree) + "\n")
    spec = importlib.util.spec_from_file_location(module_file.stem, module_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module.__name__] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return getattr(module, KYUTAI_FUNCTION)


def token_ids(tokenizer: sentencepiece.SentencePieceProcessor, pieces: list[str]) -> list[int]:
    ids = [MARKS[piece] if piece in MARKS else tokenizer.piece_to_id(piece) for piece in pieces]
    for piece, token in zip(pieces, ids):
        assert piece in MARKS or tokenizer.id_to_piece(token) == piece, piece
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kyutai-git", type=Path, default=KYUTAI_GIT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        kyutai_timing = load_kyutai_function(args.kyutai_git, Path(folder))
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=TOKENIZER)
    cases = []
    for name, setting, pieces in CASES:
        tokens = token_ids(tokenizer, pieces)
        # Kyutai's main: ceil(prefix * frame rate) silent chunks, int() of their duration
        n_prefix_chunks = math.ceil(setting["silence_prefix"] * FRAME_RATE)
        offset = int(n_prefix_chunks / FRAME_RATE) + setting["audio_delay"]
        case = {"name": name, **setting, "tokens": tokens}
        try:
            timed = kyutai_timing(
                torch.tensor(tokens)[None, None],  # (B, K, T) as LMGen's steps concatenate
                tokenizer,
                FRAME_RATE,
                end_of_padding_id=0,
                padding_token_id=3,
                offset_seconds=offset,
            )
            case["words"] = [[t.text, float(t.timestamp[0]), float(t.timestamp[1])] for t in timed]
        except TypeError as exc:  # recorded: the tests check what we do instead
            case["kyutai_error"] = f"{type(exc).__name__}: {exc}"
        cases.append(case)
    golden = {
        "source": {
            "repository": "github.com/kyutai-labs/delayed-streams-modeling",
            "commit": KYUTAI_COMMIT,
            "path": KYUTAI_PATH,
            "function": KYUTAI_FUNCTION,
        },
        "tokenizer": TOKENIZER,
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
