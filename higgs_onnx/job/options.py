"""The speech job's options, defined once: every field, its bound, its cross-field rules and, for every front door,
whether that door honours it or refuses it (and why).

A door (the command line, `POST /v1/audio/speech`, the text-in WebSocket, Wyoming, corpus rows, the Python API)
only turns its own input into a `{field: value}` dict and calls `SpeechOptions.build(values, door)`: a field the
door cannot honour is refused by name (`OptionError`, code `unsupported_parameter`), never accepted and ignored; a
value out of its bound is refused with the same sentence at every door (the command line names its flag instead of
the field). `OPTIONS` is also what docs/server.md's table of fields x doors and the test of every field at every
door (tests/test_doors.py) are made from.

The sampling fields (temperature, top_k, top_p, seed, max_rows) are `GenerationOptions`' own and keep their own
checks there; this table adds what a job does around generation: voice, references, blends, speed, takes, retries,
loudness, a lone run.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..extras import field_missing
from ..generation.blend import MODES
from ..generation.options import GenerationOptions
from ..guard import MAX_RETRIES
from ..guard import check_retries as guard_retries
from ..loudness import RANGE as LOUDNESS_RANGE
from ..loudness import check_target
from ..text.directions import MODES as DIRECTION_MODES
from ..text.directions import SPEED_RANGE, check_mode, speed_tag
from ..text.lexicon import MAX_ENTRIES, Lexicon, LexiconError
from ..text.pipeline import EMOJI, Reading, TextOptions, check_emoji, check_normalize

DOORS = {
    "cli": "inference.py",
    "http": "POST /v1/audio/speech",
    "websocket": "the text-in WebSocket (/v1/audio/speech/stream)",
    "wyoming": "Wyoming",
    "corpus": "a corpus row (python -m higgs_onnx.corpus)",
    "python": "the Python API (HiggsTTS)",
    "cartesia": "Cartesia's TTS WebSocket (/tts/websocket)",
    "cartesia_bytes": "Cartesia's bytes endpoint (POST /tts/bytes)",
    "elevenlabs": "ElevenLabs' stream-input WebSockets (/v1/text-to-speech/{voice_id}/multi-stream-input)",
}
# The voice-agent doors (docs/agents.md) speak another vendor's protocol: a field of ours is honoured there only as
# one of the protocol's own fields (named here, as the door's messages name it); every other is absent, and the
# protocol's fields with no meaning here are refused by name by the door itself (serve/streams/cartesia.py,
# elevenlabs.py, serve/cartesia_bytes.py).
ALWAYS = "always: "
AGENT_FIELDS = {
    "cartesia": {"voice": "voice.id", "speed": "generation_config.speed", "caption_level": "add_timestamps",
                 "caption_language": "language"},
    "cartesia_bytes": {"voice": "voice.id", "speed": "generation_config.speed", "caption_language": "language"},
    "elevenlabs": {"voice": "voice_id", "speed": "voice_settings.speed", "normalize": "apply_text_normalization",
                   "seed": "seed", "caption_level": ALWAYS + "alignment", "caption_language": "language_code"},
}
ABSENT = "absent"  # the door's protocol has no place for the field (Wyoming's events carry text and a voice name)
STREAMED = "audio is sent as it is made, segment by segment, so nothing can wait for a whole take"
PREPARE = ("prepare the text first: higgs_onnx.job.run.read_text(tts, text, normalize=..., markdown=...) returns "
           "what to pass")
MAX_TAKES = 16  # takes of one request: each is a batch row (its own slot)
CAPTION_LEVELS = ("piece", "word")


@dataclass(frozen=True)
class Option:
    """One field of a speech job. `refused`: door -> why it cannot honour the field (ABSENT: the door has no such
    field at all). `flag`: its command-line flag (None: the command line takes it another way, see `cli_as`)."""

    name: str
    summary: str
    bound: str = ""  # the bound as the docs write it
    flag: str | None = None
    cli_as: str | None = None  # how the command line gives it, when not as `flag`
    refused: dict[str, str] = field(default_factory=dict)
    always: dict[str, str] = field(default_factory=dict)  # door -> how it always does this, with no field for it

    def honoured_at(self, door: str) -> bool:
        return self.at(door) in ("honoured", "always")

    def at(self, door: str) -> str:
        """honoured / always / refused / absent at `door`."""
        if door in AGENT_FIELDS:
            named = AGENT_FIELDS[door].get(self.name)
            return ABSENT if named is None else "always" if named.startswith(ALWAYS) else "honoured"
        why = self.refused.get(door)
        if why is None:
            return "always" if door in self.always else "honoured"
        return ABSENT if why == ABSENT else "refused"

    def label(self, door: str) -> str:
        """The name a message at `door` gives the field."""
        if door in AGENT_FIELDS:
            return AGENT_FIELDS[door].get(self.name, self.name).removeprefix(ALWAYS)
        return (self.flag or self.name) if door == "cli" else self.name


_SAMPLING_ABSENT = {"wyoming": ABSENT}
OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("voice", "a saved voice, or a blend NAME:WEIGHT,...", "a saved voice; a blend of at most 8",
           "--voice", refused={}),
    Option("references", "reference audio (and transcript) sent with the job itself: Boson's ref_audio/ref_text, "
           "sglang-omni's references", "at most 8 (a blend of them)", None, "--ref-audio",
           refused={"wyoming": ABSENT, "corpus": "a row names a saved voice (make one with --save-voice)"}),
    Option("blend_mode", "how a blend mixes its voices", " or ".join(MODES), "--blend-mode",
           refused={"websocket": "a blend runs a KV cache per voice, which cannot continue across segments",
                    "wyoming": ABSENT, "corpus": "a row names one saved voice"}),
    Option("temperature", "sampling temperature (0 = greedy)", ">= 0", "--temperature", refused=_SAMPLING_ABSENT),
    Option("top_k", "top-k sampling (0 = off)", ">= 0", "--top-k", refused=_SAMPLING_ABSENT),
    Option("top_p", "nucleus sampling (1 = off)", "(0, 1]", "--top-p", refused=_SAMPLING_ABSENT),
    Option("seed", "the job's own sampler seed", ">= 0", "--seed", refused=_SAMPLING_ABSENT),
    Option("max_rows", "most code rows (decoder steps) to generate", ">= 1, and must fit", "--max-rows",
           refused=_SAMPLING_ABSENT),
    Option("speed", "the model's prosody speed tag (it has no continuous speed)",
           f"{SPEED_RANGE[0]:g} to {SPEED_RANGE[1]:g}", "--speed",
           refused={"wyoming": ABSENT, "corpus": "write the speed tag in the row's text",
                    "python": "write the speed tag in the text (<|prosody:speed_slow|>)"}),
    Option("takes", "best of N takes, each judged by the guard", f"1 to {MAX_TAKES}; needs sampling", "--takes",
           refused={"websocket": STREAMED, "wyoming": ABSENT,
                    "corpus": "a row is one take; --retries redraws a degenerate one"}),
    Option("retries", "redraws of a take the guard finds degenerate", f"0 to {MAX_RETRIES}", "--retries",
           refused={"websocket": STREAMED, "wyoming": ABSENT,
                    "corpus": "set for the whole corpus with --retries"}),
    Option("loudness", "EBU R128 integrated loudness of the whole take, in LUFS",
           f"{LOUDNESS_RANGE[0]:g} to {LOUDNESS_RANGE[1]:g}", "--loudness",
           refused={"websocket": STREAMED, "wyoming": ABSENT, "corpus": "set for the whole corpus with --loudness",
                    "python": "bring a result to a loudness with higgs_onnx.loudness.normalise"}),
    Option("deterministic", "run alone (a batch of one): the same audio as the job made alone, to the bit",
           "true or false", None,
           always={"cli": "every run is one job", "python": "a call runs in a scheduler of its own"},
           refused={"websocket": "each segment continues the one before in the shared batch", "wyoming": ABSENT,
                    "corpus": "rows are batched by design; a lone row is one inference.py run"}),
    Option("dry_run", "what the model would read and its prompt, checked as for real; nothing is generated",
           "true or false", "--dry-run",
           refused={"websocket": "a session speaks its text as it arrives; ask POST /v1/audio/speech with dry_run",
                    "wyoming": ABSENT, "corpus": "check the rows' texts with inference.py --dry-run --text-file",
                    "python": "HiggsTTS.request(text) builds and checks the request without generating"}),
    Option("instructions", "OpenAI's style instructions, mapped to the model's tags (docs/text.md)",
           "words of docs/text.md's table", "--instructions", refused={"wyoming": ABSENT, "python": PREPARE}),
    Option("normalize", "numbers, dates, money, units, URLs ... read out as words", "true, false, auto, en or zh",
           "--normalize", refused={"wyoming": ABSENT, "python": PREPARE}),
    Option("ssml", "the text is an SSML document (a subset: docs/text.md)", "true or false", "--ssml",
           refused={"websocket": "a session's text arrives in pieces, and an SSML document is read whole: send it "
                                 "to POST /v1/audio/speech", "wyoming": ABSENT, "python": PREPARE}),
    Option("markdown", "chat text: markdown read as prose", "true or false", "--markdown",
           refused={"wyoming": ABSENT, "python": PREPARE}),
    Option("emoji", "emoji dropped, named or kept (drop with markdown, else keep)", " or ".join(EMOJI), "--emoji",
           refused={"wyoming": ABSENT, "python": PREPARE}),
    Option("stage_directions", "[laughs], (sighs), *whispers*: made the model's tags, removed or kept",
           " or ".join(DIRECTION_MODES), "--stage-directions", refused={"wyoming": ABSENT, "python": PREPARE}),
    Option("lexicon", "words respelled the way the model should say them", f"at most {MAX_ENTRIES:,} words", None,
           "--lexicon FILE", refused={"wyoming": ABSENT, "python": PREPARE}),
    Option("caption_level", "cues per piece, or per word (timed by a forced aligner; English)",
           " or ".join(CAPTION_LEVELS), "--caption-level",
           refused={"wyoming": ABSENT,
                    "corpus": "a corpus writes no captions",
                    "python": "time a result's words with higgs_onnx.align.word_cues(samples, sample_rate, text)"}),
    Option("caption_language", "the language of the words timed (caption_level word): English is timed, another "
           "language's pieces keep their cues and say why", "a language code (en, de, pt-BR)", "--caption-language",
           refused={"wyoming": ABSENT, "corpus": "a corpus writes no captions",
                    "python": "time a result's words with higgs_onnx.align.word_cues(samples, sample_rate, text, "
                              "language)"}),
)}
SAMPLING = ("temperature", "top_k", "top_p", "seed", "max_rows")
TEXT = ("normalize", "ssml", "markdown", "emoji", "stage_directions", "lexicon", "instructions")
MAX_INSTRUCTIONS = 1000


class OptionError(ValueError):
    """A job option that cannot be used: one line, the field it is about and a code (`invalid_value`, or
    `unsupported_parameter` for a field the door refuses)."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


WHOLE, FINITE, BOOL, TEXT_KIND = "a whole number", "a finite number", "true or false", "a string"
KINDS = {"temperature": FINITE, "top_p": FINITE, "speed": FINITE, "loudness": FINITE, "top_k": WHOLE, "seed": WHOLE,
         "max_rows": WHOLE, "takes": WHOLE, "retries": WHOLE, "deterministic": BOOL, "dry_run": BOOL,
         "markdown": BOOL, "ssml": BOOL, "blend_mode": TEXT_KIND, "instructions": TEXT_KIND, "emoji": TEXT_KIND,
         "stage_directions": TEXT_KIND, "caption_level": TEXT_KIND, "caption_language": TEXT_KIND}


_IS = {WHOLE: lambda v: isinstance(v, int), BOOL: lambda v: isinstance(v, bool),
       TEXT_KIND: lambda v: isinstance(v, str), FINITE: lambda v: isinstance(v, (int, float)) and math.isfinite(v)}


def of_kind(value, kind: str, label: str, param: str | None = None):
    """`value`, or OptionError when it is not of `kind` (a bool is only ever true or false): the one sentence for a
    wrong type, `seed must be a whole number, got 1.5`."""
    if isinstance(value, bool) and kind != BOOL or not _IS[kind](value):
        raise OptionError(f"{label} must be {kind}, got {value!r:.40}", param)
    return value


def check_kind(name: str, value, label: str) -> None:
    """OptionError when `value` is not of the field's kind (`KINDS`), the same sentence at every door (HTTP and the
    WebSocket leave the type to this table; the command line's flags are typed by argparse)."""
    if name in KINDS:
        of_kind(value, KINDS[name], label, name)


def _integer(value, label: str) -> int:
    return of_kind(value, WHOLE, label)


def _number(value, label: str) -> float:
    return float(of_kind(value, FINITE, label))


def check_speed(value, label: str = "speed") -> float:
    v = _number(value, label)
    if not SPEED_RANGE[0] <= v <= SPEED_RANGE[1]:
        raise OptionError(f"{label} must be from {SPEED_RANGE[0]:g} to {SPEED_RANGE[1]:g}, got {value!r}", None)
    return v


def check_takes(value, label: str = "takes") -> int:
    v = _integer(value, label)
    if not 1 <= v <= MAX_TAKES:
        raise OptionError(f"{label} must be from 1 to {MAX_TAKES}, got {value!r}", None)
    return v


def check_retries(value, label: str = "retries") -> int:
    try:
        return guard_retries(value, label)  # the guard's own bound (RetryPolicy checks it too)
    except ValueError as e:
        raise OptionError(str(e), None) from None


def check_loudness(value, label: str = "loudness") -> float | None:
    try:
        return check_target(value, label)  # the loudness module's own bound
    except ValueError as e:
        raise OptionError(str(e), None) from None


def check_blend_mode(value, label: str = "blend_mode") -> str | None:
    if value is not None and value not in MODES:
        raise OptionError(f"{label} must be one of {', '.join(MODES)}, got {value!r}", None)
    return value


def check_bool(value, label: str) -> bool:
    return of_kind(value, BOOL, label)


def check_caption_level(value, label: str = "caption_level") -> str:
    if value not in CAPTION_LEVELS:
        raise OptionError(f"{label} must be one of {', '.join(CAPTION_LEVELS)}, got {value!r:.40}", None)
    return value


LANGUAGE_CODE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})?")


def check_caption_language(value, label: str = "caption_language") -> str:
    """A language code (en, de, pt-BR); its primary language, lower case, is what the aligner is asked for."""
    of_kind(value, TEXT_KIND, label)
    if not LANGUAGE_CODE.fullmatch(value):
        raise OptionError(f"{label} must be a language code such as en, de or pt-BR, got {value!r:.40}", None)
    return re.split(r"[-_]", value)[0].lower()


def _text_check(check):
    def run(value, label):
        try:
            return check(value, label)
        except ValueError as e:
            raise OptionError(str(e), None) from None
    return run


def check_lexicon(value, label: str = "lexicon") -> Lexicon:
    try:
        return value if isinstance(value, Lexicon) else Lexicon(value)
    except LexiconError as e:
        raise OptionError(str(e).replace("lexicon", label, 1), None) from None


def check_instructions(value, label: str = "instructions") -> str:
    of_kind(value, TEXT_KIND, label)
    if len(value) > MAX_INSTRUCTIONS:
        raise OptionError(f"{label} is {len(value)} characters long; the limit is {MAX_INSTRUCTIONS}", None)
    return value


TEXT_CHECKS = {"normalize": _text_check(check_normalize), "markdown": check_bool, "ssml": check_bool,
               "emoji": _text_check(check_emoji), "stage_directions": _text_check(check_mode),
               "lexicon": check_lexicon, "instructions": check_instructions}
CHECKS = {"speed": check_speed, "takes": check_takes, "retries": check_retries, "loudness": check_loudness,
          "blend_mode": check_blend_mode, "deterministic": check_bool, "dry_run": check_bool,
          "caption_level": check_caption_level, "caption_language": check_caption_language}


@dataclass(frozen=True)
class SpeechOptions:
    """What a speech job chooses beyond its text and voice, checked once (`build`)."""

    generation: GenerationOptions = GenerationOptions()
    speed: float = 1.0
    takes: int = 1
    retries: int = 0
    loudness: float | None = None
    deterministic: bool = False
    blend_mode: str | None = None
    dry_run: bool = False
    text: TextOptions = TextOptions()
    caption_level: str = "piece"  # word: each piece's cue carries its words, timed on its samples
    caption_language: str = "en"  # the aligner's language (align.ALIGN_LANGUAGES times words; others say why not)

    def read(self, text: str, tags) -> Reading:
        """What the model reads of `text` (the text steps; `tags`: the tokenizer's control tags), without the lead."""
        return dataclasses.replace(self.text, instructions=None).read(text, tags)

    def reader(self, tags):
        """The text steps as text -> text, for a stream's segments (None: it has none)."""
        if self.text.plain:
            return None
        return lambda text: self.read(text, tags).text

    def lead(self, tags) -> str:
        """What every request of the job starts with: the instructions' tags, then the speed tag.
        DirectionError for instructions the table cannot map."""
        from ..text.directions import instruction_tags

        said = "".join(instruction_tags(self.text.instructions, tags)) if (self.text.instructions or "").strip() \
            else ""
        return said + (speed_tag(self.speed, tags) or "")

    @property
    def whole_take(self) -> bool:
        """The take must be whole before it is sent (judged, or measured for loudness)."""
        return self.takes > 1 or self.retries > 0 or self.loudness is not None

    @classmethod
    def build(cls, values: Mapping[str, Any], door: str, base: SpeechOptions | None = None) -> SpeechOptions:
        """`values` (field -> value; None = not given) checked for `door` and laid over `base` (the door's
        defaults). OptionError for the first field the door refuses, the first value out of its bound, or a rule
        between fields that does not hold."""
        if door not in DOORS:
            raise ValueError(f"unknown door {door!r}")
        base = base or cls()
        for name, value in values.items():
            opt = OPTIONS.get(name)
            if opt is None or value is None:
                continue
            if not opt.honoured_at(door) and not _is_default(name, value):
                refuse(name, door)
        got = {k: v for k, v in values.items() if v is not None and k in OPTIONS}
        for name, value in got.items():  # the type first: one sentence for a wrong type at every door
            check_kind(name, value, OPTIONS[name].label(door))
        changes, text = _checked(got, CHECKS, door), _checked(got, TEXT_CHECKS, door)
        for name, value in got.items():  # work an extra does, asked for where it is not installed
            if not _is_default(name, value) and (name != "loudness" or value is not None):
                lack = field_missing(name, OPTIONS[name].label(door))
                if lack:
                    raise OptionError(str(lack), name, "unsupported_parameter")
        if "lexicon" in text and base.text.lexicon is not None:  # a job's words over the door's (a server's) own
            text["lexicon"] = base.text.lexicon.over(text["lexicon"].entries)
        if text:
            changes["text"] = dataclasses.replace(base.text, **text)
        sampling = {k: got[k] for k in SAMPLING if k in got}
        for name, value in sampling.items():  # each field alone first: its error carries its name
            label = OPTIONS[name].label(door)
            try:
                GenerationOptions.make(base.generation, **{name: value})
            except (TypeError, ValueError) as e:
                message = str(e)
                raise OptionError(label + message[len(name):] if message.startswith(name) else message,
                                  name) from None
        if sampling:
            try:
                changes["generation"] = GenerationOptions.make(base.generation, **sampling)
            except (TypeError, ValueError) as e:  # a rule between the sampling fields (none today)
                raise OptionError(str(e), next(iter(sampling))) from None
        out = dataclasses.replace(base, **changes) if changes else base
        out.check_rules(door)
        return out

    def check_rules(self, door: str, shape: Shape | None = None) -> None:
        """The rules between fields (`RULES`), the same at every door: OptionError naming the first that breaks.
        `shape`: what the door knows of the job besides its options (pieces, a blend, a live stream); the rules
        that need it are checked again once it is known (`job.run.SpeechJob.check`)."""
        shape = shape or Shape()
        for rule in RULES:
            if rule.breaks(self, shape):
                raise OptionError(rule.message(self, shape, door), rule.param(self), "unsupported_parameter"
                                  if rule.shaped else "invalid_value")


@dataclass(frozen=True)
class Shape:
    """What a door knows of a job besides its options, that a rule between fields needs: `pieces` (the input is
    read in this many pieces, each continuing the one before; 0: one request), `voices` (a blend's voices), `live`
    (audio leaves as it is made, before the take is whole: a stream to a player), `words` (the door's output has
    a place for timed words: SSE events, a captions file), `continues` (each segment continues the one before: the
    text-in WebSocket's session)."""

    pieces: int = 0
    voices: int = 1
    live: bool = False
    words: bool = True
    continues: bool = False


WORDS_PLACE = {"http": 'stream_format "sse": the words come on the stream\'s piece events',
               "cli": "--captions FILE with --out FILE: the words are timed on the written audio"}


def _labels(door: str) -> dict[str, str]:
    return {name: opt.label(door) for name, opt in OPTIONS.items()}


def _pieces(shape: Shape) -> str:
    if shape.continues:
        return "a session's segments each continue the one before"
    return (f"this input is read in {shape.pieces} pieces (it does not fit one request), each continuing the one "
            f"before")


def _paces(o: SpeechOptions) -> list[str]:
    from ..text.directions import paces

    return paces(o.text.instructions or "")


@dataclass(frozen=True)
class Rule:
    """One rule between fields (or between a field and the job's `Shape`): `fields` (the first is the one an error
    names, unless `names` picks another), `breaks(options, shape)`, and `why` (the message; `{takes}` ... are the
    fields as the door names them, `{pieces}` the pieces sentence, `{words}` where the door sends words).
    `shaped`: it depends on the shape, so it is a field the job cannot honour here (unsupported_parameter)."""

    name: str
    fields: tuple[str, ...]
    doors: tuple[str, ...]  # where a job can break it (the doors that honour its fields and have its shape)
    breaks: Any
    why: str
    shaped: bool = True
    names: Any = None  # options -> the field the error names (None: the first of `fields`)

    def param(self, o: SpeechOptions) -> str:
        return self.names(o) if self.names else self.fields[0]

    def message(self, o: SpeechOptions, shape: Shape, door: str) -> str:
        labels = _labels(door)
        return self.why.format(**labels, field=labels[self.param(o)], pieces=_pieces(shape),
                               words=WORDS_PLACE.get(door, ""), paces=", ".join(repr(w) for w in _paces(o)),
                               speed_value=f"{o.speed:g}")


def _judged(o: SpeechOptions) -> str:
    return "takes" if o.takes > 1 else "retries"


def _whole(o: SpeechOptions) -> str:
    return "takes" if o.takes > 1 else "retries" if o.retries else "loudness"


_EXAMPLE_SHAPE = Shape(pieces=3)
RULES: tuple[Rule, ...] = (
    Rule("takes or retries", ("takes", "retries"), ("cli", "http"), lambda o, s: o.takes > 1 and o.retries > 0,
         "give {takes} or {retries}, not both", shaped=False),
    Rule("takes need sampling", ("takes", "temperature"), ("cli", "http", "python"),
         lambda o, s: o.takes > 1 and o.generation.temperature == 0,
         "{takes} > 1 needs sampling ({temperature} > 0): greedy takes are all the same", shaped=False),
    Rule("one pace", ("speed", "instructions"), ("cli", "http", "websocket"),
         lambda o, s: o.speed != 1.0 and bool(_paces(o)),
         "{instructions} set a pace ({paces}) and {speed} sets another ({speed_value}): give one of them",
         shaped=False),
    Rule("takes of a blend", ("takes", "voice"), ("cli", "http", "python"), lambda o, s: o.takes > 1 and s.voices > 1,
         "{takes} > 1 is not supported with a blend of voices (each take would need a batch row per voice); use "
         "{retries}"),
    Rule("a whole take, live", ("takes", "retries", "loudness"), ("cli",),
         lambda o, s: s.live and (o.takes > 1 or o.retries > 0 or o.loudness is not None),
         "{field} needs the whole take before it is sent, but this audio leaves as it is made", names=_whole),
    Rule("takes of pieces", ("takes", "retries"), ("http",),
         lambda o, s: s.pieces > 1 and (o.takes > 1 or o.retries > 0),
         "{field} judge one whole take, but {pieces}; send it without {field}, or in shorter requests",
         names=_judged),
    Rule("a lone run of pieces", ("deterministic",), ("http",), lambda o, s: s.pieces > 1 and o.deterministic,
         "{deterministic} runs one request alone, but {pieces}, which the scheduler batches; send it without "
         "{deterministic}, or in shorter requests"),
    Rule("a blend of pieces", ("voice",), ("http", "websocket"),
         lambda o, s: (s.pieces > 1 or s.continues) and s.voices > 1,
         "a blend of voices cannot continue earlier speech (it runs a KV cache per voice), but {pieces}; use one "
         "voice"),
    Rule("words need a place", ("caption_level",), ("cli", "http"),
         lambda o, s: o.caption_level == "word" and not s.words,
         "{caption_level} word needs {words}"),
)


_EXAMPLE = SpeechOptions(speed=1.5, takes=2, text=TextOptions(instructions="slowly"))


def _checked(got: Mapping[str, Any], checks, door: str) -> dict[str, Any]:
    """The given fields that `checks` checks, each checked with the name `door` gives it; OptionError names it."""
    out = {}
    for name, check in checks.items():
        if name in got:
            try:
                out[name] = check(got[name], OPTIONS[name].label(door))
            except OptionError as e:
                raise OptionError(e.message, name) from None
    return out


def _is_default(name: str, value) -> bool:
    """A refused field sent with the value that asks for nothing (takes 1, retries 0, speed 1, false, empty
    instructions) is let through: there is nothing the door would have to ignore."""
    if name == "instructions":
        return isinstance(value, str) and not value.strip()
    if name in ("deterministic", "dry_run", "normalize", "markdown", "ssml"):
        return value is False
    if name in ("emoji", "stage_directions"):
        return value == "keep"
    if name == "caption_level":
        return value == "piece"
    if name == "caption_language":
        return isinstance(value, str) and value.lower() in ("en", "en-us", "en-gb", "en_us", "en_gb")
    if name == "lexicon":
        return value == {}
    neutral = {"takes": 1, "retries": 0, "speed": 1.0}
    return name in neutral and not isinstance(value, bool) and value == neutral[name]


def refuse(name: str, door: str) -> None:
    """OptionError: `door` cannot honour the field `name` (why, from the table)."""
    opt = OPTIONS[name]
    why = ABSENT if opt.at(door) == ABSENT else opt.refused.get(door, "")
    where = DOORS[door]
    if why == ABSENT:
        why = f"{where} has no such field"
    raise OptionError(f"{opt.label(door)} is not supported by {where}: {why}", name, "unsupported_parameter")


def door_table() -> str:
    """The markdown table of fields x doors (docs/server.md holds it; a test checks it is this one)."""
    doors = list(DOORS)
    mark = {"honoured": "yes", "always": "always", "refused": "refused", "absent": "—"}
    head = "| field | bound | " + " | ".join(doors) + " |"
    rule = "|---|---|" + "---|" * len(doors)
    rows = []
    for o in OPTIONS.values():
        cells = []
        for d in doors:
            cell = mark[o.at(d)]
            if d == "cli" and cell == "yes":
                cell = f"`{o.flag}`" if o.flag else f"`{o.cli_as}`"
            elif d in AGENT_FIELDS and cell in ("yes", "always"):
                cell = f"{'always, ' if cell == 'always' else ''}`{o.label(d)}`"
            cells.append(cell)
        rows.append(f"| `{o.name}` | {o.bound or '—'} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])


def rules_table() -> str:
    """The markdown table of the rules between fields (docs/server.md holds it; a test checks it is this one, and
    tests/test_doors.py breaks every rule at every door it lists)."""
    rows = [f"| {r.name} | {', '.join(f'`{f}`' for f in r.fields)} | {', '.join(r.doors)} | "
            f"{r.message(_EXAMPLE, _EXAMPLE_SHAPE, 'http')} |" for r in RULES]
    return "\n".join(["| rule | fields | checked at | the error (as HTTP words it) |", "|---|---|---|---|", *rows])


def add_text_flags(ap, where: str = "the text", ssml_refused: str | None = None) -> None:
    """The text steps' command-line flags (inference.py, and the servers' defaults for every request).
    `ssml_refused`: why this command refuses `--ssml` (its help then says so, in the words of its error)."""
    ap.add_argument("--normalize", nargs="?", const=True, default=None, metavar="LANG",
                    help=f"read numbers, dates, money, units, URLs ... in {where} as words: en, zh, or auto (the "
                    "default when LANG is left out) (docs/text.md)")
    ap.add_argument("--ssml", action="store_const", const=True, default=None,
                    help=f"refused: --ssml {ssml_refused}" if ssml_refused else
                    f"{where} is an SSML document: <speak>, <break>, <prosody rate/pitch>, <say-as>, <sub>, "
                    "<emphasis> (docs/text.md); anything else is refused")
    ap.add_argument("--markdown", action="store_const", const=True, default=None,
                    help=f"{where} is chat text: read its markdown as prose (lists, tables, links; code dropped)")
    ap.add_argument("--emoji", metavar="MODE", help="drop, name or keep emoji (default: drop with --markdown, else "
                    "keep)")
    ap.add_argument("--stage-directions", metavar="MODE", help="[laughs], (sighs), *whispers*: tags (the model's "
                    "own, where it has one; else removed), remove, or keep (the default)")
    ap.add_argument("--lexicon", metavar="FILE", help="respellings, one 'word<TAB>respelling' or 'word = "
                    "respelling' a line (or a JSON object): whole words, never inside tags")
    ap.add_argument("--instructions", metavar="TEXT", help="OpenAI-style instructions ('cheerful, slowly'), "
                    "mapped to the model's tags; a word it cannot map is refused")


def text_values(args) -> dict:
    """The text flags as option values (a lexicon file is read here: LexiconError for a bad one)."""
    from ..text.lexicon import load

    values = {name: getattr(args, name, None) for name in TEXT}
    if values["lexicon"] is not None:
        values["lexicon"] = load(values["lexicon"])
    return values
