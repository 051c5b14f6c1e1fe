"""bench/probes/row_prefill_ab.py on the CPU with the tiny checkpoint: the check finds the rows
equal to each prompt alone, both ways of opening are timed for every k, and the table is
written. No speed is asserted (the GPU run is what measures)."""

from __future__ import annotations

import json

import pytest
from helpers_probes import cpu_batch_engine, load_probe


@pytest.mark.timeout(300)
def test_row_prefill_probe_checks_and_times_both_ways(tiny_checkpoint, tmp_path, capsys):
    probe = load_probe("row_prefill_ab")
    engine = cpu_batch_engine(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=12)
    out = tmp_path / "row-prefill"
    args = probe.parse_args(["--model", "unused", "--out", str(out), "--opens-per-round", "1,3",
                             "--repeats", "2", "--live", "2"])
    try:
        result = probe.run(engine, args)
    finally:
        engine.close()
    assert "no speed claimed" in capsys.readouterr().out
    assert json.loads((out / probe.RESULT).read_text()) == result
    assert result["live_calls"] == 2 and result["row_prefill_rows"] == 4
    check = result["check"]
    assert check["row_passes_used"] == 1
    assert all(err < 1e-5 for err in check["max_rel_error"].values()), check
    assert set(result["per_k"]) == {"1", "3"}
    for row in result["per_k"].values():
        for way in ("one_by_one_ms", "rows_ms"):
            assert row[way]["n"] == 2 and row[way]["median"] > 0
    assert (out / probe.MARKDOWN).read_text().count("\n| ") == 3  # the header and k = 1, 3
    assert not engine.backend.row_prefills.entries  # set back as it found them
    with pytest.raises(SystemExit):
        probe.parse_args(["--model", "m", "--out", "o", "--opens-per-round", "0"])
