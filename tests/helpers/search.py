"""What people type into the library's search box and the titles they look for, as hypothesis
strategies (test_labels checks the words made of them, test_pg that both backends find the
same rows by them)."""

from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["TITLE_CHARS", "TYPED"]

# Characters of titles and of query languages: FTS5's and tsquery's syntax, punctuation that
# parts words, folded letters, marks that are accents and marks that make letters, fractions,
# emoji, an unspaced script, a control character and a private-use one.
SPECIAL = "\"*-^:()&|!<>\\'_.·¡¿½²ﬁ🎄ßæøİıΣς\u0301\u0308\u093f\u094d\u05b8\u064e\ue000\x00巨人"

# Any text, its special characters well represented.
TYPED = st.text(st.one_of(st.characters(), st.sampled_from(SPECIAL)), max_size=40)

# The characters a generated title is made of: few, so that titles share words and prefixes
# (no NUL, which no value holds: PostgreSQL's text cannot).
TITLE_CHARS = st.sampled_from("abAB 12" + SPECIAL.replace("\x00", ""))
