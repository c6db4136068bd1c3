"""Porter stemmer, as LoCoMo's token F1 uses it.

LoCoMo's evaluation stems every answer token with NLTK's `PorterStemmer()` (default mode
NLTK_EXTENSIONS: Porter's 1980 algorithm plus a few documented departures). NLTK is not a dependency
of this project, so this module implements the same algorithm from its published description:
M. F. Porter, "An algorithm for suffix stripping", Program 14(3), 1980, plus the NLTK_EXTENSIONS rules
(irregular forms, "ies"/"ied" on 4-letter words, "alli"/"fulli"/"logi" in step 2, the "bli" rule,
the stricter step 1c and the 2-letter CVC case). tests/engine/test_eval.py checks it against stems NLTK
produced for the LoCoMo answer vocabulary.
"""

from __future__ import annotations

from functools import lru_cache

# NLTK_EXTENSIONS' irregular forms: returned as-is, no suffix rule applies.
_IRREGULAR = {
    "sky": "sky", "skies": "sky",
    "dying": "die", "lying": "lie", "tying": "tie",
    "news": "news",
    "innings": "inning", "inning": "inning",
    "outings": "outing", "outing": "outing",
    "cannings": "canning", "canning": "canning",
    "howe": "howe",
    "proceed": "proceed", "exceed": "exceed", "succeed": "succeed",
}

_VOWELS = "aeiou"


def _is_consonant(word: str, i: int) -> bool:
    ch = word[i]
    if ch in _VOWELS:
        return False
    if ch == "y":
        # 'y' is a consonant at the start or after a vowel, a vowel after a consonant.
        return i == 0 or not _is_consonant(word, i - 1)
    return True


def _measure(stem: str) -> int:
    """m in [C](VC)^m[V]: the number of vowel-consonant transitions."""
    pattern = "".join("c" if _is_consonant(stem, i) else "v" for i in range(len(stem)))
    return pattern.count("vc")


def _has_vowel(stem: str) -> bool:
    return any(not _is_consonant(stem, i) for i in range(len(stem)))


def _ends_double_consonant(word: str) -> bool:
    return len(word) >= 2 and word[-1] == word[-2] and _is_consonant(word, len(word) - 1)


def _ends_cvc(word: str) -> bool:
    if len(word) >= 3:
        return (_is_consonant(word, len(word) - 3) and not _is_consonant(word, len(word) - 2)
                and _is_consonant(word, len(word) - 1) and word[-1] not in "wxy")
    # NLTK extension: a 2-letter word vowel+consonant counts as CVC.
    return len(word) == 2 and not _is_consonant(word, 0) and _is_consonant(word, 1)


def _apply_rules(word: str, rules) -> str:
    """The first rule whose suffix matches decides: its replacement if the condition holds on the
    remaining stem, else the word unchanged (no later rule is tried)."""
    for suffix, replacement, condition in rules:
        if suffix == "*d":  # double consonant ending
            if _ends_double_consonant(word):
                stem = word[:-2]
                return stem + replacement if condition(stem) else word
            continue
        if word.endswith(suffix):
            stem = word[: len(word) - len(suffix)]
            return stem + replacement if (condition is None or condition(stem)) else word
    return word


def _m_gt0(stem: str) -> bool:
    return _measure(stem) > 0


def _m_gt1(stem: str) -> bool:
    return _measure(stem) > 1


def _step1a(word: str) -> str:
    if word.endswith("ies") and len(word) == 4:
        return word[:-3] + "ie"
    return _apply_rules(word, [("sses", "ss", None), ("ies", "i", None), ("ss", "ss", None), ("s", "", None)])


def _step1b(word: str) -> str:
    if word.endswith("ied"):
        return word[:-3] + ("ie" if len(word) == 4 else "i")
    if word.endswith("eed"):
        stem = word[:-3]
        return stem + "ee" if _measure(stem) > 0 else word
    for suffix in ("ed", "ing"):
        if word.endswith(suffix) and _has_vowel(word[: -len(suffix)]):
            stem = word[: -len(suffix)]
            break
    else:
        return word
    # Tidy the stem left by removing -ed/-ing (hop(p)ing -> hop, hoping -> hope).
    last = stem[-1]
    return _apply_rules(stem, [
        ("at", "ate", None), ("bl", "ble", None), ("iz", "ize", None),
        ("*d", last, lambda s: last not in "lsz"),
        ("", "e", lambda s: _measure(s) == 1 and _ends_cvc(s)),
    ])


def _step1c(word: str) -> str:
    # NLTK extension: y -> i only after a consonant that is not the first letter.
    return _apply_rules(word, [("y", "i", lambda s: len(s) > 1 and _is_consonant(s, len(s) - 1))])


def _step2(word: str) -> str:
    if word.endswith("alli") and _m_gt0(word[:-4]):
        return _step2(word[:-4] + "al")
    return _apply_rules(word, [
        ("ational", "ate", _m_gt0), ("tional", "tion", _m_gt0), ("enci", "ence", _m_gt0),
        ("anci", "ance", _m_gt0), ("izer", "ize", _m_gt0), ("bli", "ble", _m_gt0),
        ("alli", "al", _m_gt0), ("entli", "ent", _m_gt0), ("eli", "e", _m_gt0),
        ("ousli", "ous", _m_gt0), ("ization", "ize", _m_gt0), ("ation", "ate", _m_gt0),
        ("ator", "ate", _m_gt0), ("alism", "al", _m_gt0), ("iveness", "ive", _m_gt0),
        ("fulness", "ful", _m_gt0), ("ousness", "ous", _m_gt0), ("aliti", "al", _m_gt0),
        ("iviti", "ive", _m_gt0), ("biliti", "ble", _m_gt0), ("fulli", "ful", _m_gt0),
        # NLTK measures the stem including the 'l' of "logi".
        ("logi", "log", lambda s: _m_gt0(word[:-3])),
    ])


def _step3(word: str) -> str:
    return _apply_rules(word, [
        ("icate", "ic", _m_gt0), ("ative", "", _m_gt0), ("alize", "al", _m_gt0), ("iciti", "ic", _m_gt0),
        ("ical", "ic", _m_gt0), ("ful", "", _m_gt0), ("ness", "", _m_gt0),
    ])


def _step4(word: str) -> str:
    rules = [(s, "", _m_gt1) for s in (
        "al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent")]
    rules.append(("ion", "", lambda s: _m_gt1(s) and s[-1:] in ("s", "t")))
    rules += [(s, "", _m_gt1) for s in ("ou", "ism", "ate", "iti", "ous", "ive", "ize")]
    return _apply_rules(word, rules)


def _step5a(word: str) -> str:
    if word.endswith("e"):
        stem = word[:-1]
        m = _measure(stem)
        if m > 1 or (m == 1 and not _ends_cvc(stem)):
            return stem
    return word


def _step5b(word: str) -> str:
    return _apply_rules(word, [("ll", "l", lambda s: _measure(word[:-1]) > 1)])


@lru_cache(maxsize=65536)
def porter_stem(word: str) -> str:
    """Stem one token the way NLTK's PorterStemmer() (NLTK_EXTENSIONS) does; lowercases it."""
    word = word.lower()
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if len(word) <= 2:
        return word
    for step in (_step1a, _step1b, _step1c, _step2, _step3, _step4, _step5a, _step5b):
        word = step(word)
    return word
