"""The words the library's search finds a record by (`labels.search_words`, `search_phrases`):
pure functions, so their rules are checked here by hypothesis; the index itself, on both
backends, in test_pg.py."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from metanode import labels
from tests.helpers.search import TYPED

# characters of unspaced scripts (ideographs, kana, Hangul), and some of a spaced one
UNSPACED = st.sampled_from(
    "進撃の巨人千と尋神隠しカタナ진격의거인ภาพยนตร์ไทยພາສາລາວភាសាខ្មែរမြန်မာ\u3099"
)
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
    else:  # a run that starts and ends between characters, not before a mark of one
        cuts = [i for i, c in enumerate(f"{title}.") if unicodedata.category(c)[0] != "M"]
        assume(len(cuts) > 1)  # a title of marks alone has no run
        start = data.draw(st.sampled_from(cuts[:-1]))
        end = data.draw(st.sampled_from([i for i in cuts if i > start]))
    indexed = labels.search_words(title).split()
    (phrase,) = labels.search_phrases(title[start:end])
    assert any(indexed[i : i + len(phrase)] == phrase for i in range(len(indexed))), (
        title,
        indexed,
        phrase,
    )
    assert all(unicodedata.category(c)[0] == "M" for word in indexed for c in word[1:])


@given(st.text(st.one_of(UNSPACED, SPACED), max_size=20))
def test_the_words_of_a_text_are_its_words_with_unspaced_characters_apart(text: str) -> None:
    """Nothing but spaces is added to the folded text, every unspaced character stands alone
    (with the marks that follow it), and a search for the text itself is what the index holds
    of it."""
    words = labels.search_words(text)
    assert words.replace(" ", "") == labels.fold(text).replace(" ", "")
    for w in words.split():
        if any(labels.UNSPACED.match(c) and unicodedata.category(c)[0] != "M" for c in w):
            assert all(unicodedata.category(c)[0] == "M" for c in w[1:]), w
    assert [w for p in labels.search_phrases(text) for w in p] == words.split()


@given(TYPED)
@example("a\u0e3fb\u30fbc\u0e00")  # a currency sign, a punctuation mark, an unassigned point
def test_the_words_are_letters_marks_and_digits_one_space_apart_and_stay_so(text: str) -> None:
    """Whatever is typed, the words hold no character of FTS5's or tsquery's syntax (both
    backends only split them at their spaces), and folding them again changes nothing: the
    index and a search for what it holds agree."""
    words = labels.search_words(text)
    assert all(
        unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "So" or c == " "
        for c in words
    )
    assert "  " not in words and words == words.strip()
    assert labels.search_words(words) == words


LATIN = st.text(st.sampled_from("aeiouAEIOUnNcCsSyY ßẞæÆøØłŁđĐþÞıİ"), max_size=16)
ACCENTS = st.sampled_from(["\u0301", "\u0300", "\u0302", "\u0308", "\u030c", "\u0327", "\u0303"])


@given(LATIN, st.lists(ACCENTS, max_size=16))
def test_case_and_accents_make_no_difference(text: str, accents: list[str]) -> None:
    """A title typed in another case, or without (or with other) accents, is the same words:
    `AMELIE` finds `Amélie`, `strasse` `Straße`, `soren` `Søren`, `istanbul` `İstanbul`."""
    accented = "".join(c + (accents[i] if i < len(accents) else "") for i, c in enumerate(text))
    words = labels.search_words(text)
    assert labels.search_words(accented) == words
    assert labels.search_words(text.upper()) == labels.search_words(text.lower()) == words


@pytest.mark.parametrize(
    ("typed", "title"),
    [
        ("amelie", "Amélie"),
        ("strasse", "Straße"),
        ("istanbul", "İstanbul"),
        ("soren lodz aeon oedipus thor", "Søren Łódź Æon Œdipus Þór"),
        ("ελληνικα οδυσσεια", "Ελληνικά Ὀδύσσεια"),
        ("елки", "Ёлки"),
        ("كتاب", "كِتَابٌ"),  # harakat
        ("שלום", "שָׁלוֹם"),  # niqqud
        ("wall e", "WALL·E"),
        ("film 1080p x264", "Film.1080p.x264"),
        ("my file", "my_file"),
        ("9 1 2", "9½"),
        ("spiderman", "Spider-Man:"),
        ("walle", "WALL·E"),
        ("schindlers", "Schindler's"),
        ("mash", "M*A*S*H"),
        ("shield", "S.H.I.E.L.D."),
        ("acdc", "AC/DC"),
    ],
)
def test_a_title_is_found_by_what_a_reader_without_its_accents_types(
    typed: str, title: str
) -> None:
    """Each word typed is a word of the title's index words (as a reader without the accents,
    the punctuation or the spaces types it)."""
    indexed = labels.search_words(title).split()
    assert all(word in indexed for phrase in labels.search_phrases(typed) for word in phrase)


def test_fullwidth_and_composed_forms_are_read_as_what_they_are() -> None:
    assert labels.search_words("ＡＢＣ² Ame\u0301lie") == "abc2 amelie"
    assert labels.search_phrases("ｍｕｒ,Ame\u0301lie") == [["mur"], ["amelie"]]


def test_a_word_is_at_most_word_chars_long() -> None:
    """PostgreSQL refuses a tsvector or tsquery word of over 2,046 bytes (an error, where
    SQLite took it): a title of one long word is indexed by its start, and found by it."""
    long = "\U0001d400" * 3000  # 4 bytes each in UTF-8: MATHEMATICAL BOLD CAPITAL A, `a`
    assert labels.search_words(long) == "a" * labels.WORD_CHARS
    assert labels.search_phrases("巨" + long) == [["巨", "a" * labels.WORD_CHARS]]


def test_an_emoji_or_a_symbol_is_a_word_of_its_own() -> None:
    """They were no words: `🎄` found nothing. A heart is the same with or without its
    variation selector, a hand whatever its skin tone; a flag is the phrase of its letters."""
    assert labels.search_words("🎄Christmas ★") == "🎄 christmas ★"
    assert labels.search_words("I ❤️ NY") == labels.search_words("i ❤ ny") == "i ❤ ny"
    assert labels.search_words("👋🏽") == "👋"
    assert labels.search_phrases("🇫🇷 1️⃣") == [["\U0001f1eb", "\U0001f1f7"], ["1"]]
    assert labels.search_phrases("👨\u200d👩\u200d👧") == [["👨"], ["👩"], ["👧"]]


def test_a_word_of_few_parts_or_of_letters_is_also_indexed_run_together() -> None:
    """`spiderman` finds `Spider-Man`, `shield` `S.H.I.E.L.D.`; a file name's dotted run is
    no such word (run together it is one no one types, one a file)."""
    assert labels.search_words("Spider-Man: No Way Home") == "spider man no way home spiderman"
    assert labels.search_words("S.H.I.E.L.D.") == "s h i e l d shield"
    assert labels.search_words("Jay-Z's A.C/D.C") == "jay z s a c d c jayzs acdc"
    assert labels.search_words("The.Movie.2001.1080p.x264-GRP.mkv") == (
        "the movie 2001 1080p x264 grp mkv"
    )


def test_the_marks_that_make_a_letter_stay_in_its_word() -> None:
    """An Indic vowel sign or virama, a kana's voicing mark: part of the word (a search for
    `हिन्दी` is that one word, not `ह`, `न` and `द` anywhere)."""
    assert labels.search_phrases("हिन्दी") == [["हिन्दी"]]
    assert labels.search_words("ガンダム") == "ガ ン ダ ム"
