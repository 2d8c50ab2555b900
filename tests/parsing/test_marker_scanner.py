"""MarkerScanner: release all but the longest suffix that could begin a marker."""

from __future__ import annotations

import random

from atom_core.parsing.marker_scanner import MarkerHit, MarkerScanner


def test_a_tail_that_cannot_begin_a_marker_is_released_whole():
    sc = MarkerScanner(["<tool_call>"])
    assert sc.safe_end("if (a < b) then") == len("if (a < b) then")
    assert sc.safe_end("text <tool") == len("text ")
    assert sc.safe_end("text <") == len("text ")
    assert sc.safe_end("<<") == 1


def test_the_longest_suffix_is_held():
    sc = MarkerScanner(["<think>", "</think>"])
    assert sc.safe_end("a </thi") == 2
    assert sc.safe_end("a <") == 2


def test_find_returns_the_leftmost_marker_and_the_longest_at_one_position():
    sc = MarkerScanner(["<a>", "<a>b"])
    assert sc.find("x <a>c") == MarkerHit(2, "<a>")
    assert sc.find("x <a>b") == MarkerHit(2, "<a>b")


def test_a_marker_that_could_still_grow_waits_unless_at_end():
    sc = MarkerScanner(["<a>", "<a>b"])
    assert sc.find("x <a>") is None
    assert sc.safe_end("x <a>") == 2
    assert sc.find("x <a>", at_end=True) == MarkerHit(2, "<a>")


def test_a_marker_inside_a_longer_ones_prefix_waits():
    sc = MarkerScanner(["[[call]]", "call"])
    assert sc.find("x [[call") is None  # "[[call]]" may still be arriving
    assert sc.find("x [[call]]") == MarkerHit(2, "[[call]]")
    assert sc.find("x [[call!") == MarkerHit(4, "call")


def test_match_at_a_position():
    sc = MarkerScanner(["</tool_call>", "<tool_call>"])
    assert sc.match("  </tool_call>x", 2) == MarkerHit(2, "</tool_call>")
    assert sc.match("  </tool", 2) is True
    assert sc.match("  </tool", 2, at_end=True) is False
    assert sc.match("  hello", 2) is False
    assert sc.match("  ", 2) is True
    assert sc.match("  ", 2, at_end=True) is False


def _stream_find_all(
    sc: MarkerScanner, text: str, sizes: list[int]
) -> tuple[list[tuple[int, str]], int]:
    """Markers found and the most bytes ever held, reading ``text`` in chunks."""
    found: list[tuple[int, str]] = []
    held, offset, most = "", 0, 0
    i = 0
    for n in sizes + [len(text)]:
        s = held + text[i : i + n]
        i += n
        pos = 0
        while True:
            hit = sc.find(s, pos, at_end=i >= len(text))
            if hit is None:
                break
            found.append((offset + hit.start, hit.marker))
            pos = hit.end
        end = len(s) if i >= len(text) else sc.safe_end(s, pos)
        held = s[end:]
        offset += end
        most = max(most, len(held))
        if i >= len(text):
            break
    return found, most


def test_chunking_never_changes_what_is_found_and_holds_are_bounded():
    rng = random.Random(7)
    markers = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|a|>", "<|a|>b"]
    sc = MarkerScanner(markers)
    alphabet = ["<", ">", "/", "t", "o", "l", "_", "c", "a", "|", "b", "think", "tool_call", " ",
                "x"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        whole, _ = _stream_find_all(sc, text, [])
        sizes = [rng.randint(1, 5) for _ in range(len(text))]
        chunked, most = _stream_find_all(sc, text, sizes)
        assert chunked == whole, text
        assert most < sc.longest
