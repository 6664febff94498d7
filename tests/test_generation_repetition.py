"""benchmarks/generation_repetition.py: repetition shares of generation records, re-encoded or as recorded."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from generation_repetition import shares  # noqa: E402


def test_shares_reencode_old_records_and_read_new_ones():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731  one id per character
    old = {"result": {"per_prompt": [{"wide_text": "abcd" * 3, "dense_text": "abcdefghijkl"},
                                     {"wide_text": "abcdefgh", "dense_text": "xyzw" * 3},
                                     {"wide_text": "aaaaaa", "dense_text": ""}]}}
    got = shares(old, encode)
    assert got["prompts"] == 3 and got["wide_repeating"] == 2 / 3 and got["dense_repeating"] == 1 / 3
    assert got["source"].startswith("answers re-encoded")
    new = {"result": {"prompts": 5, "wide_repeating": 0.4, "dense_repeating": 0.2, "per_prompt": []}}
    assert shares(new, encode) == {"prompts": 5, "wide_repeating": 0.4, "dense_repeating": 0.2,
                                   "source": "the record's own figures"}
