"""English abbreviations read as words (normalize.py's English reader): titles, street words, labels before a number,
and a few read wherever they stand.

Which word an abbreviation stands for is told by its neighbours, not by a list of sentences:
- a title (`Dr.`, `Capt.`, `St.`) before a capitalised word: "Doctor Okafor", "Saint Brigid's"; with its period
  also before "and" ("Prof. and Dr. Amsel");
- a street word (`St.`, `Dr.`, `Rd.`, `Ave.`) after a capitalised word or an ordinal: "Willow Drive", "Harbour
  Street", "5th Avenue"; one that is a title too (`St.`, `Dr.`) not before a name ("Ask Dr. Okafor");
- a label (`No.`, `Rm.`, `Apt.`, `ext.`, any case) before a number: "room number twelve", "Room two hundred and four";
- the rest (`e.g.`, `etc.`, `Inc.`) wherever they are written with their period.
Written without its period (British style: `Dr Moreau`, `Mrs Brandt`, `rm 14`), an abbreviation needs the stronger
sign: a title a name after it, a street word no name after it. One that is also an English word (`no`, `Gen`, `Rev`,
`Fig`, `Art`) is read only with its period: "no 12" stays, "no. 12" is "number twelve", "Gen Z" stays. A title or
street word with its period that fits neither place reads as its first sense (`Dr.`: Doctor). Where the period also
ends the sentence (the text ends, or a capital follows) after a street word or one read anywhere, it is kept.
"""

from __future__ import annotations

import re

TITLES = {"Dr": "Doctor", "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Mx": "Mix", "Prof": "Professor",
          "Capt": "Captain", "Lt": "Lieutenant", "Sgt": "Sergeant", "Gen": "General", "Col": "Colonel",
          "Maj": "Major", "Cpl": "Corporal", "Pvt": "Private", "Adm": "Admiral", "Cmdr": "Commander",
          "Rev": "Reverend", "Revd": "Reverend", "Fr": "Father", "Sen": "Senator", "Rep": "Representative",
          "Gov": "Governor", "Pres": "President", "Hon": "Honorable", "Supt": "Superintendent", "Insp": "Inspector",
          "Det": "Detective", "Atty": "Attorney", "St": "Saint", "Mt": "Mount", "Ft": "Fort"}
STREETS = {"St": "Street", "Dr": "Drive", "Ave": "Avenue", "Blvd": "Boulevard", "Rd": "Road", "Ln": "Lane",
           "Ct": "Court", "Pl": "Place", "Hwy": "Highway", "Pkwy": "Parkway", "Sq": "Square", "Cres": "Crescent"}
LABELS = {"no": "number", "nos": "numbers", "rm": "room", "apt": "apartment", "ext": "extension", "bldg": "building",
          "fl": "floor", "ste": "suite", "vol": "volume", "ch": "chapter", "fig": "figure", "sec": "section",
          "pg": "page", "p": "page", "pp": "pages", "art": "article", "para": "paragraph", "eq": "equation",
          "flt": "flight"}
ANYWHERE = {"Jr": "Junior", "Sr": "Senior", "vs": "versus", "e.g": "for example", "i.e": "that is", "etc": "et cetera",
            "approx": "approximately", "Inc": "Incorporated", "Ltd": "Limited", "Corp": "Corporation",
            "Dept": "Department", "Univ": "University", "Govt": "Government"}
# read anywhere, but never the last word of a sentence: their period is never kept as one
JOINING = ("vs", "e.g", "i.e", "approx")
# abbreviations that are English words too (or a letter): read as abbreviations only with their period
WORDS = frozenset("no nos fig sec art para p gen rev gov pres hon det rep sen col ave".split())


def _alternatives() -> str:
    """Every abbreviation, longest first; the labels in any case (`Rm`, `rm`, `RM`)."""
    keys = {k: re.escape(k) for k in (*TITLES, *STREETS, *ANYWHERE)}
    keys |= {k: f"(?i:{re.escape(k)})" for k in LABELS if k not in keys}
    return "|".join(keys[k] for k in sorted(keys, key=len, reverse=True))


# the abbreviation, then its period or the end of the word (`No.12` has its period, `Dr` must end there)
ABBREVIATION = re.compile(rf"(?<![\w.])({_alternatives()})(?:(\.)|(?![\w'’]))")
_NEXT = re.compile(r"\s+([\w&]+)")
_ORDINAL = re.compile(r"\d+(?:st|nd|rd|th)", re.IGNORECASE)


def _capitalised(word: str | None) -> bool:
    return bool(word) and word[0].isupper()


def _after_a_name(before: str) -> bool:
    """The word just before is capitalised (`Willow Dr.`, `Main St.`) or an ordinal (`5th Ave.`)."""
    head = before.rstrip()
    if len(head) == len(before) or not head:
        return False  # no space before the abbreviation, or nothing
    word = head.rsplit(None, 1)[-1].rstrip(",")
    if word[-1] in ".!?;:\"”)":
        return False  # a sentence (or a quote) ended there: "Who? Dr."
    return _capitalised(word) or bool(_ORDINAL.fullmatch(word))


def read(m: re.Match, before: str) -> str:
    """The words for one ABBREVIATION match (`before`: the text just before it), or the match as written."""
    key, period = m.group(1), m.group(2)
    after = m.string[m.end():m.end() + 64]
    nxt = _NEXT.match(after)
    name_next = nxt is not None and _capitalised(nxt.group(1))
    ends = bool(period) and key not in JOINING and (not after.strip() or bool(re.match(r"\s+[A-Z\"“(]", after)))
    bare_ok = period or key.lower() not in WORDS
    if key.lower() in LABELS and key not in TITLES and bare_ok and re.match(r"\s?#?\d", after):
        word = LABELS[key.lower()]
        return word.capitalize() if key[0].isupper() else word
    if key in STREETS and _after_a_name(before) and (not name_next or (period and key not in TITLES)):
        return STREETS[key] + ("." if ends else "")
    if key in TITLES and bare_ok and (name_next or (period and nxt is not None and nxt.group(1) in ("and", "&"))):
        return TITLES[key]
    if period and key in ANYWHERE:
        return ANYWHERE[key] + ("." if ends else "")
    if period and (key in TITLES or key in STREETS):
        return TITLES.get(key) or STREETS[key] + ("." if ends else "")
    return m.group()
