"""Text as the caller gave it gives the official package's codes (issue 32, item 16).

Leading and trailing whitespace and control characters change the official codes from frame 0; the
engine used to strip the first and turn the second into spaces, and so parted from the official
package on exactly these texts. It now tokenizes the text as given. Same machinery as
tests/test_oracle.py (official qwen-tts in its own venv, tiny checkpoint, fp32, greedy).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle.harness import official_outputs
from test_oracle import EN_TEXT, assert_same_codes, case, engine, oracle, our_request  # noqa: F401

pytestmark = pytest.mark.oracle

TEXTS = {
    "padded": f"  {EN_TEXT}  ",
    "tab_crlf": f"\t{EN_TEXT}\r\n",
    "control": "Hello\x07 there,\x1b how are you\ttoday?",
}
CASES = [case(f"text_{name}_{mode}", text, "english", mode == "prefill", speaker="ryan")
         for name, text in TEXTS.items() for mode in ("prefill", "dual")]


@pytest.fixture(scope="module")
def official(oracle):  # noqa: F811 - the fixture imported above
    return official_outputs(oracle("custom_voice").ckpt, CASES)


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_text_as_given_gives_the_official_codes(oracle, engine, official, c):  # noqa: F811
    ours = engine("custom_voice").generate_codes(c["text"], **our_request(c)).numpy()
    assert_same_codes(ours, official[c["id"]]["codes"])


def test_the_whitespace_does_change_the_official_codes(oracle, official):  # noqa: F811
    """Otherwise the test above could not tell a stripping engine from one that keeps the text."""
    plain = oracle("custom_voice").results["en_ryan_prefill"]["codes"]
    padded = official["text_padded_prefill"]["codes"]
    assert padded.shape != plain.shape or not np.array_equal(padded, plain)
