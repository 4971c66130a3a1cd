"""The count the MAS paper's evaluation scripts read from an answer (``vlm-count-eval/eval_accu_count/
run*.py``): the first match of a digit string or of a number word anywhere in the lower-cased text.

The scripts' regular expression has no word boundaries and tries its words in the order written
(``zero``, ``no``, ``one`` … ``fifteen``), so "cannot" reads 0 (its "no"), "someone" 1, "fourteen" 4
("four" comes first) and "often" 10. countlens's own parser (`countlens.analysis.parse.parse_count`)
reads whole words; this one is kept to reproduce the paper's numbers (``generate(...,
parser="paper-code")``, preset ``counting-to-four``).
"""

from __future__ import annotations

import re

from countlens.errors import InputError

#: The scripts' number words, in their order (the regex tries them so: "four" before "fourteen").
NUMBER_WORDS: dict[str, int] = {
    "zero": 0,
    "no": 0,
    **{
        w: i
        for i, w in enumerate(
            "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split(),
            start=1,
        )
    },
}
_COUNT_RE = re.compile(rf"(\d+|{'|'.join(NUMBER_WORDS)})")


def parse_count_as_reference(text: str) -> int | None:
    """The count the MAS paper's evaluation scripts read (see the module docstring): the first digit
    string or number word "zero", "no", "one" … "fifteen" anywhere in the lower-cased text, or None."""
    if not isinstance(text, str):
        raise InputError(f"parse_count_as_reference got a {type(text).__name__}; give the answer text as a string")
    m = _COUNT_RE.search(text.lower())
    if m is None:
        return None
    word = m.group(1)
    return int(word) if word.isdigit() else NUMBER_WORDS[word]
