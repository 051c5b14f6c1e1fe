"""Open-ended dual-track sessions: the text arrives while the turn is spoken (issue 35).

    s = engine.open_text_session(SynthesisRequest("", voice="ryan"))
    engine.append_text(s, "Hello the")      # any thread, any piece size
    engine.append_text(s, "re, how are you?")
    engine.end_text(s)
    while not s.done:
        chunks = engine.step(s)               # [] while it waits for text

The session reads one text token per frame (spec §4.5): frame t adds the text vector of token t+1
(then tts_eos, then tts_pad) to the talker's next input. Tokens come from `TurnText`, which releases
a token only once no later text can change it, so the session reads exactly the tokens of the
whole text.

Waiting. Frame t may run only once its text vector is known: token t+1 has arrived, or the text has
ended (then tts_eos and tts_pad follow). Until then `poll` says the session cannot step: no frame is
decoded and no pad is fed, `step` and `step_many` skip it, and the EngineService does not count it
as ready. A turn's codes therefore equal those of its whole text in dual-track mode, whatever the
pieces and their timing: the same prompt, the same text vectors (computed in aligned blocks,
`prompt.text_rows`), the same seeds, the same segments (`text_stream.turn_segments`, used by the
engine for whole dual-track texts too). A text arriving more slowly than the model reads (12.5
tokens a second) leaves gaps in the audio, never other speech.

First frame. Frame 0's codes need only token 0 (in the prefill): where the backend can preview
them, they are sent once token 0 is final, and before that a guess at token 0 is prefilled and
previewed while the LLM writes (text_first_frame.py).

While it waits, frames decoded but not yet vocoded are sent at once if no audio has gone out yet,
else once the audio already sent is about to run out (LOW_WATER_S): a slow text does not also hold
back audio already decoded.

Segments. Each segment gets a fresh prompt and backend state, as for a whole text. A streamed
segment whose text is still open has its frame cap set once its text ends; until then its frames
cannot outrun its tokens, which stay far below any cap. Between segments the old state is kept
until the next one begins, so the session never loses its KV slot to another stream.

Word timing. A word's time is that of the frame whose talker step reads the word's first token:
token j of a segment is read at its frame j (the first token in the prefill, at frame 0). The
model reads text about three times faster than it speaks it, so this is the earliest the word can
be heard (no frame can depend on text it has not read), not when it is heard: the lag grows
through a segment, to seconds on long ones. A barge-in transcript built from it may name words
not yet voiced.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipecat_qwen_fast.engine import text_first_frame as first_frame
from pipecat_qwen_fast.engine.request import SAMPLE_RATE, AudioChunk, SynthesisRequest
from pipecat_qwen_fast.engine.text_stream import TextEndedError, TurnText
from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.model.prompt import (
    DUAL_TRACK,
    _ref_body,
    _weights_key,
    build_prompt,
    prompt_dtype,
    text_rows,
)

FRAME_S = 1920 / SAMPLE_RATE
# A turn whose text neither grows nor ends for this long is ended (its text so far is spoken, then
# the session is freed): an adapter that loses the end of a turn must not hold a session forever.
DEFAULT_IDLE_TIMEOUT_S = 20.0
# While waiting for text, frames decoded but not yet vocoded are sent once the audio already sent
# plays out within this long; above it they wait for their chunk to fill.
LOW_WATER_S = 0.2
# Any text: the prompt of a dual-track turn has the same length whatever its text (spec §4.5, §4.6),
# so the session's state can be sized before the first word.
_PROBE_TEXT = "a"
# Voices (speaker, language, instruct, voice clone) whose probe facts an engine keeps: a server's
# fleet of streamed turns opened ~1 a round at 256-320 callers, each paying a probe prompt (a
# tokenization and a few small launches) beside its own segment's prompt and prefill.
PROBE_CACHE_SIZE = 64
# A segment's begin hands the text vectors its prompt already holds to the backend state
# (`_seed_rows`); False: its first poll computes them again (`_push`, the reference the tests
# compare it with).
SEED_ROWS = True


@dataclass
class WordTiming:
    """A word of the turn and when it starts in the turn's audio (see the module docstring)."""

    text: str
    start_s: float
    frame: int  # the turn's frame that reads the word's first token
    space_before: bool  # whitespace stood before it in the text


class TextFeed:
    """The text side of an open-ended session: `append` and `end` from any thread, the rest on
    the engine thread. `on_text` (the service's wake-up) is called after each change."""

    def __init__(self, tokenizer, idle_timeout_s: float | None, max_tokens: int) -> None:
        if idle_timeout_s is not None and not (
            isinstance(idle_timeout_s, (int, float)) and idle_timeout_s > 0
        ):
            raise InvalidInputError(
                f"idle_timeout_s must be a number > 0 or None, got {idle_timeout_s!r}"
            )
        self.turn = TurnText(tokenizer, max_tokens)
        self.idle_timeout_s = idle_timeout_s
        self.last_text_at = time.monotonic()
        self.ended_by: str | None = None  # "end" | "idle_timeout"
        self.on_text: Callable[[], None] | None = None
        self._lock = threading.Lock()
        # Engine thread.
        self.segment = 0  # the turn's segment the session is on
        self.begun = False  # its prompt has been prefilled
        # Text-track ids of the segment: the reference's (ICL), then its tokens.
        self.seq: list[int] = []
        self.k = 1  # text-track positions in the prefill
        self.rows: Tensor | None = None  # text vectors of seq[k:] (+ tts_eos), a growing buffer
        self.trailing = 0  # rows handed to the backend state
        self.closed = False  # the segment's text has ended and tts_eos is in the rows
        self.need = 1  # tokens of a segment its prefill needs (more for ICL voices)
        self.ref: list[int] = []  # the ICL reference's text tokens
        self.prompt_len = 0
        self.eos_vec: Tensor | None = None
        self.pad_vec: Tensor | None = None
        self.last_reason = "eos"
        self.first_audio_at: float | None = None
        # Frame 0 sent from its preview, the backend state still at frame 0 (text_first_frame.py).
        self.previewed = False
        self.guess: int | None = None  # the first token prefilled before any was final, a guess
        self.guess_at = -1  # the turn's appends when the guess was last made
        # (segment, its text, its token count) and the prompt built for them ahead of the begin,
        # while a round decoded (`prepare_text_session`); used by the begin if the text is still that.
        self.ready: tuple[tuple[int, str, int], Any] | None = None
        # (turn frame of its frame 0, frames kept in it or None while it runs) per begun segment.
        self.spans: list[list[int | None]] = []
        # Whose frames read the words (its segment_frames, while a segment runs).
        self.session = None

    # ---------------------------------------------------------------- any thread

    def append(self, text: str) -> None:
        if self.ended_by == "idle_timeout":
            raise TextEndedError(
                "text appended after the turn's idle timeout ended it "
                f"(no text for {self.idle_timeout_s} s)"
            )
        self.turn.append(text)
        self.last_text_at = time.monotonic()
        self._changed()

    def end(self, by: str = "end") -> None:
        with self._lock:
            if self.ended_by is None:
                self.ended_by = by
        self.turn.end()
        self._changed()

    def _changed(self) -> None:
        if self.on_text is not None:
            self.on_text()

    def words(self) -> list[WordTiming]:
        """The words read so far, each with its start time in the turn's audio."""
        out: list[WordTiming] = []
        with self.turn.lock:
            running = self.session.segment_frames if self.session is not None else 0
            for i, (start, kept) in enumerate(self.spans):
                seg = self.turn.segments[i]
                limit = kept if kept is not None else running
                for j, w in enumerate(seg.words):
                    r = self._read_frame(w.token)
                    if r >= limit:
                        break
                    space = seg.text[w.start - 1].isspace() if w.start > 0 else seg.space_before
                    out.append(
                        WordTiming(seg.word_text(j), (start + r) * FRAME_S, start + r, space)
                    )
        return out

    def spoken_text(self, played_s: float) -> str:
        """The words that start before `played_s` seconds of the turn's audio: what a listener
        interrupted there may have heard (see the module docstring for what the times mean)."""
        text = ""
        for w in self.words():
            if w.start_s >= played_s:
                break
            text += (" " if w.space_before and text else "") + w.text
        return text

    def _read_frame(self, token: int) -> int:
        """The segment frame whose talker step reads the segment's token `token`."""
        return max(0, len(self.ref) + token - self.k + 1)

    # ---------------------------------------------------------------- engine thread

    def deadline(self, s) -> float | None:
        """When the session next needs looking at without new text (idle timeout, or audio about
        to run out while frames wait to be vocoded); None: only new text wakes it."""
        times = []
        if self.ended_by is None and self.idle_timeout_s is not None:
            times.append(self.last_text_at + self.idle_timeout_s)
        if s.pending and self.first_audio_at is not None:
            times.append(self.first_audio_at + s.chunk_start * FRAME_S - LOW_WATER_S)
        return min(times) if times else None

    def allows(self, frame: int) -> bool:
        """Whether the segment's frame `frame` has its text vector."""
        return self.closed or frame < self.trailing


class TextSessions:
    """QwenTTSEngine's open-ended sessions (mixed into the engine)."""

    def open_text_session(
        self,
        request: SynthesisRequest,
        *,
        idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
        feed: TextFeed | None = None,
        prepared=None,
    ):
        """A dual-track session for text that arrives later (`append_text`, `end_text`). The
        request is checked as `open_session` checks it; its own text is ignored. Its backend state
        is reserved now (NoFreeSlotError when every slot is taken); the prefill runs once the first
        words are final. A turn that gets no text for `idle_timeout_s` is ended as if by
        `end_text` (None: never). `feed`: a TextFeed made beforehand, which may already hold text
        (the service makes one per stream, so text appended before the session opens is kept).
        `prepared`: what `prepare_text_session` made for this request and feed."""
        return open_text_session(self, request, idle_timeout_s, feed, prepared)

    def prepare_text_session(self, request: SynthesisRequest, feed: TextFeed):
        """The request checked as `open_text_session` checks it, with no backend state, and, if
        the feed's text already allows the first segment to begin, its prompt built (kept on the
        feed): what the open and the begin would do before their state and prefill, done while
        the caller would otherwise wait for the GPU. Pass the result to `open_text_session`."""
        s = _new_text_session(self, request)
        _prepare_begin(self, s, feed)
        return s

    def append_text(self, s, text: str) -> None:
        """Add text to an open-ended session (any thread). Raises TextEndedError after end_text;
        text for a session already closed (cancelled, say) is dropped."""
        _feed_of(s).append(text)

    def end_text(self, s) -> None:
        """No more text for this session (any thread; idempotent): it speaks what it has."""
        _feed_of(s).end()

    def begin_text_sessions(self, sessions: list) -> list[Exception | None]:
        """Begin the sessions whose first words are final, their prefills batched (the service
        calls it once a round, before polling them one by one); see `begin_many`."""
        return begin_many(self, sessions)

    def poll_text(self, s) -> list[AudioChunk] | None:
        """None when `s` can decode a frame now; else the chunks it sent while it waits (its text
        is not there yet). Done by `step` itself; the service calls it to skip waiting sessions."""
        return poll(self, s)


def _feed_of(s) -> TextFeed:
    feed = getattr(s, "feed", None)
    if feed is None:
        raise InvalidInputError(
            "this session takes its whole text up front; open it with open_text_session"
        )
    return feed


def open_text_session(
    engine, request: SynthesisRequest, idle_timeout_s: float | None, feed: TextFeed | None = None,
    prepared=None,
):
    from pipecat_qwen_fast.engine import engine as engine_module

    if feed is None:
        feed = TextFeed(engine.tokenizer, idle_timeout_s, engine_module.MAX_SEGMENT_TOKENS)
    s = prepared if prepared is not None else _new_text_session(engine, request)
    s.feed = feed
    feed.session = s
    try:
        vc = s.request.voice_clone
        if vc is not None and vc.icl:
            feed.ref = _ref_body(engine.tokenizer, engine.config, vc.ref_text)
            feed.k = vc.ref_codes.shape[0] + 1
            feed.need = max(1, feed.k - len(feed.ref))
        feed.prompt_len, feed.eos_vec, feed.pad_vec = probe_facts(engine, s)
        s.state = engine.backend.new_state(
            max_positions=feed.prompt_len + _budget(engine, s, _cap(engine, s, None)) + 1,
            params=s.params,
            seed=s.seed,
            trailing=feed.pad_vec[None][:0],
            pad_vec=feed.pad_vec,
        )
        engine._start_vocoder(s)
    except BaseException:
        engine.close_session(s)
        raise
    return s


def _new_text_session(engine, request: SynthesisRequest):
    """A turn's session validated as a whole-text request would be (only its text is left to
    come), with no feed or backend state yet."""
    if not isinstance(request, SynthesisRequest):
        raise InvalidInputError(
            f"a request must be a SynthesisRequest, got {type(request).__name__}"
        )
    if request.text_mode not in (None, DUAL_TRACK):
        raise InvalidInputError(
            f"streamed text needs text_mode='{DUAL_TRACK}' (the model reads one token a frame); "
            f"got {request.text_mode!r}"
        )
    s = engine._new_session(dataclasses.replace(request, text=_PROBE_TEXT, text_mode=DUAL_TRACK))
    s.request = dataclasses.replace(s.request, text="")
    s.segments = []
    return s


def _prepare_begin(engine, s, feed: TextFeed) -> None:
    """`feed.ready`: the prompt `_plan_begin` would build for the feed's segment from its text
    as it stands, if that text allows the begin (more text by then: built again there). An
    in-context voice's turns are left alone (their reference sets how many tokens a begin needs
    only at the open)."""
    vc = s.request.voice_clone
    if vc is not None and vc.icl:
        return
    seg = _segment_to_begin(feed)
    if seg is not None:
        text, tokens, _ = seg
        with torch.no_grad():
            feed.ready = ((feed.segment, text, len(tokens)), _prompt(engine, s, text))


def _segment_to_begin(feed: TextFeed) -> tuple[str, list[int], bool] | None:
    """The text, tokens and closedness of the feed's segment, if they allow it to begin."""
    turn = feed.turn
    with turn.lock:
        if feed.segment >= len(turn.segments):
            return None
        seg = turn.segments[feed.segment]
        text, tokens, closed = seg.text, list(seg.tokens), seg.closed
    if not closed and len(tokens) < feed.need:
        return None
    return text, tokens, closed


def probe_facts(engine, s) -> tuple[int, Tensor, Tensor]:
    """A turn's prompt length and its tts_eos and tts_pad vectors, from a prompt of any text (its
    length does not depend on the text): made once per voice and kept for the weights as they
    are (`_weights_key`, as the prompt's shared vectors are). The voice clone is matched by
    identity and held by the entry, so its id is not reused while the entry lives."""
    req = s.request
    vc = req.voice_clone
    talker = engine.model.talker
    weights = (prompt_dtype(talker), _weights_key((talker.model.text_embedding, talker.text_projection)))
    key = (s.speaker, s.language, req.instruct, id(vc))
    cache = engine.__dict__.setdefault("_probe_facts", {})
    hit = cache.get(key)
    if hit is not None and hit[0] is vc and hit[1] == weights:
        return hit[2]
    with torch.no_grad():
        probe = _prompt(engine, s, _PROBE_TEXT)
    facts = (probe.embeds.shape[0], probe.eos_vec, probe.pad_vec)
    if key not in cache and len(cache) >= PROBE_CACHE_SIZE:
        cache.pop(next(iter(cache)))  # the oldest voice
    cache[key] = (vc, weights, facts)
    return facts


def _prompt(engine, s, text: str, body: list[int] | None = None):
    req = s.request
    return build_prompt(
        engine.model.talker,
        engine.tokenizer,
        engine.config,
        text=text,
        speaker=s.speaker,
        language=s.language,
        instruct=req.instruct,
        text_mode=DUAL_TRACK,
        voice_clone=req.voice_clone,
        body=body,
    )


def _cap(engine, s, tokens: int | None) -> int:
    """The segment's frame cap as the engine sets it for a whole text of `tokens` tokens; None:
    the largest a segment can get (its text still open)."""
    from pipecat_qwen_fast.engine.engine import FRAME_CAP_MARGIN, FRAMES_PER_TOKEN_CAP

    n = s.feed.turn.max_tokens if tokens is None else tokens
    cap = min(engine.generation.max_new_tokens - 1, FRAMES_PER_TOKEN_CAP * n + FRAME_CAP_MARGIN)
    capacity = getattr(engine.backend, "max_positions", None)
    if capacity is not None:
        cap = max(1, min(cap, capacity - s.feed.prompt_len - 1))
    return cap


def _budget(engine, s, cap: int) -> int:
    if s.request.max_frames is not None:
        return min(cap, s.request.max_frames - s.frames_decoded)
    return cap


def poll(engine, s) -> list[AudioChunk] | None:
    feed = s.feed
    if s.done:
        return []
    _check_idle(feed)
    if feed.first_audio_at is None and s.chunk_start > 0:
        feed.first_audio_at = time.monotonic()
    if not feed.begun and not _begin(engine, s):
        with feed.turn.lock:
            over = feed.turn.ended and feed.segment >= len(feed.turn.segments)
        if over:
            return engine._finish(s, feed.last_reason if feed.spans else "empty")
        first_frame.speculate(engine, s)
        return _wait(engine, s)
    _push(engine, s)
    first_frame.catch_up(engine, s)
    if feed.allows(s.segment_frames):
        return None
    sent = first_frame.preview(engine, s)
    if s.done:
        return sent
    return sent + _wait(engine, s)


def _wait(engine, s) -> list[AudioChunk]:
    feed = s.feed
    if not s.pending:
        return []
    now = time.monotonic()
    if (
        feed.first_audio_at is not None
        and s.chunk_start * FRAME_S - (now - feed.first_audio_at) >= LOW_WATER_S
    ):
        return []
    chunks = engine._flush(s)
    if feed.first_audio_at is None:
        feed.first_audio_at = now
    return chunks


def _check_idle(feed: TextFeed) -> None:
    if (
        feed.ended_by is None
        and feed.idle_timeout_s is not None
        and (time.monotonic() - feed.last_text_at >= feed.idle_timeout_s)
    ):
        feed.end("idle_timeout")


@dataclass
class _Begin:
    """A segment begin planned up to its prefill (`_plan_begin`); `prompt` None: no prefill (the
    guess at its first token was right and its prefill is kept)."""

    prompt: object | None
    ids: list[int]  # the segment's tokens it begins with
    closed: bool

    @property
    def tokens(self) -> int:
        return len(self.ids)


def _begin(engine, s) -> bool:
    """Start the session's current segment if its text allows: the prompt from its first tokens,
    a fresh state (the first segment's was reserved at open), the prefill. False: not yet. A
    prefill made with a right guess at the first token (text_first_frame) is kept."""
    plan = _plan_begin(engine, s)
    if plan is None:
        return False
    if plan.prompt is not None:
        engine._prefill([s], [plan.prompt.embeds])
    _end_begin(engine, s, plan)
    return True


def begin_many(engine, sessions: list) -> list[Exception | None]:
    """`_begin` for each open-ended session not yet begun whose text allows, their prefills in one
    batched pass: a round's streamed turns that start together pay one prefill (the backend's
    `prefill_many`: row prefill on the GPU), as whole-text opens do. Per session: None, or the
    exception that ended it (closed). Sessions that cannot begin yet are left to `poll`."""
    out: list[Exception | None] = [None] * len(sessions)
    plans = []
    for i, s in enumerate(sessions):
        feed = getattr(s, "feed", None)
        if feed is None or s.done or feed.begun:
            continue
        try:
            _check_idle(feed)
            plan = _plan_begin(engine, s)
        except Exception as e:  # noqa: BLE001 - reported to that session's caller
            out[i] = _failed(engine, s, e)
            continue
        if plan is not None:
            plans.append((i, s, plan))
    fills = [(i, s, p) for i, s, p in plans if p.prompt is not None]
    try:
        if fills:
            engine._prefill([s for _, s, _ in fills], [p.prompt.embeds for _, _, p in fills])
    except Exception as e:  # noqa: BLE001 - the shared prefill failed: each alone, from a fresh state
        if len(fills) == 1:
            out[fills[0][0]] = _failed(engine, fills[0][1], e)
        else:
            for i, s, p in fills:
                try:
                    _fresh_state(engine, s)
                    engine._prefill([s], [p.prompt.embeds])
                except Exception as e1:  # noqa: BLE001
                    out[i] = _failed(engine, s, e1)
    for i, s, plan in plans:
        if out[i] is None:
            _end_begin(engine, s, plan)
    return out


def _failed(engine, s, e: Exception) -> Exception:
    s.stop_reason = "error"
    engine.close_session(s)
    return e


def _plan_begin(engine, s) -> _Begin | None:
    """`_begin` up to its prefill; None: the text does not allow the segment to begin yet."""
    feed = s.feed
    seg = _segment_to_begin(feed)
    if seg is None:
        return None
    text, tokens, closed = seg
    # The prompt holds the first token only (no guess for in-context voices): the same prompt.
    guessed = feed.guess is not None and tokens[:1] == [feed.guess]
    prompt = None
    ready, feed.ready = feed.ready, None
    if not guessed:
        if ready is not None and ready[0] == (feed.segment, text, len(tokens)):
            prompt = ready[1]
            engine.prepared_begins += 1
        else:
            with torch.no_grad():
                prompt = _prompt(engine, s, text)
        if prompt.num_text_tokens != len(tokens):
            raise RuntimeError(
                "a streamed segment's prompt does not hold the tokens it was cut into"
            )
    cap = _cap(engine, s, len(tokens) if closed else None)
    s.segment_index = feed.segment
    if feed.spans or (feed.guess is not None and not guessed):
        # A later segment (a state of its own), or a prefill of a wrong guess to drop.
        _fresh_state(engine, s)
    s.ahead = None
    if not guessed:
        s.early = None  # frame 0's audio made for another guess (text_first_frame.speculate)
    s.frame_cap = cap
    s.segment_frames = 0
    return _Begin(prompt, tokens, closed)


def _end_begin(engine, s, plan: _Begin) -> None:
    """`_begin` after its prefill."""
    feed = s.feed
    prompt = plan.prompt
    feed.guess = None
    feed.previewed = False
    feed.begun = True
    feed.seq = list(feed.ref)
    feed.rows, feed.trailing, feed.closed = None, 0, False
    if prompt is not None and feed.ref and plan.closed and len(feed.ref) + plan.tokens + 1 <= feed.k:
        # The whole text went into the prefill (spec §4.6); every frame adds tts_pad.
        engine.backend.set_trailing(s.state, prompt.trailing)
        feed.closed = True
    elif prompt is not None and not feed.ref and SEED_ROWS:
        _seed_rows(engine, s, plan)
    with feed.turn.lock:
        feed.spans.append([s.frames_decoded, None])


def detach(s) -> None:
    """At close: the running segment's span keeps the frames it made, and the feed lets go of the
    session. Each refers to the other, so a finished turn was a reference cycle (~35 objects,
    tensors among them) that only the collector's passes freed, with every thread stopped; now
    reference counting frees it."""
    feed = s.feed
    with feed.turn.lock:
        if feed.spans and feed.spans[-1][1] is None:
            feed.spans[-1][1] = s.segment_frames
        feed.session = None


def _fresh_state(engine, s) -> None:
    """A new backend state for the session's segment, seeded as the engine seeds segments."""
    feed = s.feed
    engine.backend.release(s.state)
    s.state = None
    s.early = None  # audio made from the old state's frame 0 (text_first_frame.speculate)
    s.state = engine.backend.new_state(
        max_positions=feed.prompt_len + _budget(engine, s, _cap(engine, s, None)) + 1,
        params=s.params,
        seed=s.seed + 1_000_003 * feed.segment,
        trailing=feed.pad_vec[None][:0],
        pad_vec=feed.pad_vec,
    )
    feed.guess = None


def _seed_rows(engine, s, plan: _Begin) -> None:
    """The segment's text vectors from its prompt, which holds them for every token it was built
    from (and tts_eos after them): the rows `_push` would compute next, bit for bit (both take
    each row from its TEXT_ROW_BLOCK-aligned block, model/prompt.py `text_rows`). Handed over at
    the begin, they leave `_push` only the tokens that come later, instead of each turn's first
    poll recomputing all of them between rounds while the GPU waits (a server's turn comes with
    its whole text). A prompt built from other tokens than the segment's is left to `_push`."""
    feed, prompt = s.feed, plan.prompt
    if prompt.body != plan.ids or not plan.ids:
        return
    count = plan.tokens - 1 + (1 if plan.closed else 0)  # text rows of ids[1:], tts_eos if closed
    feed.seq = list(plan.ids)
    feed.rows = prompt.trailing
    feed.trailing = count
    if count:
        engine.backend.set_trailing(s.state, prompt.trailing[:count])
    if plan.closed:
        feed.closed = True
        s.frame_cap = _cap(engine, s, plan.tokens)


def _push(engine, s) -> None:
    """Hand the segment's new tokens (and tts_eos once its text has ended) to the backend state."""
    feed = s.feed
    if feed.closed:
        return
    with feed.turn.lock:
        seg = feed.turn.segments[feed.segment]
        have = len(feed.seq) - len(feed.ref)
        new, closed = seg.tokens[have:], seg.closed
    if not new and not closed:
        return
    start = len(feed.seq)
    feed.seq.extend(new)
    rows = len(feed.seq) - feed.k + (1 if closed else 0)
    if rows <= feed.trailing:
        return
    talker = engine.model.talker
    buf = feed.rows
    if buf is None or buf.shape[0] < rows:
        grown = torch.empty(
            (max(64, 2 * rows), feed.eos_vec.shape[-1]),
            dtype=feed.eos_vec.dtype,
            device=feed.eos_vec.device,
        )
        if buf is not None:
            grown[: feed.trailing].copy_(buf[: feed.trailing])
        feed.rows = buf = grown
    first = max(start, feed.k)
    with torch.no_grad():
        if len(feed.seq) > first:
            buf[first - feed.k : len(feed.seq) - feed.k].copy_(
                text_rows(talker, feed.seq, engine.config.tts_pad_id, start=first)
            )
        if closed:
            buf[len(feed.seq) - feed.k].copy_(feed.eos_vec)
    engine.backend.set_trailing(s.state, buf[:rows])
    feed.trailing = rows
    if closed:
        feed.closed = True
        s.frame_cap = _cap(engine, s, len(feed.seq) - len(feed.ref))


def end_segment(engine, s, reason: str) -> list[AudioChunk]:
    """The running segment ended (EOS or its cap): go on to the next one when its text is there,
    end the session when the turn has no more, else wait keeping the old state."""
    feed = s.feed
    with feed.turn.lock:
        feed.spans[-1][1] = s.segment_frames
    feed.last_reason = reason
    s.ahead = None  # a frame launched past the EOS belongs to the old segment
    s.early = None
    feed.segment += 1
    feed.begun = False
    feed.previewed = False
    if _begin(engine, s):
        return []
    with feed.turn.lock:
        over = feed.turn.ended and feed.segment >= len(feed.turn.segments)
    if over:
        return engine._finish(s, reason)
    return []


def poll_in_round(engine, s) -> list[AudioChunk] | Exception | None:
    """`poll` for one session of a batched round: a failure ends that session only (closed, its
    exception returned for its slot of the round's results)."""
    try:
        return poll(engine, s)
    except Exception as e:  # noqa: BLE001 - reported to that session's caller
        s.stop_reason = "error"
        engine.close_session(s)
        return e
