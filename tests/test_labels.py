"""The words the library's search finds a record by (`labels.search_words`, `search_phrases`):
pure functions, so their rules are checked here by hypothesis; the index itself, on both
backends, in test_pg.py."""

from __future__ import annotations

import unicodedata

from hypothesis import example, given
from hypothesis import strategies as st

from metanode import labels

# characters of unspaced scripts (ideographs, kana, Hangul), and some of a spaced one
UNSPACED = st.sampled_from("進撃の巨人千と尋神隠しカタナ진격의거인")
SPACED = st.sampled_from("ab é")


@given(st.text(UNSPACED, min_size=1, max_size=12), st.data())
@example("進撃の巨人", None)
def test_any_run_inside_an_unspaced_title_is_a_phrase_of_its_words(
    title: str, data: st.DataObject | None
) -> None:
    """A run of characters inside a title of an unspaced script is, as typed, one phrase
    whose words follow one another in the title's index words: the search finds it."""
    if data is None:
        start, end = 3, 5  # 巨人
    else:
        start = data.draw(st.integers(0, len(title) - 1))
        end = data.draw(st.integers(start + 1, len(title)))
    indexed = labels.search_words(title).split()
    (phrase,) = labels.search_phrases(title[start:end])
    assert indexed[start:end] == phrase


@given(st.text(st.one_of(UNSPACED, SPACED), max_size=20))
def test_the_words_of_a_text_are_its_words_with_unspaced_characters_apart(text: str) -> None:
    """Nothing but spaces is added, every unspaced character stands alone, and a search for
    the text itself is what the index holds of it."""
    words = labels.search_words(text)
    assert words.replace(" ", "") == unicodedata.normalize("NFKC", text).replace(" ", "")
    assert all(len(w) == 1 for w in words.split() if labels.UNSPACED.search(w))
    assert [w for p in labels.search_phrases(text) for w in p] == [
        w for w in words.split() if w.isalnum()
    ]


def test_fullwidth_and_composed_forms_are_read_as_what_they_are() -> None:
    assert labels.search_words("ＡＢＣ² Ame\u0301lie") == "ABC2 Am\u00e9lie"
    assert labels.search_phrases("ｍｕｒ,Ame\u0301lie") == [["mur"], ["Am\u00e9lie"]]
