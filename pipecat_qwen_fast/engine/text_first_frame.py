"""A streamed turn's first frame (issue 35): its audio once the first token is final, not the
second, and the GPU work for it done while the LLM writes (engine/text_session.py's helpers).

Frame 0 of a dual-track segment takes its codes from the prefill alone (spec §4.5: the codec head
and the code predictor on the prompt's last hidden state, which holds token 0); only the frame's
next talker input needs token 1's vector. Where the backend can make those codes ahead
(`preview_frame`: the megakernel, eager, the auto backend's megakernel side), `preview` sends them
as the frame's once token 0 is final, and `catch_up` runs the rest of the frame in the backend
state once token 1's vector (or tts_eos) is there: the same operations, so the same codes as the
whole text. Before any token is final, `speculate` prefills with a guess at token 0 and previews
frame 0 in the LLM's interval (docs/STREAMING_TEXT.md, "First audio").
"""

from __future__ import annotations

import time

import torch

from pipecat_qwen_fast.engine import text_session as ts
from pipecat_qwen_fast.engine.request import AudioChunk
from pipecat_qwen_fast.engine.session import to_host


def speculate(engine, s) -> None:
    """Before the turn's first token is final: prefill with a guess at it (the first token of the
    text so far, as if it ended there) and preview frame 0 where the backend can, so that when the
    token is final and the guess right, frame 0's audio goes out without waiting for the GPU. A
    token is known final only when the next one's first character arrives, one LLM token later:
    the prefill and the frame run in that interval instead of after it. A wrong guess costs a
    fresh state and the prefill again (`text_session._begin`). The first segment only, not for in-context
    voices (their prompt holds more text than the first token)."""
    feed = s.feed
    if feed.spans or feed.ref or feed.begun:
        return
    turn = feed.turn
    if turn.appends == feed.guess_at:
        return
    feed.guess_at = turn.appends
    guess = turn.first_token_guess()
    if guess is None or guess == feed.guess:
        return
    if feed.guess is not None:
        ts._fresh_state(engine, s)  # it holds the prefill of another guess
    with torch.no_grad():
        prompt = ts._prompt(engine, s, "", body=[guess])
    engine._prefill([s], [prompt.embeds])
    feed.guess = guess
    found = previewer(engine, s)
    if found is not None:
        codes = found[0].preview_frame(found[1])
        # Frame 0's audio too, on the vocoder graph's own copy of the state (committed by the
        # flush only if the guess was right and no call of its size ran since): with a right
        # guess, the turn's first audio then waits for no GPU work at all once the token is final.
        engine._vocode_early(s, codes)


def previewer(engine, s) -> tuple | None:
    """(backend, state) that can make the session's frame 0 ahead of the frame (`preview_frame`),
    or None."""
    backend, state = engine.backend, s.state
    if state is None:
        return None
    if hasattr(backend, "preview_frame"):
        return backend, state
    # The auto backend (backends/hybrid.py): a call on its megakernel side previews there.
    inner, fast = getattr(state, "inner", None), getattr(backend, "fast", None)
    if inner is not None and getattr(state, "on_fast", False) and hasattr(fast, "preview_frame"):
        return fast, inner
    return None


def preview(engine, s) -> list[AudioChunk]:
    """Frame 0 of a segment whose second token is not final yet: its codes need only the prefill
    (spec §4.5: the codec head and the code predictor on the prompt's last hidden state), only the
    frame's next talker input needs that token's vector. The codes are taken as the frame's and
    sent; the backend state stays at frame 0 until the vector is there (`catch_up`)."""
    feed = s.feed
    if s.segment_frames != 0 or feed.previewed:
        return []
    found = previewer(engine, s)
    if found is None:
        return []
    codes = found[0].preview_frame(found[1])
    host, copied = to_host(codes)
    if copied is not None:
        copied.synchronize()
    feed.previewed = True
    chunks = engine._after_frame(s, codes, host.numpy())
    if feed.first_audio_at is None and s.chunk_start > 0:
        feed.first_audio_at = time.monotonic()
    return chunks


def catch_up(engine, s) -> None:
    """A previewed frame 0 runs in the backend state once its text vector is there (the second
    token, or tts_eos): `decode_frame` returns the previewed codes and makes the next input."""
    feed = s.feed
    if not feed.previewed or not (feed.closed or feed.trailing >= 1):
        return
    feed.previewed = False
    found = previewer(engine, s)
    if found is not None:
        found[0].decode_frame(found[1])
    else:
        # Moved by the auto backend into its batch since the preview (backends/hybrid.py): the
        # preview went with the old state, and frame 0 runs there anew.
        engine.backend.decode_frame(s.state)
