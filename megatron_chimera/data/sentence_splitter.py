"""Rule-based English sentence splitter for ``--split-sentences`` (offline; nothing to download).

Megatron uses NLTK's punkt model, which must be downloaded at run time. This splitter needs nothing:
a sentence ends at ``.``, ``!`` or ``?`` (possibly followed by closing quotes or brackets) that is
followed by whitespace and then an upper-case letter, a digit or an opening quote/bracket, unless
the word before the period is a known abbreviation or a single initial; a blank line always ends a
sentence. Good enough for BERT's sentence-order task, where a rare wrong boundary costs little.
"""

from __future__ import annotations

import re

# Lower-cased, without the trailing period.
ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt ft vs etc esp ca cf al approx dept est fig gen gov govt inc ltd
    co corp jan feb mar apr jun jul aug sep sept oct nov dec no nos vol vols pp ed eds rev col capt
    lt sgt cmdr adm maj messrs mme mlle e.g i.e viz u.s u.k a.m p.m
    """.split()
)

_BOUNDARY = re.compile(
    r"""(?P<end>[.!?]+["')\]\u201d\u2019]*)   # terminal punctuation, closing quotes/brackets
        (?P<space>\s+)                          # the gap
        (?=["'(\[\u201c\u2018]?[A-Z0-9])         # next sentence starts upper-case or with a digit
    """,
    re.VERBOSE,
)
_PARAGRAPH = re.compile(r"\n\s*\n")
_LAST_WORD = re.compile(r"([\w.]+)$")


def _is_abbreviation(text_before: str) -> bool:
    match = _LAST_WORD.search(text_before)
    if match is None:
        return False
    word = match.group(1).lower().rstrip(".")
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split ``text`` into sentences, dropping empty ones.

    Without ``keep_newlines`` every run of whitespace (newlines included) becomes one space and
    sentences are stripped; with it a sentence keeps its inner newlines and the whitespace that
    follows it (as Megatron's ``--keep-newlines``).
    """
    cuts = [0]
    for paragraph in _PARAGRAPH.finditer(text):
        cuts.append(paragraph.end())
    cuts.append(len(text))
    boundaries = [0]
    for begin, end in zip(cuts[:-1], cuts[1:]):
        start = begin
        for match in _BOUNDARY.finditer(text, begin, end):
            if match.group("end").startswith(".") and _is_abbreviation(
                text[start : match.start("end")]
            ):
                continue
            boundaries.append(match.end("space"))
            start = match.end("space")
        boundaries.append(end)
    pieces = (text[a:b] for a, b in zip(boundaries[:-1], boundaries[1:]))
    if keep_newlines:
        return [p.lstrip(" \t") for p in pieces if p.strip()]
    return [" ".join(p.split()) for p in pieces if p.strip()]
