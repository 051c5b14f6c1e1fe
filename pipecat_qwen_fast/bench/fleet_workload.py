"""The fleet benchmark's workload and arithmetic: what callers say and when, what they hear, and
how a level is judged. No engine here: every function works on times and sample counts, so the
arithmetic is tested on made-up arrivals.

Times are seconds from the level's start. An utterance is late when one of its chunks reaches
the caller after its playback time; the player starts at the first chunk, so chunk k's playback
time is the first chunk's arrival plus the audio of chunks 0..k-1 (a late chunk does not move the
clock: lateness accumulates, as a listener hears it).
"""

from __future__ import annotations

import bisect
import collections
import math
import random
from dataclasses import dataclass, field

from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.bench.engine import max_underrun, percentile
from pipecat_qwen_fast.engine.request import SAMPLE_RATE

# A chunk this close to its playback time is on time: below the clocks' resolution and far below
# anything audible, and it keeps float rounding in the sums of durations from counting as late.
UNDERRUN_TOLERANCE_S = 1e-6

COMPLETE, CUT, REFUSED, ERROR = "complete", "cut", "refused", "error"


@dataclass(frozen=True)
class Reply:
    """One thing an agent says: its text and the frames it is cut at (the checkpoint's EOS row is
    zeroed, so every utterance runs to its frame count)."""

    text: str
    frames: int


def fleet_replies() -> list[Reply]:
    return [Reply(t, texts.frames_for(t)) for t in texts.FLEET_REPLIES]


@dataclass
class Utterance:
    """One request and what its caller heard."""

    caller: int  # caller index (closed loop) or arrival index (open loop)
    frames: int  # frames asked for
    submitted: float  # when it was due: the caller's schedule, not when the event loop got to it
    arrivals: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    outcome: str | None = None  # COMPLETE, CUT (by the level's end), REFUSED (overload), ERROR
    ended: float | None = None
    error: str | None = None

    @property
    def durations(self) -> list[float]:
        return [n / SAMPLE_RATE for n in self.samples]

    @property
    def first_audio_s(self) -> float | None:
        """From submission to the first chunk; for an utterance cut before any audio, the wait
        until the cut (a lower bound, kept so that a collapse cannot hide from the percentiles)."""
        if self.arrivals:
            return self.arrivals[0] - self.submitted
        if self.outcome == CUT and self.ended is not None:
            return self.ended - self.submitted
        return None

    @property
    def lateness_s(self) -> float | None:
        if not self.arrivals:
            return None
        return worst_lateness(self.arrivals, self.durations, self.ended if self.outcome == CUT else None)

    @property
    def underrun(self) -> bool:
        late = self.lateness_s
        return late is not None and late > UNDERRUN_TOLERANCE_S

    @property
    def first_late_chunk(self) -> int | None:
        """The index of the first chunk that reached the player after its audio ran out (1: the
        second chunk, whose deadline is the round time's; later ones point at throughput), None
        when none did (a cut utterance's wait past its audio has no chunk: -1)."""
        played = 0.0
        for k in range(1, len(self.arrivals)):
            played += self.durations[k - 1]
            if self.arrivals[k] - self.arrivals[0] - played > UNDERRUN_TOLERANCE_S:
                return k
        return -1 if self.underrun else None


def worst_lateness(arrivals: list[float], durations: list[float], cut_at: float | None = None) -> float:
    """How late the latest chunk was against its playback time (0 when none was late).

    `cut_at`: the stream was stopped then, unfinished; its player had been waiting for more audio
    since its received audio ran out, if that happened before the cut.
    """
    worst = max_underrun(arrivals, durations)
    if cut_at is not None and arrivals:
        worst = max(worst, cut_at - (arrivals[0] + sum(durations)))
    return worst


def playback_end(arrivals: list[float], durations: list[float]) -> float:
    """When a player that waits for late chunks (and starts at the first) finishes: the caller
    listens from then on."""
    end = -math.inf
    for arrival, duration in zip(arrivals, durations):
        end = max(end, arrival) + duration
    return end


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second in [0, duration)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    times = []
    t = rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _ms(summary: dict) -> dict:
    return {k: (v if k == "n" or v is None else 1e3 * v) for k, v in summary.items()}


def summarize_level(utterances: list[Utterance], window_s: float) -> dict:
    """A level's figures from its utterances (all submitted within [0, window_s))."""
    served = [u for u in utterances if u.outcome in (COMPLETE, CUT)]
    heard = [u for u in served if u.arrivals]
    first = [u.first_audio_s for u in served if u.first_audio_s is not None]
    late = [u for u in heard if u.underrun]
    samples_in_window = sum(n for u in utterances for a, n in zip(u.arrivals, u.samples) if a <= window_s)
    errors = [u.error for u in utterances if u.outcome == ERROR]
    first_error: dict[int, float] = {}
    for u in utterances:
        if u.outcome == ERROR:
            first_error[u.caller] = min(u.submitted, first_error.get(u.caller, math.inf))
    # Callers whose stream failed (its server died) and who were heard in full afterwards: they
    # spoke again (a new socket) and were served.
    heard_again = {u.caller for u in utterances
                   if u.outcome == COMPLETE and u.submitted > first_error.get(u.caller, math.inf)}
    return {
        "utterances": len(utterances),
        "completed": sum(u.outcome == COMPLETE for u in utterances),
        "cut_by_level_end": sum(u.outcome == CUT for u in utterances),
        "refused": sum(u.outcome == REFUSED for u in utterances),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "errored_callers": len(first_error),
        "errored_callers_heard_again": len(heard_again),
        "no_audio": len(served) - len(heard),
        "first_audio_ms": _ms({"n": len(first), "p50": percentile(first, 50), "p95": percentile(first, 95),
                               "p99": percentile(first, 99), "max": max(first, default=None)}),
        "underrun_utterances": len(late),
        "underrun_rate": len(late) / len(heard) if heard else None,
        # chunk index (-1: waiting at a cut) -> utterances whose first late chunk it was
        "first_late_chunk": dict(sorted(collections.Counter(u.first_late_chunk for u in late).items())),
        "worst_lateness_ms": 1e3 * max((u.lateness_s for u in heard), default=0.0),
        "frames_per_s": samples_in_window / texts.SAMPLES_PER_FRAME / window_s,
    }


def verdict(level: dict, p95_bar_ms: float, *, underruns_count: bool) -> list[str]:
    """Why a level misses its bar (empty: it meets it). A refused, failed or silent request was not
    carried, whatever its neighbours' latency."""
    misses = []
    if not level.get("utterances"):
        misses.append("no utterance measured")
    p95 = level.get("first_audio_ms", {}).get("p95")
    if p95 is None or p95 > p95_bar_ms:
        misses.append(f"p95 first audio {'n/a' if p95 is None else f'{p95:.1f}'} ms > {p95_bar_ms:g} ms")
    if underruns_count and level.get("underrun_utterances"):
        misses.append(f"{level['underrun_utterances']} with an underrun")
    for key in ("refused", "errors", "no_audio"):
        if level.get(key):
            misses.append(f"{level[key]} {key.replace('_', ' ')}")
    return misses


def capacity(levels: list[dict], key: str) -> float | None:
    """The largest `key` (callers, or requests/s) among the levels that met their bar."""
    met = [lv[key] for lv in levels if lv.get("meets_bar")]
    return max(met, default=None)


def summarize_rounds(rounds: list, level_wall_s: float) -> dict | None:
    """Per-round means of an EngineService's round timings (engine.round_timing.RoundTiming)."""
    if not rounds:
        return None
    n = len(rounds)
    walls = [r.wall_s for r in rounds]

    def mean_ms(values) -> float:
        return 1e3 * sum(values) / n

    return {
        "rounds": n,
        "wall_ms_mean": mean_ms(walls),
        "wall_ms_p50": 1e3 * percentile(walls, 50),
        "wall_ms_p95": 1e3 * percentile(walls, 95),
        "decode_ms_mean": mean_ms(r.decode_s for r in rounds),
        "vocoder_ms_mean": mean_ms(r.vocoder_s for r in rounds),
        "prefill_ms_mean": mean_ms(r.prefill_s for r in rounds),
        "host_ms_mean": mean_ms(r.host_s for r in rounds),
        "streams_per_round_mean": sum(r.stepped for r in rounds) / n,
        "opened_per_round_mean": sum(r.opened for r in rounds) / n,
        "busy_fraction": min(1.0, sum(walls) / level_wall_s) if level_wall_s > 0 else None,  # as below
        # A stall (a compile, a collection, a capture met mid-level) shows as one long round: what
        # it was made of, and when in the level it came.
        "slowest": [{"started_s": r.started - rounds[0].started, "wall_ms": 1e3 * r.wall_s,
                     "decode_ms": 1e3 * r.decode_s, "vocoder_ms": 1e3 * r.vocoder_s,
                     "prefill_ms": 1e3 * r.prefill_s, "host_ms": 1e3 * r.host_s,
                     "opened": r.opened, "stepped": r.stepped}
                    for r in sorted(rounds, key=lambda r: r.wall_s, reverse=True)[:3]],
    }


# A low-slack chunk counts as near a collection that ended this long before it: about a round or
# two at capacity, the time in which a pause spends a chunk's 20 ms margin.
GC_NEAR_LOW_SLACK_S = 0.1
# The pauses counted as long enough to matter against that margin.
GC_LONG_PAUSE_MS = 5.0


def gc_near_low_slack(events: list[tuple[float, float, int, bool]], pauses: list[tuple[int, float]],
                      ended_at: list[float], level_wall_s: float,
                      window_s: float = GC_NEAR_LOW_SLACK_S) -> dict | None:
    """Of the chunks that came under the engine's slack margin (`EngineService.low_slack_events`),
    how many had a collection of at least GC_LONG_PAUSE_MS in the engine's process end within
    `window_s` before them, the longest's generation, and the chance of that for any instant of
    the level (the share of its wall time those windows cover): whether the collector, which
    stops the engine thread, is what spends the margin. `pauses` and `ended_at` are GcPauses'."""
    if not events:
        return None
    long_ends = sorted((end, g, ms) for (g, ms), end in zip(pauses, ended_at) if ms >= GC_LONG_PAUSE_MS)
    near = []
    for at, *_ in events:
        window = [(g, ms) for end, g, ms in long_ends if at - window_s <= end <= at]
        if window:
            near.append(max(window, key=lambda p: p[1]))
    covered, until = 0.0, float("-inf")
    for end, _, _ in long_ends:  # the union of [end, end + window_s]
        covered += end + window_s - max(end, until)
        until = end + window_s
    by_gen = collections.Counter(g for g, _ in near)
    return {"chunks": len(events), "window_ms": 1e3 * window_s, "pause_ms_at_least": GC_LONG_PAUSE_MS,
            "after_a_long_collection": len(near),
            "longest_generation": {f"gen{g}": by_gen[g] for g in sorted(by_gen)},
            "longest_ms": max((ms for _, ms in near), default=0.0),
            "chance": min(1.0, covered / level_wall_s) if level_wall_s > 0 else None}


# Rounds before a low-slack chunk that are placed with it: a stream's second chunk (the most
# often low) is made over the two rounds after the one that sent its first.
ROUNDS_BEFORE_LOW = 3


def place_low_slack(events: list[tuple[float, float, int, bool]], rounds: list) -> dict | None:
    """The chunks that came under the engine's slack margin (`EngineService.low_slack_events`:
    arrival, slack, chunks its stream had before it, streamed turn or not) placed against the
    level's round timings: which chunk of their stream they were, and what the round each arrived
    in and the ROUNDS_BEFORE_LOW - 1 before it were made of, beside the level's mean round."""
    if not events or not rounds:
        return None
    starts = [r.started for r in rounds]
    placed = []
    for at, slack_s, chunk, streamed in events:
        i = bisect.bisect_right(starts, at) - 1  # the round the chunk was posted in
        if i < 0:
            continue
        placed.append((at, slack_s, chunk, streamed, rounds[max(0, i - ROUNDS_BEFORE_LOW + 1): i + 1]))
    if not placed:
        return None
    by_chunk = collections.Counter(min(chunk, 4) for _, _, chunk, _, _ in placed)

    def split(window: list) -> dict:
        return {"wall_ms": 1e3 * sum(r.wall_s for r in window),
                "decode_ms": 1e3 * sum(r.decode_s for r in window),
                "vocoder_ms": 1e3 * sum(r.vocoder_s for r in window),
                "prefill_ms": 1e3 * sum(r.prefill_s for r in window),
                "host_ms": 1e3 * sum(r.host_s for r in window),
                "opened": sum(r.opened for r in window), "stepped": sum(r.stepped for r in window)}

    windows = [split(w) for *_, w in placed]
    n = len(windows)
    mean_round = split(rounds)
    return {
        "chunks": n,
        "by_chunk": {("5th or later" if k == 4 else f"chunk {k + 1}"): by_chunk[k] for k in sorted(by_chunk)},
        "streamed": sum(1 for _, _, _, streamed, _ in placed if streamed),
        "slack_ms_p50": 1e3 * percentile([p[1] for p in placed], 50),
        "slack_ms_min": 1e3 * min(p[1] for p in placed),
        # Their rounds (the one each arrived in and the two before) against any three rounds.
        f"last_{ROUNDS_BEFORE_LOW}_rounds_mean": {k: sum(w[k] for w in windows) / n for k in windows[0]},
        f"any_{ROUNDS_BEFORE_LOW}_rounds_mean": {k: ROUNDS_BEFORE_LOW * v / len(rounds)
                                                 for k, v in mean_round.items()},
        "lowest": [{"slack_ms": 1e3 * slack_s, "chunk": chunk + 1, "streamed": streamed,
                    "rounds": [split([r]) for r in window]}
                   for _, slack_s, chunk, streamed, window in sorted(placed, key=lambda p: p[1])[:5]],
    }


# Rounds since the first chunk counted apart up to this many; more are counted together.
EARLY_ROUNDS_SHOWN = 4


def compare_early_chunks(events: list[tuple[float, float, int, bool, int]]) -> dict | None:
    """Every second and third chunk of a level (`EngineService.early_chunk_events`: arrival,
    slack, chunks its stream had before it, streamed turn or not, the engine's rounds since the
    stream's first chunk), whole texts beside streamed turns: per kind and chunk, how many, their
    slack's p5 and p50, and after how many rounds since the first chunk they came. Whether a
    streamed turn's early chunks come a round later than a whole text's (less slack by a round)
    or as late after fewer rounds (slower rounds) is what this tells."""
    if not events:
        return None
    out: dict = {}
    for streamed, kind in ((False, "whole"), (True, "streamed")):
        for chunk in sorted({e[2] for e in events}):
            mine = [e for e in events if e[3] == streamed and e[2] == chunk]
            if not mine:
                continue
            rounds = collections.Counter(min(e[4], EARLY_ROUNDS_SHOWN) for e in mine)
            out.setdefault(kind, {})[f"chunk {chunk + 1}"] = {
                "n": len(mine),
                "slack_ms_p5": 1e3 * percentile([e[1] for e in mine], 5),
                "slack_ms_p50": 1e3 * percentile([e[1] for e in mine], 50),
                "rounds_since_first": {(f"{k}+" if k == EARLY_ROUNDS_SHOWN else str(k)): rounds[k]
                                       for k in sorted(rounds)},
            }
    return out


def served_rounds(before: tuple[float, ...], after: tuple[float, ...] | None,
                  level_wall_s: float, source: str = "server /metrics") -> dict | None:
    """A level's rounds from the engine's counters (rounds, seconds, streams stepped: a server's
    /metrics, or the service's own in process) read before and after it: their count, mean wall
    time and streams a round (where the server publishes them), without the split into decode and
    vocoder, which only round timing measures."""
    if after is None:
        return None
    n, seconds = after[0] - before[0], after[1] - before[1]
    if n <= 0:
        return None
    streams = after[2] - before[2] if after[2] is not None and before[2] is not None else None
    return {
        "rounds": int(n),
        "wall_ms_mean": 1e3 * seconds / n,
        "streams_per_round_mean": None if streams is None else streams / n,
        # A round in flight when the level began counts whole, so the quotient can pass 1 by a
        # round's share (1.004 in a loaded CI run): the engine cannot be busier than always.
        "busy_fraction": min(1.0, seconds / level_wall_s) if level_wall_s > 0 else None,
        "source": source,
    }


def lag_summary(samples: list[float]) -> dict:
    """An event loop's lag samples (seconds: how late each wake-up of a sleeping task came) in ms."""
    return {"n": len(samples), "p50_ms": _ms1(percentile(samples, 50)), "p99_ms": _ms1(percentile(samples, 99)),
            "max_ms": _ms1(max(samples, default=None))}


def _ms1(value: float | None) -> float | None:
    return None if value is None else 1e3 * value


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text exposition's samples: each series as written (name and labels) to its value."""
    series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            series[name] = float(value)
        except ValueError:
            continue
    return series


def labelled(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    """The series of counter `name` by the value of its one `label` (name{label="value"} -> value)."""
    prefix = f'{name}{{{label}="'
    return {series[len(prefix):-2]: value for series, value in metrics.items()
            if series.startswith(prefix) and series.endswith('"}')}


def server_rounds(metrics: dict[str, float] | None) -> tuple[float, float, float | None] | None:
    """A server's engine rounds so far, their summed seconds and the streams they stepped (None
    from a server that does not publish it), from its /metrics samples."""
    if metrics is None:
        return None
    rounds = metrics.get("qwen_tts_engine_rounds_total")
    seconds = metrics.get("qwen_tts_engine_round_seconds_total")
    streams = metrics.get("qwen_tts_engine_round_streams_total")
    return None if rounds is None or seconds is None else (rounds, seconds, streams)


LOOP_LAG_METRIC = "qwen_tts_event_loop_lag_seconds"
GC_METRIC = "qwen_tts_gc_pause_seconds"


def served_gc(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """A level's collections in a server's processes from its /metrics read before and after it, by
    generation: their count, total ms, and the longest's bucket bound (`max_ms`, an upper bound:
    the histogram keeps no maximum), summed over its processes, and the same for each process
    under "by_process" (server; engine, where the engine runs in a process of its own); None where
    the server does not publish them."""
    if before is None or after is None or not any(k.startswith(GC_METRIC) for k in after):
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def labels_of(name: str) -> dict[str, str]:
        inner = name[name.index("{") + 1 : name.rindex("}")] if "{" in name else ""
        return dict(part.split("=", 1) for part in inner.split(",") if part) if inner else {}

    # (process, generation) -> [count, seconds, [(upper bound, cumulative)]]
    series: dict[tuple[str, int], list] = {}
    for name in after:
        if not name.startswith(GC_METRIC + "_"):
            continue
        labels = {k: v.strip('"') for k, v in labels_of(name).items()}
        if "generation" not in labels:
            continue
        key = (labels.get("process", "server"), int(labels["generation"]))
        entry = series.setdefault(key, [0.0, 0.0, []])
        if name.startswith(GC_METRIC + "_count"):
            entry[0] = delta(name)
        elif name.startswith(GC_METRIC + "_sum"):
            entry[1] = delta(name)
        elif name.startswith(GC_METRIC + "_bucket"):
            entry[2].append((float(labels["le"]), delta(name)))

    def summary(parts: list[list]) -> dict:
        count = sum(p[0] for p in parts)
        total = sum(p[1] for p in parts)
        # The first bound by which every one had ended (inf: one took longer than the last bound),
        # over the processes: the largest of theirs.
        longest = max((next((upper for upper, cumulative in sorted(p[2]) if cumulative >= p[0]), 0.0)
                       for p in parts if p[0]), default=0.0)
        return {"collections": int(count), "total_ms": round(1e3 * total, 2),
                "max_ms": 1e3 * longest if count else 0.0, "max_is_bound": True}

    out: dict = {f"gen{gen}": summary([v for (_, g), v in series.items() if g == gen]) for gen in (0, 1, 2)}
    processes = sorted({p for p, _ in series})
    out["by_process"] = {p: {f"gen{gen}": summary([v for (q, g), v in series.items() if q == p and g == gen])
                             for gen in (0, 1, 2)} for p in processes}
    return out


def _lag_histogram(metrics: dict[str, float]) -> tuple[list[tuple[float, float]], float] | None:
    """The server's loop-lag histogram: (upper bound, cumulative count) ascending, +Inf last, and its sum."""
    prefix = f'{LOOP_LAG_METRIC}_bucket{{le="'
    buckets = sorted((float(name[len(prefix):].split('"')[0]), count)
                     for name, count in metrics.items() if name.startswith(prefix))
    total = metrics.get(f"{LOOP_LAG_METRIC}_sum")
    if not buckets or total is None or not math.isinf(buckets[-1][0]):
        return None
    return buckets, total


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of a histogram of cumulative counts, interpolated linearly within
    its bucket (Prometheus' histogram_quantile): the highest finite bound where it lies beyond it."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank and cumulative > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def histogram_lag(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """A level's event-loop lag from a server's /metrics read before and after it: the histogram's
    deltas, their count and mean, and p50/p99 interpolated within its buckets (exact to a bucket's
    width); None where the server does not publish it."""
    a = _lag_histogram(before) if before is not None else None
    b = _lag_histogram(after) if after is not None else None
    if a is None or b is None:
        return None
    old = dict(a[0])
    delta = [(upper, count - old.get(upper, 0.0)) for upper, count in b[0]]
    n = delta[-1][1]
    p50, p99 = bucket_quantile(delta, 0.5), bucket_quantile(delta, 0.99)
    return {"n": int(n), "p50_ms": _ms1(p50), "p99_ms": _ms1(p99),
            "mean_ms": 1e3 * (b[1] - a[1]) / n if n > 0 else None,
            "source": "server /metrics (histogram, interpolated within buckets)"}
