"""Admission by slack (issue 34): how far ahead of its playback each chunk's audio reached its stream.

A chunk's slack is its playback time (the stream's first chunk's arrival plus the audio before it,
a listener playing in real time from the first chunk) less the time its audio reached the stream:
at its post, or at its resolve for a DeferredChunk (engine/deferred_audio.py). Negative slack is an
underrun made by the engine. The round time (`EngineService.max_round_ms`) is a proxy for this; on
the H200 at 512 fleet callers rounds of 27 ms, under its 32 ms limit, still let 375 admitted calls
run late, most at their second chunk. Slack measures that miss itself: after a chunk came within
`min_slack_ms` of its playback, new streams are refused for SLACK_HOLD_S.

Both classes run on the engine thread for every chunk (hundreds a second): a few float compares,
no locks, and a deque append for a stream's second and third chunks (and any under the margin).
`SlackWatch.holding` and `lowest_ms` are read from other threads; each reads floats that the
engine thread replaces whole, so a reader sees an old value or a new one.
"""

from __future__ import annotations

import collections
import math

# The default margin on a GPU. Under the schedule 1, 2, 4, ... (the default before session 35) a
# new call's second chunk (2 frames, due 80 ms after the first) arrived two rounds after it: its
# slack was 80 ms less two rounds, ~40 ms at the 19.4 ms rounds of the H200's 384 callers, ~26 ms
# at the 27 ms rounds of 512 callers (375 late calls, made late by the slower rounds that open
# calls). The default 1, 1, 2, ... sends it one round after the first: 80 ms less one round.
# Under 20 ms two rounds averaged over 30 ms: one more slow round (an open of 4 calls, a stall)
# makes an underrun, and the caller's event loop and socket still stand between the stream and
# its listener. On the H200 (docs/PERFORMANCE.md, sessions 32-33): no admitted call late up to 512
# callers, but refusals from 256 callers on (22 low-slack chunks refused 273 calls at 256
# streamed-text callers); `bench fleet --min-slack-ms` is the A/B of this margin.
MIN_SLACK_MS = 20.0
# New streams are refused this long after the latest chunk under the margin. While the engine stays
# overloaded its chunks renew the hold round after round; after the last one, the calls already
# admitted need a few rounds to open (4 a round) and about three more for their second chunk
# (~0.2 s at 25 ms rounds): the hold outlasts that with room to spare, and is short against an
# utterance of a few seconds, so one slow round refuses half a second of arrivals at most.
SLACK_HOLD_S = 0.5
# `lowest_ms` covers the chunks of the last one to two windows: long enough for a scrape every
# second or so to see a dip, short enough to forget it soon after.
SLACK_WINDOW_S = 1.0
# The latest chunks under the margin kept for a benchmark to place against its round timings
# (which chunk of its stream each was, which kind of stream): a few levels' worth at overload.
LOW_EVENTS_KEPT = 4096
# Every second and third chunk (chunks 1 and 2 of their streams) is kept too, with the rounds since
# its stream's first chunk: the chunks a burst of opens makes low, for a benchmark to compare
# whole texts' and streamed turns' over a whole level, not only those under the margin. A level
# of 464 callers admits ~1,800 calls in 20 s on the H200 (session 41): ~3,600 of them.
EARLY_CHUNKS = (1, 2)
EARLY_EVENTS_KEPT = 16384


class PlaybackClock:
    """When a listener playing one stream from its first chunk runs out of the audio arrived so far.

    After an underrun the listener resumes at the late chunk (as the server's PlayoutClock does),
    so one late chunk does not make every later chunk of its stream look late.
    """

    __slots__ = ("end",)

    def __init__(self) -> None:
        self.end: float | None = None

    def arrive(self, now: float, seconds: float) -> float | None:
        """Record `seconds` of audio arrived at `now`; its slack in seconds (None for the first)."""
        end = self.end
        if end is None:
            self.end = now + seconds
            return None
        self.end = max(end, now) + seconds
        return end - now

    def restart(self) -> None:
        """The listener is no longer assumed to play in real time: the next chunk starts afresh
        (its stream was held back because its reader fell behind; the slack that follows is the
        reader's, not the engine's)."""
        self.end = None


class SlackWatch:
    """The engine's lowest recent slack, its chunks under the margin, and the admission hold.

    `limit_s` None: slack is still watched (`lowest_ms`), nothing counts as low and nothing holds.
    """

    def __init__(self, limit_s: float | None = None) -> None:
        self.limit_s = limit_s
        self.low_chunks = 0  # chunks whose slack was under limit_s
        self.last_low_s = 0.0  # the slack of the latest of them
        self.hold_until = -math.inf
        self._window_at = -math.inf
        self._low = math.inf  # lowest slack in the window begun at _window_at
        self._low_before = math.inf  # in the window before it
        # (now, slack_s, chunk, streamed) of each chunk under the margin, the latest LOW_EVENTS_KEPT:
        # `chunk` counts the chunks its stream had before it (1: the second chunk).
        self.low_events: collections.deque[tuple[float, float, int, bool]] = collections.deque(
            maxlen=LOW_EVENTS_KEPT)
        # (now, slack_s, chunk, streamed, rounds since its stream's first chunk) of each chunk in
        # EARLY_CHUNKS, whatever its slack, the latest EARLY_EVENTS_KEPT.
        self.early_events: collections.deque[tuple[float, float, int, bool, int]] = collections.deque(
            maxlen=EARLY_EVENTS_KEPT)

    def note(self, slack_s: float, now: float, chunk: int = 0, streamed: bool = False,
             rounds: int | None = None) -> None:
        """A chunk arrived at `now` with `slack_s` of slack; `chunk`, `streamed` and `rounds` (the
        engine's rounds since its stream's first chunk arrived) only describe it in `low_events`
        and `early_events`."""
        if now - self._window_at >= SLACK_WINDOW_S:
            adjacent = now - self._window_at < 2 * SLACK_WINDOW_S
            self._low_before = self._low if adjacent else math.inf
            self._low = math.inf
            self._window_at = now
        self._low = min(self._low, slack_s)
        limit = self.limit_s
        if limit is not None and slack_s < limit:
            self.low_chunks += 1
            self.last_low_s = slack_s
            self.hold_until = now + SLACK_HOLD_S
            self.low_events.append((now, slack_s, chunk, streamed))
        if rounds is not None and chunk in EARLY_CHUNKS:
            self.early_events.append((now, slack_s, chunk, streamed, rounds))

    def low_events_since(self, since: float) -> list[tuple[float, float, int, bool]]:
        """`low_events` from `since` (time.monotonic()) on; from any thread."""
        return _since(self.low_events, since)

    def early_events_since(self, since: float) -> list[tuple[float, float, int, bool, int]]:
        """`early_events` from `since` (time.monotonic()) on; from any thread."""
        return _since(self.early_events, since)

    def holding(self, now: float) -> bool:
        """Whether new streams are refused at `now`."""
        return now < self.hold_until

    def lowest_ms(self, now: float) -> float | None:
        """The lowest slack (ms) of the chunks that arrived in the last one to two windows before
        `now`; None when none did."""
        age = now - self._window_at
        low = self._low if age < 2 * SLACK_WINDOW_S else math.inf
        if age < SLACK_WINDOW_S and self._low_before < low:
            low = self._low_before
        return None if low == math.inf else low * 1e3


def _since(events: collections.deque, since: float) -> list:
    while True:
        try:
            copied = list(events)
            break
        except RuntimeError:  # the engine thread appended while it was copied
            continue
    return [e for e in copied if e[0] >= since]


def describe_slack(slack_s: float) -> str:
    """A chunk's slack in words, for a refusal's message."""
    if slack_s < 0:
        return f"{-slack_s * 1e3:.1f} ms after its playback time"
    return f"{slack_s * 1e3:.1f} ms before its playback time"
