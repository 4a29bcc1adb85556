"""Long documents cut into pieces and the reduce tree over them: pure, measured with a counter of words."""

from __future__ import annotations

import pytest

from layerbus.jobs.long_documents import (Piece, reduce_fan_in, reduce_prompt_text, reduce_tree, split_text)


def words(text: str) -> int:
    return len(text.split())


def numbered_paragraphs(count: int, sentences: int = 3) -> str:
    return "\n\n".join(" ".join(f"Paragraph {p} sentence {s}." for s in range(1, sentences + 1))
                       for p in range(1, count + 1))


def test_pieces_end_at_paragraph_breaks_when_paragraphs_fit_and_keep_every_paragraph_in_order():
    text = numbered_paragraphs(10)  # 12 words a paragraph
    pieces = split_text(text, words, max_tokens=30)
    assert all(words(piece.text) <= 30 for piece in pieces)
    assert [piece.join_before for piece in pieces] == [""] + ["\n\n"] * (len(pieces) - 1)
    joined = "".join(piece.join_before + piece.text for piece in pieces)
    assert joined == text, "without overlap, joining the pieces gives back the text"


def test_a_paragraph_longer_than_a_piece_is_cut_at_sentence_ends_and_joined_with_a_space():
    text = numbered_paragraphs(1, sentences=12)  # 48 words, one paragraph
    pieces = split_text(text, words, max_tokens=20)
    assert len(pieces) == 3 and all(piece.text.endswith(".") for piece in pieces)
    assert [piece.join_before for piece in pieces] == ["", " ", " "]
    assert "".join(piece.join_before + piece.text for piece in pieces) == text


def test_overlap_repeats_the_last_sentences_of_the_piece_before():
    text = numbered_paragraphs(1, sentences=12)
    pieces = split_text(text, words, max_tokens=20, overlap_tokens=5)
    assert len(pieces) > 3
    for before, after in zip(pieces, pieces[1:]):
        last_sentence = before.text.rsplit(". ", 1)[-1]
        assert after.text.startswith(last_sentence.rstrip(".")), (before.text, after.text)
        assert words(after.text) <= 20


def test_a_word_longer_than_a_piece_is_cut_into_runs_and_nothing_is_lost():
    blob = "x" * 500

    def chars(text: str) -> int:
        return len(text) // 10 + 1

    pieces = split_text(f"Start here. {blob} End.", chars, max_tokens=8)
    assert "".join(piece.text for piece in pieces).replace(" ", "") == f"Starthere.{blob}End."
    assert all(chars(piece.text) <= 8 for piece in pieces)


def test_a_text_that_fits_is_one_piece():
    assert split_text("One. Two.\n\nThree.", words, max_tokens=100) == [Piece("One. Two.\n\nThree.", "")]


@pytest.mark.parametrize(
    "pieces, fan_in, levels",
    [
        (2, 6, [[2]]),
        (6, 6, [[6]]),
        (7, 3, [[3, 2, 2], [3]]),
        (7, 6, [[4, 3], [2]]),
        (40, 6, [[6, 6, 6, 6, 6, 5, 5], [4, 3], [2]]),
        (1, 2, [[1]]),
    ],
)
def test_reduce_tree(pieces, fan_in, levels):
    assert reduce_tree(pieces, fan_in) == levels
    for below, level in zip([pieces] + [len(lv) for lv in levels], levels):
        assert sum(level) == below and max(level) <= fan_in


def test_reduce_fan_in_and_prompt():
    assert reduce_fan_in(budget_tokens=1792, template_tokens=60, summary_tokens=256) == 6
    assert reduce_fan_in(budget_tokens=100, template_tokens=60, summary_tokens=256) == 2
    prompt = reduce_prompt_text(["First.", " Second. "], "Combine:\n\n{summaries}")
    assert prompt == "Combine:\n\nPart 1:\nFirst.\n\nPart 2:\nSecond."
