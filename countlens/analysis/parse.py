"""Reading a count from an answer's text: number words, `parse_count`, the Pstd format's
`parse_shape_count`, and a vocabulary token as text (`token_text`).

`parse_count` is countlens's reading: whole words only, so "someone" holds no count and "I don't
know" is unparsed; `countlens.analysis.evaluate.generate` uses it (through `parse_shape_count`) unless
asked for the MAS paper's scripts' reading (``parser="paper-code"``,
`countlens.reference.counting_to_four.parse`), which has no word boundaries. The metrics
(`countlens.analysis.metrics`) read a scored token's count with `parse_count` of `token_text`.
"""

from __future__ import annotations

import re

from countlens.errors import InputError
from countlens.validate import require_text

_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen"
).split()
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
#: Number words → value ("zero" … "nineteen", the tens; "twenty-one"-style compounds are parsed too).
NUMBER_WORDS: dict[str, int] = {w: i for i, w in enumerate(_UNITS)} | _TENS
#: Whole words that mean a count of zero.
ZERO_WORDS: tuple[str, ...] = ("no", "none")

_COUNT_RE = re.compile(
    r"\b(?:(?P<digits>[0-9]+)"
    rf"|(?P<tens>{'|'.join(_TENS)})(?:[-\s](?P<unit>{'|'.join(_UNITS[1:10])}))?"
    rf"|(?P<word>{'|'.join(sorted(_UNITS, key=len, reverse=True))})"
    rf"|(?P<zero>{'|'.join(ZERO_WORDS)}))\b",
    re.IGNORECASE,
)
# Sub-word markers of byte-level BPE ("Ġ") and SentencePiece ("▁") tokenizers.
_TOKEN_MARKERS = str.maketrans({"Ġ": " ", "▁": " ", "Ċ": "\n"})


def parse_count(text: str) -> int | None:
    """The first count in ``text``, or None when there is none.

    Matches whole words only (word boundaries): digit strings ("12." → 12), number words "zero" …
    "nineteen" and the tens ("twenty", "thirty-two" → 32), and "no" / "none" → 0. The first
    count-bearing word wins ("4 or 5" → 4; "no, 3" → 0). "nothing", "nonexistent", "know" or
    "someone" hold no count; "I don't know" → None.
    """
    if not isinstance(text, str):
        raise InputError(f"parse_count got a {type(text).__name__}; give the answer text as a string")
    m = _COUNT_RE.search(text)
    if m is None:
        return None
    if m["digits"]:
        return int(m["digits"])
    if m["tens"]:
        return _TENS[m["tens"].lower()] + (NUMBER_WORDS[m["unit"].lower()] if m["unit"] else 0)
    if m["word"]:
        return NUMBER_WORDS[m["word"].lower()]
    return 0


def parse_shape_count(text: str, shape: str = "") -> int | None:
    """The count of a Pstd-format answer ("circle: 7", "Circles: seven"), or else the first count.

    The format is the papers' Pstd answer, ``{shape}: {number}`` (`countlens.datasets.prompts`); a
    model that ignores it and answers "There are 7" is still read (→ 7), as the papers' parser does.
    ``shape`` is the asked shape, singular or plural ("circle", "circles", "objects"); empty: any word.
    """
    require_text(text, "text", empty=True)
    require_text(shape, "shape", empty=True)
    if not isinstance(text, str):
        raise InputError(f"parse_shape_count got a {type(text).__name__}; give the answer text as a string")
    stem = re.escape(shape[:-1] if shape.endswith("s") else shape) if shape else r"[a-z]+"
    m = re.search(rf"\b{stem}s?\s*:\s*", text, re.IGNORECASE)
    if m is not None:
        found = parse_count(text[m.end() :])
        if found is not None:
            return found
    return parse_count(text)


#: How `generate` reads a count: countlens's parser (`parse_shape_count`: the Pstd format, whole words,
#: up to "nineteen" and the tens) or the MAS paper's scripts' (`countlens.reference.counting_to_four.parse`).
PARSERS: tuple[str, ...] = ("countlens", "paper-code")


def token_text(token: str) -> str:
    """A vocabulary token as text: sub-word markers ("Ġ12", "▁twelve") turned back into spaces."""
    return str(token).translate(_TOKEN_MARKERS)
