"""Text that arrives while the turn is spoken: incremental tokenization and the turn's segments.

A dual-track session reads one text token per frame (spec §4.5), so it can start on the first words
of an LLM's reply. `TurnText` takes the reply in pieces of any size and hands out final tokens:
a token is released only once no later text can change it, so the tokens of any split of a text
are those of the whole text.

Where a token is final follows from the tokenizer's steps (Qwen2/Qwen3, `checkpoints/load.py`):

* added tokens (`<|im_end|>`, `<tts_pad>`, ...) are found in the raw text first: text that could
  be the start of one is held back;
* NFC normalization: a boundary needs its two characters to normalize apart (no combining mark
  after it, no Hangul jamo pair across it);
* the pre-tokenizer regex: a leading space joins the next word, one punctuation character joins a
  following word, runs of punctuation take the newlines after them, whitespace runs look ahead.
  A boundary is safe after a letter run (before a non-letter), after a digit (each digit is its
  own piece), and after punctuation before a digit or a space or tab (not a newline). Never after
  whitespace, so an unfinished word and the space before it wait for what follows;
* byte-level BPE works inside one pre-token, so text between two safe boundaries (a "piece")
  tokenizes on its own as it does inside the whole text.

A character the running Python's Unicode tables do not know is never next to a boundary (the
tokenizer's own tables may be newer).

Segments. The engine splits a turn into segments of at most MAX_SEGMENT_TOKENS tokens (a fresh
prompt each, one voice stream across them). A segment that is fed while its text arrives cannot
take back a token, so the split must be decided from the text seen so far. The rule, the same for
a whole dual-track text (`turn_segments`) so that both give the same segments: a turn that fits is
one segment, unchanged; a segment that would overflow ends at its last sentence end after at least
SENTENCE_MIN_SHARE of its tokens, else before the piece that overflows (a run too long for a
segment is cut where its tokens allow). The tokens of a segment past that share are held until
the choice is made (the text overflows or ends). Segments after a cut start without the whitespace
around the cut.

Just over 500 lines: the token rule and the segment rule must agree for any split of a text,
and they are checked together (tests/test_text_stream.py).
"""

from __future__ import annotations

import re
import threading
import unicodedata
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from pipecat_qwen_fast.engine.text import MAX_SEGMENT_TOKENS, mend_surrogates
from pipecat_qwen_fast.errors import InvalidInputError

# A segment that must end does so at a sentence end from this share of its tokens on (120 of
# 200): late enough that segments stay long (each one restarts the talker), early enough that a
# sentence of up to the other 80 tokens still finds its end inside the segment.
SENTENCE_MIN_SHARE = 0.6
# A run too long for one segment is cut inside a window of this many characters per allowed token
# (as engine/text.py does): each cut tokenizes a bounded window, never the whole run again.
_CUT_WINDOW_CHARS_PER_TOKEN = 8

_ASCII_TERMINALS = frozenset(".!?;…")
_CJK_TERMINALS = frozenset("。！？；")

# The Unicode White_Space set, which the tokenizer's regex engine uses for \s; Python's isspace()
# also counts U+001C..U+001F, which the tokenizer does not.
_WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B)
)

# Two letters side by side never have a boundary between them: runs of letters are skipped
# whole (a run of numerals other than digits is skipped too, which only makes pieces longer).
_LETTER_RUN = re.compile(r"[^\W\d_]{2,}")

_TEMPLATE_HEAD = "<|im_start|>assistant\n"
_TEMPLATE_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


class TextEndedError(InvalidInputError):
    """Text was appended to a turn after its end()."""


def _kind(c: str) -> str:
    """The pre-tokenizer's class of `c`: L letter, N number, S whitespace, P anything else; U for
    a character to keep away from boundaries (unassigned here, or whitespace to Python only)."""
    if c in _WHITESPACE:
        return "S"
    cat = unicodedata.category(c)
    if cat == "Cn" or cat == "Cs" or c.isspace():
        return "U"
    if cat[0] == "L":
        return "L"
    if cat[0] == "N":
        return "N"
    return "P"


def _regex_splits(a: str, b: str) -> bool:
    """Whether the pre-tokenizer always ends a piece between `a` and `b`, whatever follows."""
    ka, kb = _kind(a), _kind(b)
    if "U" in (ka, kb):
        return False
    if ka == "L":
        return kb != "L"
    if ka == "N":
        return True
    if ka == "P":
        return kb == "N" or (kb == "S" and b not in "\r\n")
    return False


def _nfc_splits(a: str, b: str) -> bool:
    if unicodedata.combining(b):
        return False
    return unicodedata.normalize("NFC", a + b) == unicodedata.normalize(
        "NFC", a
    ) + unicodedata.normalize("NFC", b)


def _is_cjk(c: str) -> bool:
    o = ord(c)
    return (
        0x3040 <= o <= 0x30FF
        or 0x3400 <= o <= 0x4DBF
        or 0x4E00 <= o <= 0x9FFF
        or 0xF900 <= o <= 0xFAFF
        or 0x20000 <= o <= 0x3134F
    )


@dataclass(frozen=True)
class _AddedPrefixes:
    """Every proper prefix of the tokenizer's added tokens (text ending in one may still become
    that token), their first characters, and the longest one's length."""

    prefixes: frozenset[str]
    starts: frozenset[str]
    longest: int


# Per tokenizer: built once, not per turn (it was ~0.15 ms of the server's event loop a turn).
_ADDED_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def added_prefixes(tokenizer) -> _AddedPrefixes:
    """The tokenizer's _AddedPrefixes, from the cache where the tokenizer can be a weak key."""
    try:
        return _ADDED_PREFIXES[tokenizer]
    except (KeyError, TypeError):
        pass
    added = list(getattr(tokenizer, "added_tokens", []))
    table = _AddedPrefixes(
        frozenset(t[:i] for t in added for i in range(1, len(t))),
        frozenset(t[0] for t in added if t),
        max((len(t) - 1 for t in added), default=0),
    )
    try:
        _ADDED_PREFIXES[tokenizer] = table
    except TypeError:  # not weakly referenceable: built each time
        pass
    return table


def _word_starts(text: str, begin: int, end: int) -> Iterator[int]:
    """Positions in text[begin:end] where a word starts: after whitespace, and at every CJK
    character (those scripts put no spaces between words)."""
    for i in range(begin, end):
        c = text[i]
        if c.isspace():
            continue
        if i == 0 or text[i - 1].isspace() or _is_cjk(c):
            yield i


@dataclass
class Word:
    """A word of a segment: where it starts in the segment's text, and the index of the token
    that holds its first character."""

    start: int
    token: int


@dataclass
class SegmentText:
    """One segment of a turn: its text so far and its final tokens (each with its span of
    characters in `text`). `closed` once nothing more will be added."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)
    closed: bool = False
    # Whether whitespace stood between this segment and the one before it (dropped at the cut).
    space_before: bool = False

    def word_text(self, i: int) -> str:
        end = self.words[i + 1].start if i + 1 < len(self.words) else len(self.text)
        return self.text[self.words[i].start : end].strip()


@dataclass
class _Piece:
    text: str
    tokens: list[int]
    offsets: list[tuple[int, int]]


class TurnText:
    """A turn's text as it arrives, cut into final tokens and segments (see the module docstring).

    `append` and `end` may be called from any thread; readers take `lock` while they read
    `segments` and `ended`.
    """

    def __init__(self, tokenizer, max_tokens: int = MAX_SEGMENT_TOKENS) -> None:
        if not hasattr(tokenizer, "encode_with_offsets"):
            raise TypeError(
                "streamed text needs a tokenizer with encode_with_offsets (QwenTextTokenizer)"
            )
        self._tok = tokenizer
        self.max_tokens = max_tokens
        self.sentence_min = int(max_tokens * SENTENCE_MIN_SHARE)
        added = added_prefixes(tokenizer)
        self._prefixes = added.prefixes
        self._prefix_starts = added.starts
        self._longest_prefix = added.longest
        self._window = _CUT_WINDOW_CHARS_PER_TOKEN * max_tokens
        self.lock = threading.Lock()
        self.segments: list[SegmentText] = []
        self.ended = False
        self._buf = ""  # text after the last safe boundary
        self._scan = 1  # the first position of _buf not yet checked for a boundary
        self._carry = ""  # a high surrogate whose low half may come with the next append
        self._open: SegmentText | None = None  # the segment pieces go to; None: the next starts one
        self._held: list[_Piece] = []  # pieces past sentence_min, waiting for the segment's end
        self._done = 0  # characters of _buf already in segments (a long run cut before its end)
        self.appends = 0  # append() calls so far: what a reader of the text may have missed

    # ---------------------------------------------------------------- input

    def append(self, text: str) -> None:
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
        with self.lock:
            if self.ended:
                raise TextEndedError("text appended after end(): this turn's text has ended")
            self.appends += 1
            text = self._carry + text
            self._carry = ""
            if text and "\ud800" <= text[-1] <= "\udbff":
                self._carry, text = text[-1], text[:-1]
            self._buf += mend_surrogates(text)
            self._cut_pieces()

    def end(self) -> None:
        """No more text: the rest becomes tokens and the last segment closes. Idempotent."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
            rest = self._buf + mend_surrogates(self._carry)
            self._buf, self._carry = "", ""
            if self._done:
                self._add_run(rest)
            elif rest and (self._open is not None or self.segments or rest.strip()):
                self._add(rest)
            for piece in self._held:
                self._feed(piece)
            self._held = []
            if self._open is not None:
                self._open.closed = True
                self._open = None

    def first_token_guess(self) -> int | None:
        """Before the turn's first token is final: the first token its text would have if it
        ended now (None once a token is final, or with no word yet). A guess: more text may still
        change it ("Hel" -> "Hello"); the session checks it against the final token
        (engine/text_first_frame.py)."""
        with self.lock:
            if self.segments or self.ended or self._done or self._held or self._open is not None:
                return None
            text = self._buf
            if not text.strip() or len(text) > self._window:
                return None
            tokens = self._encode(text, first=True).tokens
        return tokens[0] if tokens else None

    @property
    def empty(self) -> bool:
        """True once the turn has ended without a word to say."""
        return self.ended and not self.segments

    # ---------------------------------------------------------------- pieces

    def _cut_pieces(self) -> None:
        buf, start = self._buf, 0
        for p in self._candidates(buf, max(self._scan, 1)):
            if p > start and self._safe(buf, p, start):
                self._add_run(buf[start:p])
                start = p
        self._buf = buf[start:]
        self._scan = len(self._buf)
        self._cut_early()

    @staticmethod
    def _candidates(buf: str, lo: int) -> Iterator[int]:
        """Positions from `lo` on that may be boundaries: all but those inside runs of letters."""
        p = lo
        for m in _LETTER_RUN.finditer(buf, max(lo - 1, 0)):
            a, b = m.span()
            yield from range(p, a + 1)
            p = max(p, b)
        yield from range(p, len(buf))

    def _add_run(self, text: str) -> None:
        """Place a piece; one whose start was already cut into segments goes on from there."""
        done, self._done = self._done, 0
        if done:
            if text[done:]:
                self._add(text[done:], cont=True)
        else:
            self._add(text)

    def _cut_early(self) -> None:
        """A run with no boundary in it yet, already longer than a piece tokenized whole: its
        next segment is cut now. The cut depends only on the run's first window of characters,
        so it is the one the whole run gets (`_cut_long`), and a long run streams out segment by
        segment instead of waiting for its end (on a whole text: one segment's work at a time)."""
        while True:
            run, cont = self._buf[self._done :], self._done > 0
            text = run if cont or not self.segments else run.lstrip()
            if len(text) <= self._window + 1:
                return
            while self._open is not None:  # the segment ends before the run, as in _add
                self._overflow(None)
            text = run if cont or not self.segments else run.lstrip()
            space = not cont and bool(self.segments) and run[:1].isspace()
            cut = self._long_cut(text)
            self._close_segment(text[:cut], space)
            self._done += len(run) - len(text) + cut

    def _safe(self, buf: str, p: int, start: int) -> bool:
        a, b = buf[p - 1], buf[p]
        if not (_regex_splits(a, b) and _nfc_splits(a, b)):
            return False
        if self._prefixes:
            # A suffix that may still grow into an added token starts with an added token's first
            # character, at most the longest one's length back.
            lo = max(start, p - self._longest_prefix)
            for i in range(p - 1, lo - 1, -1):
                if buf[i] in self._prefix_starts and buf[i:p] in self._prefixes:
                    return False
        return True

    def _encode(self, text: str, first: bool) -> _Piece:
        """The tokens of `text` where it stands: a segment's first text inside the prompt template
        (spec §4.2: its body is ids[3:-5], so a leading newline merges into the role's as it does
        for a whole text), later pieces alone."""
        if not first:
            ids, offsets = self._tok.encode_with_offsets(text)
            return _Piece(text, list(ids), [tuple(o) for o in offsets])
        shift = len(_TEMPLATE_HEAD)
        ids, offsets = self._tok.encode_with_offsets(_TEMPLATE_HEAD + text + _TEMPLATE_TAIL)
        body = [
            (i, (max(s - shift, 0), max(e - shift, 0)))
            for i, (s, e) in zip(ids[3:-5], offsets[3:-5])
        ]
        return _Piece(text, [i for i, _ in body], [o for _, o in body])

    # ---------------------------------------------------------------- segments

    def _add(self, text: str, cont: bool = False) -> None:
        """Place the next piece of text: into the open segment, held, or starting a new one.
        `cont`: the rest of a run whose start is already in segments (taken as it is)."""
        seg = self._open
        if seg is None:
            space = not cont and bool(self.segments) and text[:1].isspace()
            if self.segments and not cont:
                text = text.lstrip()
                if not text:
                    return
            if len(text) > self._window:  # too long to tokenize whole on the engine thread
                self._cut_long(text, space)
                return
            piece = self._encode(text, first=True)
            if len(piece.tokens) > self.max_tokens:
                self._cut_long(text, space)
                return
            if not piece.tokens:  # only newlines, which merge into the prompt's own
                return
            self._open = seg = SegmentText(space_before=space)
            self.segments.append(seg)
            self._feed(piece)
            return
        if len(text) > self._window:
            # Not tokenized whole: a piece this long ends the segment before it, and is cut.
            self._overflow(_Piece(text, [], []), whole=False)
            return
        piece = self._encode(text, first=False)
        held = sum(len(p.tokens) for p in self._held)
        total = len(seg.tokens) + held + len(piece.tokens)
        if total <= self.max_tokens:
            if self._held or total >= self.sentence_min:
                self._held.append(piece)  # a cut may still come at or before it
            else:
                self._feed(piece)
            return
        self._overflow(piece)

    def _overflow(self, piece: _Piece | None, whole: bool = True) -> None:
        """The open segment with its held pieces and `piece` is too long: end it at the last
        sentence end past sentence_min that fits, else before the first piece that does not fit,
        and place the rest again. `whole`: `piece` was tokenized (else it counts as too long,
        and no cut is looked for inside it). None: a run too long for it comes next."""
        seg = self._open
        pieces = [*self._held, piece] if piece is not None and whole else list(self._held)
        self._held = []
        count = len(seg.tokens)
        prev = seg.text[-1:]
        best: tuple[int, int] | None = None  # (piece index, cut position in it)
        fits = 0  # pieces that fit whole
        for k, p in enumerate(pieces):
            for j in self._sentence_ends(prev, p.text):
                head = p.text[:j].rstrip()
                n = count + (len(self._encode(head, first=False).tokens) if head else 0)
                if self.sentence_min <= n <= self.max_tokens:
                    best = (k, j)
            if count + len(p.tokens) > self.max_tokens:
                break
            count += len(p.tokens)
            fits = k + 1
            prev = p.text[-1:]
        if best is None:
            best = (fits, 0)
        if piece is not None and not whole:
            pieces.append(piece)
        k, j = best
        for p in pieces[:k]:
            self._feed(p)
        rest = pieces[k:]
        if rest and j > 0:
            head = rest[0].text[:j].rstrip()
            if head:
                self._feed(self._encode(head, first=False))
            rest[0] = _Piece(rest[0].text[j:], [], [])
        seg.closed = True
        self._open = None
        for p in rest:
            self._add(p.text)

    @staticmethod
    def _sentence_ends(prev: str, text: str) -> Iterator[int]:
        """Cut positions j in `text` (0 <= j < len) where the text before ends a sentence: after
        a newline or a CJK terminal, or after . ! ? ; … followed by whitespace. `prev` is the
        character before `text`."""
        for j in range(len(text)):
            c = text[j - 1] if j else prev
            if not c:
                continue
            if c == "\n" or c in _CJK_TERMINALS or (c in _ASCII_TERMINALS and text[j].isspace()):
                yield j

    def _cut_long(self, text: str, space: bool) -> None:
        """A run of text too long for one segment (no boundary inside that a segment can end at):
        whole segments of the longest prefixes that fit, the rest opening the next segment."""
        while True:
            if len(text) <= self._window:
                piece = self._encode(text, first=True)
                if not piece.tokens:
                    return
                if len(piece.tokens) <= self.max_tokens:
                    self._open = seg = SegmentText(space_before=space)
                    self.segments.append(seg)
                    self._feed(piece)
                    return
            cut = self._long_cut(text)
            self._close_segment(text[:cut], space)
            text, space = text[cut:], False

    def _long_cut(self, text: str) -> int:
        """Where a run too long for one segment is cut: the longest prefix of its first window
        that fits in a segment (a few tokenizer calls on a bounded window)."""
        head = text[: self._window]
        if len(self._encode(head, first=True).tokens) <= self.max_tokens:
            return len(head)
        lo, hi = 1, len(head) - 1  # lo fits, hi + 1 does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._encode(head[:mid], first=True).tokens) <= self.max_tokens:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _close_segment(self, text: str, space: bool) -> None:
        """A whole segment of `text` (a cut of a long run); none if it has no tokens."""
        piece = self._encode(text, first=True)
        if not piece.tokens:
            return
        self._open = seg = SegmentText(space_before=space)
        self.segments.append(seg)
        self._feed(piece)
        seg.closed = True
        self._open = None

    def _feed(self, piece: _Piece) -> None:
        """Append a piece to the open segment: its tokens become final."""
        seg = self._open
        base, n = len(seg.text), len(seg.tokens)
        seg.text += piece.text
        seg.offsets.extend((s + base, e + base) for s, e in piece.offsets)
        spans = seg.offsets
        t = n
        for start in _word_starts(seg.text, base, len(seg.text)):
            while t < len(spans) and spans[t][1] <= start:
                t += 1
            if t < len(spans):
                seg.words.append(Word(start, t))
        seg.tokens.extend(piece.tokens)


class TurnSegments:
    """A whole dual-track text's segments, cut as a streamed turn of the same text cuts them, with
    the interface of `engine.text.Segments`: the text goes through TurnText a window at a time, as
    far as the segment asked for, so a long text never holds the engine thread for long."""

    WINDOW = 1024

    def __init__(self, text: str, tokenizer, max_tokens: int = MAX_SEGMENT_TOKENS) -> None:
        self._turn = TurnText(tokenizer, max_tokens)
        self._text = text
        self._pos = 0

    def has(self, i: int) -> bool:
        """Whether segment `i` exists (cutting the text up to its end)."""
        turn, segs = self._turn, self._turn.segments
        while (len(segs) <= i or not segs[i].closed) and not turn.ended:
            if self._pos < len(self._text):
                turn.append(self._text[self._pos : self._pos + self.WINDOW])
                self._pos += self.WINDOW
            else:
                turn.end()
        return i < len(segs)

    def __getitem__(self, i: int) -> str:
        if i < 0 or not self.has(i):
            raise IndexError(i)
        return self._turn.segments[i].text

    def __iter__(self) -> Iterator[str]:
        i = 0
        while self.has(i):
            yield self._turn.segments[i].text
            i += 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


def turn_segments(text: str, tokenizer, max_tokens: int = MAX_SEGMENT_TOKENS) -> list[str]:
    """The segments of a whole text as a streamed turn of the same text would have them."""
    return list(TurnSegments(text, tokenizer, max_tokens))
