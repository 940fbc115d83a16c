"""Numbers, dates, times, money, units, phone numbers, URLs and e-mail addresses written out as a person reads them.

`normalize(text, language)` finds the written forms (the patterns below, in order: URLs, e-mail, phone numbers, dates,
times, money, percentages, ranges, measures, ordinals, fractions, decimals, years, whole numbers; in English first
abbreviations, abbreviations.py, and units after "per") and replaces each by words. The words of numbers come from
libraries, never from this module: num2words (English: cardinals, ordinals, years, currency names) and cn2an
(Chinese: cardinals, decimals, dates, fractions, percentages). What this module holds is where a number is and what
kind it is, and the words around it (unit names, month names, "dot", "at").

Languages: "en" and "zh" (`LANGUAGES`); "auto" takes zh when most of the letters are Han characters, else en. The
inline control tags (`<|emotion:elation|>`) are never touched. Text with nothing to normalise comes back unchanged.

The reference pipeline (sglang-omni) does none of this: it is off by default, and its effect on the real model's
speech is not measured here (docs/text.md).
"""

from __future__ import annotations

import calendar
import re
import warnings
from decimal import Decimal, InvalidOperation

from ..tags import CONTROL_TAG, between_tags
from . import abbreviations
from .abbreviations import ABBREVIATION

LANGUAGES = ("en", "zh")
AUTO = "auto"


class NormalizeError(ValueError):
    """A language the normaliser does not cover (one line, names it)."""


def check_language(value) -> str:
    if not isinstance(value, str) or value.lower() not in (*LANGUAGES, AUTO):
        raise NormalizeError(f"normalize must be one of {', '.join((AUTO, *LANGUAGES))} (or true / false), "
                             f"got {value!r}")
    return value.lower()


def language_of(text: str) -> str:
    """zh when most letters are Han characters, else en."""
    han = sum(1 for c in text if "\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf")
    letters = sum(1 for c in text if c.isalpha())
    return "zh" if letters and han * 2 >= letters else "en"


def normalize(text: str, language: str = AUTO) -> str:
    """`text` with its written forms read out in `language` (en, zh or auto); control tags untouched."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    language = check_language(language)
    if language == AUTO:
        language = language_of(CONTROL_TAG.sub(" ", text))
    return between_tags(text, (_EN if language == "en" else _ZH).read)


# --- patterns shared by both languages -------------------------------------------------------------------------
def _re(pattern: str, flags: int = 0) -> re.Pattern:
    """ASCII classes: \\w, \\b and \\d are ASCII, so a Chinese character next to a number is a boundary."""
    return re.compile(pattern, flags | re.ASCII)


NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
TLD = r"(?:com|org|net|edu|gov|io|ai|dev|app|co|uk|de|cn|jp|fr|info|me|tv|us|ca|au|ru|in)"
URL = _re(r"(?<![\w.@/-])(?:(?:https?://|www\.)[^\s<>\"'\u3000-\u9fff\uff00-\uffef]+[^\s<>\"'.,;:!?)\]}\u3000-\u9fff\uff00-\uffef]"
          rf"|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.{TLD}(?:/[A-Za-z0-9_./-]*[A-Za-z0-9_/])?)(?![\w@-])")
EMAIL = _re(r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b")
ISO_DATE = _re(r"(?<![\w-])(\d{4})-(\d{2})-(\d{2})(?![\w-])")
SLASH_DATE = _re(r"(?<![\w/])(\d{1,2})/(\d{1,2})(?:/(\d{4}|\d{2}))?(?![\w/])")
TIME = _re(r"(?<![\w:])([01]?\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?(?:\s?([AaPp])(?:\.[Mm](?=\.)|\s?[Mm]\b))?(?![\w:])")
CLOCK = _re(r"(?<![\w:])\d{1,2}:\d{2}(?::\d{2})?(?![\w:])")  # a time's shape that TIME found no time in (25:61)
PERCENT = _re(rf"(?<![\w.])(-?)({NUM})\s?[%％]")
RANGE = _re(rf"(?<![\w.,-])({NUM})\s?[-–~]\s?({NUM})(?![\w.,]*\d)")
FRACTION = _re(r"(?<![\w/.])(\d{1,3})/(\d{1,3})(?![\w/])")
ORDINAL = _re(r"(?<![\w.])(\d+)(st|nd|rd|th)\b", re.IGNORECASE)
PHONE_GROUPS = (r"(?<![\w.+])(?:\+\d{1,3}(?:[ .-]\d{1,4}){2,5}|\d{3}\.\d{3}\.\d{4}|0\d{3,4} \d{6,7}|1\d{2} \d{4} \d{4})"
                r"(?![\w.-]*\d)")
CUES = ("call ", "Call ", "dial ", "Dial ", "text ", "拨打", "电话是", "打", "号码是", "热线")
CALLED = _re("(?:" + "|".join(f"(?<={c})" for c in CUES) + r")(\d{3,5})(?![\w.,:/-]*\d)")
DASH = _re(r"(?<=\d)\s?[-–—~]\s?(?=[$€£¥]?\d)|(?<=%)\s?[-–~]\s?(?=\d)|(?<=[ap]m)\s?[-–]\s?(?=\d)")
LEADING_POINT = _re(r"(?<![\w.])\.\d")
MIXED = _re(r"(?<![\w./])(\d+) (\d)/(\d{1,2})(?![\w/])")
FRACTIONS = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅛": (1, 8)}
VULGAR = re.compile("|".join(FRACTIONS))
SAID_DASH = re.compile(r"(?<=[点分秒年零〇一二三四五六七八九十百千])\s?[-–~]\s?(?=[零〇一二三四五六七八九十百千])")
PER_MILLE = _re(r"(?<!\d)(\d+(?:\.\d+)?)\s?‰")  # (?<!\d): never tried again inside a number (linear time)
CENTS = _re(r"(?<![\w.])(\d{1,2})\s?¢")
DAY_NAMES = {"mon": "Monday", "tue": "Tuesday", "wed": "Wednesday", "thu": "Thursday", "fri": "Friday",
             "sat": "Saturday", "sun": "Sunday"}
DAY = r"(Mon|Tue|Tues|Wed|Thu|Thur|Thurs|Fri|Sat|Sun)"
DAYS = _re(rf"\b{DAY}\.?\s?[-–]\s?{DAY}\b\.?")
# a local number, 555-1423: three digits, a dash, four (a range of round numbers, 500-1000, stays a range)
LOCAL_PHONE = r"|(?<![\w.,-])\d{3}-(?!\d{2}00(?![\w-]))\d{4}(?![\w-])"
PHONE = _re(PHONE_GROUPS + LOCAL_PHONE
            + r"|(?<![\w.])(?:\+\d{1,3}[ -])?(?:\(\d{2,4}\) ?|\d{2,4}-)\d{3,4}-\d{4}(?![\w-])"
                   r"|(?<![\w.])0\d{2,3}-\d{7,8}(?![\w-])|(?<![\w.])1\d{10}(?!\d)")
HOUR = _re(r"(?<![\w:.])(1[0-2]|0?[1-9])\s?([AaPp])(?:\.[Mm](?=\.)|\.?\s?[Mm]\b)")
VERSION = _re(r"(?<![\w.])\d+(?:\.\d+){2,}(?![\w.]*\d)")
DECADE = _re(r"(?<![\w.])(1\d|20)?(\d0)'?s\b")
NUMBER = _re(rf"(?<![\w.])(-?)({NUM})(?![\d])")
QUARTER = _re(r"(?<![\w])Q([1-4])(?![\w])")  # Q3: "Q three"
# Roman numerals after a capitalised word: World War II, Chapter XII (a number), Henry VIII (a monarch or pope: "the
# eighth"); I..LXXXIX written with I, V, X, L. One letter (V, X, L) only after such a name: "Malcolm X", "I" stay.
ROMAN = _re(r"\b([A-Z][a-z]+) ([IVXL]{1,8})\b(?!['’-]?\w)")
ROMAN_VALUE = {"I": 1, "V": 5, "X": 10, "L": 50}
REGNAL = frozenset("Henry Elizabeth Louis George Edward Charles William James Richard John Paul Benedict Pius "
                   "Gregory Leo Innocent Clement Philip Frederick Peter Catherine Mary Victor Alexander Nicholas Ivan "
                   "Napoleon Ramesses Constantine Alfonso Ferdinand Felipe Carlos Juan Gustav Olaf Harald Haakon "
                   "Christian Rama Boniface Urban Sixtus Stephen Otto Francis Wilhelm Ludwig Henri Anne Victoria "
                   "Matilda Hugh David Robert Alexios Basil Leopold Sigismund Casimir Wladyslaw".split())


def roman(numeral: str) -> int | None:
    """The value of a Roman numeral written the standard way (I..LXXXIX), else None ("IIII", "VX", "IL")."""
    values = [ROMAN_VALUE[c] for c in numeral]
    total = sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))
    if not 0 < total < 90:
        return None
    out, rest = "", total
    for value, mark in ((50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        while rest >= value:
            out, rest = out + mark, rest - value
    return total if out == numeral else None

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
MONTH_ABBR = {m[:3].lower(): m for m in MONTHS} | {"sept": "September"}
DAY_MONTH = _re(r"\b(\d{1,2})(?:st|nd|rd|th)? (" + "|".join(MONTHS) + "|" + "|".join(a.title() for a in MONTH_ABBR)
                + r")\.?(?:,? (\d{4}))?\b")
MONTH_DAY = _re(r"\b(" + "|".join(MONTHS) + "|" + "|".join(a.title() for a in MONTH_ABBR)
                       + r")\.?\s+(\d{1,2})(?:st|nd|rd|th)?(?:,?\s+(\d{4}))?\b")


def real_date(year: int | None, month: int, day: int) -> bool:
    """Whether the calendar has that day (no year: any year's, so February 29 is real)."""
    if not 1 <= month <= 12 or day < 1:
        return False
    return day <= calendar.monthrange(2000 if year is None else year, month)[1]


CONTEXT = 64  # characters around a match its reading looks at (a cue word before, punctuation after)


def _before(m: re.Match) -> str:
    """The text just before a match, for a cue word: a window, never the whole prefix (which made a long text's
    reading quadratic: every number searched everything before it); where it starts after the text does, a marker
    first, so that "nothing but spaces before it" stays true only at the text's start."""
    start = max(0, m.start() - CONTEXT)
    return ("" if start == 0 else "\x00") + m.string[start:m.start()]


def _after(m: re.Match) -> str:
    """The text just after a match; where the window ends before the text does, a marker that matches no `$`."""
    end = m.end() + CONTEXT
    return m.string[m.end():end] + ("" if end >= len(m.string) else "\x00")


def _decimal(s: str) -> Decimal:
    return Decimal(s.replace(",", ""))


def _spelled(address: str, words: dict[str, str], digit, join: str) -> str:
    """A URL or an e-mail address as said: its separators by name (`words`), its digits one by one (`digit`), the
    scheme, a query and a fragment left out."""
    body = re.sub(r"^https?://", "", address).split("?")[0].split("#")[0].rstrip("/")
    out = []
    for part in re.findall(r"[A-Za-z]+|\d|.", body):
        out.append(words.get(part, part) if not part.isdigit() else digit(part))
    return join.join(p for p in out if p)


class _NumberReader:
    """One language's reading of the patterns; `read` applies them in order to text without tags."""

    def read(self, text: str) -> str:
        for pattern, fn in self.rules():
            text = pattern.sub(lambda m, fn=fn: self.unglued(self.safely(fn, m), m), text)
        return text

    @staticmethod
    def unglued(said: str, m: re.Match) -> str:
        """A reading that ends in a Latin letter where the written form's last digit touched one ("5x", "1e308")
        gets a space, so the words never run into the letters ("five x", not "fivex")."""
        after = m.string[m.end():m.end() + 1]
        if said and after.isascii() and after.isalpha() and said[-1].isascii() and said[-1].isalpha() \
                and m.group()[-1:].isdigit():
            return said + " "
        return said

    def as_written(self, text: str) -> str:
        """A date or time that the calendar or the clock does not have (2026-13-45, 25:61), read as it is written:
        each number, and each separator by its name."""
        parts = re.findall(r"\d+|[-/:.]", text)
        return self.JOIN.join(self.SAID.get(p, p) if not p.isdigit() else self.number_words(p) for p in parts)

    def safely(self, fn, m: re.Match) -> str:
        """`fn(m)`; a number too long for the libraries' words (num2words stops at 10**306, cn2an at 16 digits) is
        read digit by digit, as a person reads one."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # cn2an warns of the decimals it cuts
                return fn(m) if not re.search(r"\d{16}", m.group()) else self.long_digits(m.group())
        except (ArithmeticError, ValueError):
            return self.long_digits(m.group())

    def long_digits(self, text: str) -> str:
        return re.sub(r"\d+", lambda d: f" {self.digits(d.group())} ", text).strip()

    def rules(self):
        raise NotImplementedError


class _English(_NumberReader):
    UNITS = {  # symbol -> (singular, plural); exact case
        "km/h": ("kilometer per hour", "kilometers per hour"), "mph": ("mile per hour", "miles per hour"),
        "m/s": ("meter per second", "meters per second"), "kWh": ("kilowatt hour", "kilowatt hours"),
        "kg": ("kilogram", "kilograms"), "mg": ("milligram", "milligrams"), "g": ("gram", "grams"),
        "km": ("kilometer", "kilometers"), "cm": ("centimeter", "centimeters"), "mm": ("millimeter", "millimeters"),
        "m": ("meter", "meters"), "mi": ("mile", "miles"), "ft": ("foot", "feet"),
        "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"), "oz": ("ounce", "ounces"),
        "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"), "l": ("liter", "liters"),
        "L": ("liter", "liters"), "°C": ("degree Celsius", "degrees Celsius"),
        "°F": ("degree Fahrenheit", "degrees Fahrenheit"), "°": ("degree", "degrees"),
        "TB": ("terabyte", "terabytes"), "GB": ("gigabyte", "gigabytes"), "MB": ("megabyte", "megabytes"),
        "KB": ("kilobyte", "kilobytes"), "kB": ("kilobyte", "kilobytes"), "GHz": ("gigahertz", "gigahertz"),
        "MHz": ("megahertz", "megahertz"), "kHz": ("kilohertz", "kilohertz"), "Hz": ("hertz", "hertz"),
        "kW": ("kilowatt", "kilowatts"), "W": ("watt", "watts"), "V": ("volt", "volts"),
        "ms": ("millisecond", "milliseconds"), "min": ("minute", "minutes"), "h": ("hour", "hours"),
        "hr": ("hour", "hours"), "hrs": ("hour", "hours"), "s": ("second", "seconds"), "sec": ("second", "seconds"),
        "Mbps": ("megabit per second", "megabits per second"), "Gbps": ("gigabit per second", "gigabits per second"),
        "kbps": ("kilobit per second", "kilobits per second"), "Mb": ("megabit", "megabits"),
        "Gb": ("gigabit", "gigabits"), "tsp": ("teaspoon", "teaspoons"), "tbsp": ("tablespoon", "tablespoons"),
        "tbs": ("tablespoon", "tablespoons"), "fl oz": ("fluid ounce", "fluid ounces"),
        "fl. oz": ("fluid ounce", "fluid ounces"), "qt": ("quart", "quarts"), "pt": ("pint", "pints"),
        "gal": ("gallon", "gallons"), "c": ("cup", "cups"), "cl": ("centiliter", "centiliters"),
        "dl": ("deciliter", "deciliters"), "doz": ("dozen", "dozen"), "kcal": ("kilocalorie", "kilocalories"),
    }
    # units written in any case (Tbsp, TSP, Oz), and a unit that is one letter only with its period (3 c. flour: cups)
    ANY_CASE = ("tsp", "tbsp", "tbs", "fl oz", "fl. oz", "qt", "pt", "gal", "doz", "oz", "lb", "lbs")
    DOTTED = ("c",)
    # the second half of a compound unit, MB/s, kg/cm: "megabytes per second" (km/h, m/s are units of their own)
    PER = ("s", "sec", "min", "h", "hr", "ms", "m", "cm", "mm", "km", "kg", "g", "l", "L", "ml", "mL")
    CURRENCY = {"$": "USD", "US$": "USD", "€": "EUR", "£": "GBP", "¥": "JPY", "USD": "USD", "EUR": "EUR",
                "GBP": "GBP"}
    NAMES = {"USD": (("dollar", "dollars"), ("cent", "cents")), "EUR": (("euro", "euros"), ("cent", "cents")),
             "GBP": (("pound", "pounds"), ("penny", "pence")), "JPY": (("yen", "yen"), ("sen", "sen"))}
    SCALE = {"k": "thousand", "K": "thousand", "m": "million", "M": "million", "million": "million",
             "bn": "billion", "B": "billion", "billion": "billion", "trillion": "trillion"}
    YEAR_CUES = _re(r"(?:\b(?:in|since|by|of|from|until|till|to|year|around|before|after|early|late|mid|"
                           r"circa|during|through|and|or|the|between)|\bQ (?:one|two|three|four))\s*$", re.IGNORECASE)

    def __init__(self):
        from num2words import num2words

        self.n2w = lambda n, **kw: num2words(n, **kw).replace(",", "")
        alone = "|".join(f"(?i:{re.escape(u)})" if u in self.ANY_CASE else
                         rf"{re.escape(u)}(?=\.)" if u in self.DOTTED else re.escape(u)
                         for u in sorted(self.UNITS, key=len, reverse=True))
        per = "|".join(re.escape(u) for u in sorted(self.PER, key=len, reverse=True))
        # an abbreviation's period inside a sentence (8 oz. of cream) is not said; one before a capital ends it
        dot = r"(?:\.(?=\s+[a-z]))?"
        self.measure = _re(rf"(?<![\w.])(-?)({NUM})\s?((?:{alone})/(?:{per})|{alone}){dot}(?![\w/])")
        self.part_measure = _re(rf"(?<![\w/.])(?:(\d+) )?(\d{{1,2}})/(\d{{1,2}})\s?({alone}){dot}(?![\w/])")
        # a unit after "per", after "a" following a number (3 a kg: not one letter), or after money's slash ($6/lb)
        self.per_unit = _re(rf"(?:(?<![\w.])per\s+|(?<=\d)\s?/\s?|(?<=\d )an?\s+(?=\w\w))({alone}){dot}(?![\w/])")
        self.dimension = _re(rf"(?<![\w.])({NUM})\s?[x×]\s?({NUM})(?:\s?[x×]\s?({NUM}))?"
                             rf"(?:\s?({alone}))?(?![\w/])(?![.,]\d)")
        symbols = "|".join(re.escape(s) for s in sorted(self.CURRENCY, key=len, reverse=True))
        scale = "|".join(sorted(self.SCALE, key=len, reverse=True))
        self.money = _re(rf"(?<![\w])({symbols})\s?({NUM})(?:\s?({scale})\b)?"
                                rf"|(?<![\w.])({NUM})\s?(USD|EUR|GBP)\b")

    def cardinal(self, s: str) -> str:
        d = _decimal(s)
        if d == d.to_integral_value() and "." not in s:
            return self.n2w(int(d))
        whole, _, frac = s.replace(",", "").partition(".")
        return f"{self.n2w(int(whole))} point " + " ".join(self.n2w(int(c)) for c in frac)

    def digits(self, s: str) -> str:
        return " ".join(self.n2w(int(c)) for c in s if c.isdigit())

    def rules(self):
        return [(EMAIL, self.email), (URL, self.url), (ABBREVIATION, lambda m: abbreviations.read(m, _before(m))),
                (self.per_unit, self.unit_per), (PHONE, self.phone), (CALLED, self.called),
                (ISO_DATE, self.iso_date), (MONTH_DAY, self.month_day), (DAY_MONTH, self.day_month),
                (self.part_measure, self.part_unit), (MIXED, self.mixed), (SLASH_DATE, self.slash), (DAYS, self.days),
                (VULGAR, self.vulgar),
                (CENTS, lambda m: f"{self.n2w(int(m.group(1)))} cent{'s' if m.group(1) != '1' else ''}"),
                (DASH, lambda m: " to "), (LEADING_POINT, lambda m: "0" + m.group()), (TIME, self.time),
                (CLOCK, lambda m: self.as_written(m.group())), (HOUR, self.hour),
                (VERSION, self.version), (DECADE, self.decade), (QUARTER, lambda m: f"Q {self.n2w(int(m.group(1)))}"),
                (self.dimension, self.dimensions), (ROMAN, self.roman),
                (self.money, self.cash),
                (PERCENT, self.percent), (self.measure, self.unit), (RANGE, self.range), (ORDINAL, self.ordinal),
                (NUMBER, self.number)]

    SAID = {".": "dot", "/": "slash", "-": "dash", "_": "underscore", ":": "colon", "@": "at", "www": "w w w",
            "+": "plus", "~": "tilde"}

    def url(self, m):
        return _spelled(m.group(), self.SAID, lambda d: self.n2w(int(d)), " ")

    email = url

    def called(self, m):
        return self.digits(m.group(1))

    def day_month(self, m):
        month = MONTH_ABBR[m.group(2).lower()[:3]]
        return self.date_words(MONTHS.index(month) + 1, int(m.group(1)), m.group(3)) or m.group()

    def days(self, m):
        return f"{DAY_NAMES[m.group(1).lower()[:3]]} to {DAY_NAMES[m.group(2).lower()[:3]]}"

    def mixed(self, m):
        whole, a, b = int(m.group(1)), int(m.group(2)), int(m.group(3))
        part = self.fraction(a, b)
        part = {"one half": "a half", "one quarter": "a quarter"}.get(part, part)
        return f"{self.n2w(whole)} and {part}"

    def unit_per(self, m):
        """One of a unit after "per", "a" or a slash: "per hour", "a kilogram", ($6/lb) " per pound"."""
        lead = m.group()[:m.start(1) - m.start()].strip()
        return f"{' per' if lead == '/' else lead} {self.unit_words(m.group(1), '1')}"

    def part_unit(self, m):
        """A fraction of a unit (1/2 tsp: "one half teaspoon"; 1 1/2 cups: "one and a half cups")."""
        said = self.mixed(m) if m.group(1) else self.fraction(int(m.group(2)), int(m.group(3)))
        return f"{said} {self.unit_words(m.group(4), 'many' if m.group(1) else '1')}"

    def vulgar(self, m):
        a, b = FRACTIONS[m.group()]
        return self.fraction(a, b)

    def phone(self, m):
        groups = re.findall(r"\d+", m.group())
        lead = "plus " if m.group().startswith("+") else ""
        return lead + ", ".join(self.digits(g) for g in groups)

    def date_words(self, month: int, day: int, year: str | None) -> str | None:
        y = None if not year else int(year) if len(year) == 4 else 2000 + int(year)
        if not real_date(y, month, day):
            return None
        out = f"{MONTHS[month - 1]} {self.n2w(day, to='ordinal')}"
        if y is not None:
            out += f", {self.n2w(y, to='year')}"
        return out

    def number_words(self, s: str) -> str:
        return self.cardinal(s)

    JOIN = " "

    def iso_date(self, m):
        return self.date_words(int(m.group(2)), int(m.group(3)), m.group(1)) or self.as_written(m.group())

    def month_day(self, m):
        month = MONTH_ABBR[m.group(1).lower()[:3]]
        return self.date_words(MONTHS.index(month) + 1, int(m.group(2)), m.group(3)) or m.group()

    def slash(self, m):
        a, b, year = int(m.group(1)), int(m.group(2)), m.group(3)
        before = _before(m)
        dated = year or re.search(r"\b(?:on|since|by|until|till|from|due|dated|before|after)\s*$", before, re.I)
        if not dated and b <= 10 and 0 < a < b:
            return self.fraction(a, b)
        if year:  # a day, a month and a year: a date, or written as one
            return self.date_words(a, b, year) or self.as_written(m.group())
        return self.date_words(a, b, year) or (self.fraction(a, b) if b else m.group())

    def fraction(self, a: int, b: int) -> str:
        names = {2: ("half", "halves"), 4: ("quarter", "quarters")}
        one, many = names.get(b, (self.n2w(b, to="ordinal"), self.n2w(b, to="ordinal") + "s"))
        return f"{self.n2w(a)} {one if a == 1 else many}"

    def time(self, m):
        hour, minute, second, half = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        said = self.n2w(hour)
        if minute == 0:
            said += "" if half else " o'clock" if hour <= 12 else " hundred"
        elif minute < 10:
            said += f" oh {self.n2w(minute)}"
        else:
            said += f" {self.n2w(minute)}"
        if second:
            said += f" and {self.n2w(int(second))} seconds"
        if half:
            said += " a m" if half.lower() == "a" else " p m"
        return said

    def cash(self, m):
        if m.group(4):
            amount, code, scale = m.group(4), self.CURRENCY[m.group(5)], None
        else:
            amount, code, scale = m.group(2), self.CURRENCY[m.group(1)], m.group(3)
        (one, many), (cent, cents) = self.NAMES[code]
        d = _decimal(amount)
        if scale:
            return f"{self.cardinal(amount)} {self.SCALE[scale]} {many}"
        whole = int(d)
        rest = int((d - whole) * 100)
        said = f"{self.n2w(whole)} {one if whole == 1 else many}"
        if rest and code != "JPY":
            cents_said = f"{self.n2w(rest)} {cent if rest == 1 else cents}"
            said = cents_said if not whole else f"{said} and {cents_said}"
        return said

    def hour(self, m):
        return f"{self.n2w(int(m.group(1)))} {'a' if m.group(2).lower() == 'a' else 'p'} m"

    def version(self, m):
        return " point ".join(self.n2w(int(p)) for p in m.group().split("."))

    def decade(self, m):
        said = self.n2w(int((m.group(1) or "") + m.group(2)), to="year") if m.group(1) else self.n2w(int(m.group(2)))
        return said[:-1] + "ies" if said.endswith("y") else said + "s"

    def percent(self, m):
        return f"{'minus ' if m.group(1) else ''}{self.cardinal(m.group(2))} percent"

    def unit_words(self, symbol: str, value: str) -> str:
        if "/" in symbol:  # a compound, MB/s: "megabytes per second"
            first, _, second = symbol.partition("/")
            return f"{self.unit_words(first, value)} per {self.UNITS[second][0]}"
        one, many = self.UNITS.get(symbol) or self.UNITS[symbol.lower()]
        return one if value == "1" else many

    def unit(self, m):
        value = m.group(2)
        return f"{'minus ' if m.group(1) else ''}{self.cardinal(value)} {self.unit_words(m.group(3), value)}"

    def dimensions(self, m):
        sides = [self.cardinal(g) for g in m.groups()[:3] if g]
        unit = f" {self.unit_words(m.group(4), 'many')}" if m.group(4) else ""
        return " by ".join(sides) + unit

    def roman(self, m):
        name, numeral = m.group(1), m.group(2)
        value = roman(numeral)
        if value is None or (len(numeral) == 1 and name not in REGNAL) or numeral == "I":
            return m.group()
        if name in REGNAL:
            return f"{name} the {self.n2w(value, to='ordinal')}"
        return f"{name} {self.n2w(value)}"

    def range(self, m):
        return f"{self.cardinal(m.group(1))} to {self.cardinal(m.group(2))}"

    def ordinal(self, m):
        return self.n2w(int(m.group(1)), to="ordinal")

    def number(self, m):
        sign, s = m.group(1), m.group(2)
        if not sign and re.fullmatch(r"1\d\d\d|20\d\d", s):
            before, after = _before(m), _after(m)
            cued = self.YEAR_CUES.search(before)
            if cued or (s[1] != "0" and (not before.strip() or re.match(r"\s*(?:[.,;:!?)]|$|s\b)", after))):
                return self.n2w(int(s), to="year")
        return f"{'minus ' if sign else ''}{self.cardinal(s)}"


class _Chinese(_NumberReader):
    UNITS = {"km/h": ("每小时", "公里"), "m/s": ("每秒", "米"), "kg": ("", "千克"), "mg": ("", "毫克"),
             "g": ("", "克"), "km": ("", "公里"), "cm": ("", "厘米"), "mm": ("", "毫米"), "m": ("", "米"),
             "ml": ("", "毫升"), "mL": ("", "毫升"), "L": ("", "升"), "°C": ("", "摄氏度"), "℃": ("", "摄氏度"),
             "°F": ("", "华氏度"), "GB": ("", "GB"), "MB": ("", "MB"), "TB": ("", "TB"), "kWh": ("", "千瓦时"),
             "GHz": ("", "吉赫兹"), "Hz": ("", "赫兹"), "kW": ("", "千瓦"), "W": ("", "瓦"), "V": ("", "伏")}
    CURRENCY = {"¥": "元", "￥": "元", "$": "美元", "US$": "美元", "€": "欧元", "£": "英镑", "HK$": "港元"}
    DIGITS = "零一二三四五六七八九"

    def __init__(self):
        import cn2an

        self.cn2an = cn2an
        units = sorted(self.UNITS, key=len, reverse=True)
        self.measure = _re(rf"(?<!\d)(-?)({NUM})\s?(" + "|".join(re.escape(u) for u in units) + r")(?![A-Za-z/])")
        symbols = "|".join(re.escape(s) for s in sorted(self.CURRENCY, key=len, reverse=True))
        self.money = _re(rf"({symbols})\s?({NUM})(万|亿)?")
        self.zh_date = _re(r"(\d{4})年(?:(\d{1,2})月(?:(\d{1,2})[日号])?)?|(\d{1,2})月(\d{1,2})[日号]")
        self.dotted = _re(r"(?<![\w.])(\d{4})[/.](\d{1,2})[/.](\d{1,2})(?![\w.])")  # 2026/12/3, 2026.12.03
        self.year_span = _re(r"(?<!\d)(\d{4})(?=\s?[-–~至到]\s?\d{4}年)")
        self.two = _re(r"(?<![\d.第])2(?=[个次层年张位条件只本天台辆双对块岁点种门项])")

    def number_words(self, s: str) -> str:
        return self.cn2an.an2cn(s.replace(",", ""), "low")

    def digits(self, s: str) -> str:
        return "".join(self.DIGITS[int(c)] for c in s if c.isdigit())

    def rules(self):
        return [(EMAIL, self.url), (URL, self.url),
                (PHONE, lambda m: ("加" if m.group().startswith("+") else "") + self.digits(m.group())),
                (CALLED, lambda m: self.digits(m.group(1))), (ISO_DATE, self.iso_date), (self.dotted, self.iso_date),
                (self.year_span, lambda m: self.digits(m.group(1))), (self.zh_date, self.date),
                (TIME, self.time), (CLOCK, lambda m: self.as_written(m.group())),
                (DASH, lambda m: "到"), (VULGAR, lambda m: "{1}分之{0}".format(
                    *(self.number_words(str(n)) for n in FRACTIONS[m.group()]))), (self.money, self.cash),
                (PERCENT, lambda m: ("负" if m.group(1) else "") + "百分之" + self.number_words(m.group(2))),
                (PER_MILLE, lambda m: "千分之" + self.number_words(m.group(1))), (self.two, lambda m: "两"),
                (self.measure, self.unit), (RANGE, lambda m: f"{self.number_words(m.group(1))}到"
                                            f"{self.number_words(m.group(2))}"),
                (FRACTION, lambda m: f"{self.number_words(m.group(2))}分之{self.number_words(m.group(1))}"),
                (NUMBER, lambda m: ("负" if m.group(1) else "") + self.number_words(m.group(2))),
                (SAID_DASH, lambda m: "到")]

    SAID = {".": "点", "/": "斜杠", "-": "杠", "_": "下划线", ":": "冒号", "@": "艾特", "+": "加"}

    def url(self, m):
        return _spelled(m.group(), self.SAID, self.digits, "")

    JOIN = ""

    def iso_date(self, m):
        y, mo, d = m.groups()
        if not real_date(int(y), int(mo), int(d)):
            return self.as_written(m.group())
        return f"{self.digits(y)}年{self.number_words(str(int(mo)))}月{self.number_words(str(int(d)))}日"

    def date(self, m):
        if m.group(4):
            return f"{self.number_words(m.group(4))}月{self.number_words(m.group(5))}{m.group()[-1]}"
        out = f"{self.digits(m.group(1))}年"
        if m.group(2):
            out += f"{self.number_words(m.group(2))}月"
        if m.group(3):
            out += f"{self.number_words(m.group(3))}{m.group()[-1]}"
        return out

    def time(self, m):
        hour, minute, second = int(m.group(1)), int(m.group(2)), m.group(3)
        said = f"{'两' if hour == 2 else self.number_words(str(hour))}点"
        if minute:
            said += ("零" if minute < 10 else "") + f"{self.number_words(str(minute))}分"
        if second:
            said += f"{self.number_words(str(int(second)))}秒"
        if m.group(4):
            said = ("上午" if m.group(4).lower() == "a" else "下午") + said
        return said

    def cash(self, m):
        amount = m.group(2)
        try:
            _decimal(amount)
        except InvalidOperation:
            return m.group()
        return f"{self.number_words(amount)}{m.group(3) or ''}{self.CURRENCY[m.group(1)]}"

    def unit(self, m):
        before, word = self.UNITS[m.group(3)]
        return f"{before}{'负' if m.group(1) else ''}{self.number_words(m.group(2))}{word}"


class _Lazy:
    """The readers load their libraries on first use (the server imports this module whether or not it is on)."""

    def __init__(self, make):
        self.make, self.reader = make, None

    def get(self):
        if self.reader is None:
            self.reader = self.make()
        return self.reader

    def read(self, text: str) -> str:
        return self.get().read(text)


_EN, _ZH = _Lazy(_English), _Lazy(_Chinese)
SAY_AS_FORMATS = ("ymd", "mdy", "dmy", "md", "dm", "ym", "my", "y")


def say_as(kind: str, text: str, fmt: str | None = None, language: str = "en") -> str:
    """SSML's say-as (text/ssml.py): `text` read as `kind` (characters, cardinal, ordinal, date, telephone), in
    English; ValueError says why it cannot be (not a number, not a date of `fmt`)."""
    if language not in ("en", AUTO):
        raise ValueError("say-as reads English only")
    en = _EN.get()
    if not text:
        raise ValueError("it holds no text")
    if kind == "characters":
        return " ".join(en.n2w(int(c)) if c.isdigit() else c.upper() if c.isalpha() else c
                        for c in text if not c.isspace())
    if kind == "telephone":
        groups = re.findall(r"\d+", text)
        if not groups or re.search(r"[^\d\s().+-]", text):
            raise ValueError(f"{text!r} is not a telephone number")
        return ("plus " if text.lstrip().startswith("+") else "") + ", ".join(en.digits(g) for g in groups)
    if kind == "cardinal":
        if not re.fullmatch(rf"-?(?:{NUM})", text):
            raise ValueError(f"{text!r} is not a number")
        return ("minus " if text.startswith("-") else "") + en.cardinal(text.lstrip("-"))
    if kind == "ordinal":
        m = re.fullmatch(r"(\d+)(?:st|nd|rd|th)?", text, re.IGNORECASE)
        if not m:
            raise ValueError(f"{text!r} is not an ordinal number")
        return en.n2w(int(m.group(1)), to="ordinal")
    if kind == "date":
        return _date(en, text, fmt or "ymd")
    raise ValueError(f"say-as {kind!r} is not one this reader has")


def _date(en, text: str, fmt: str) -> str:
    if fmt not in SAY_AS_FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(SAY_AS_FORMATS)}")
    parts = re.findall(r"\d+", text)
    if len(parts) != len(fmt) or re.search(r"[^\d\s/.-]", text):
        raise ValueError(f"{text!r} is not a date written {fmt}")
    values = dict(zip(fmt, (int(p) for p in parts), strict=True))
    year = str(values["y"]) if "y" in values else None
    if "m" not in values:
        return en.n2w(int(year), to="year")
    if "d" not in values:
        if not 1 <= values["m"] <= 12:
            raise ValueError(f"{text!r} has no month {values['m']}")
        return f"{MONTHS[values['m'] - 1]} {en.n2w(int(year), to='year')}"
    said = en.date_words(values["m"], values["d"], year)
    if said is None:
        raise ValueError(f"{text!r} is not a day of the calendar")
    return said
