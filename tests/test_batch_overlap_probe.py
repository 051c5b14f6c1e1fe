"""bench/probes/batch_overlap.py on the CPU with the tiny checkpoint: every way is timed for
every cell and the table is written. Nothing about overlap is asserted (the GPU run measures it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_probes import cpu_batch_engine, load_probe


@pytest.mark.timeout(300)
def test_batch_overlap_probe_times_every_way(tiny_checkpoint, tmp_path, capsys):
    probe = load_probe("batch_overlap")
    engine = cpu_batch_engine(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=4)
    out = tmp_path / "overlap"
    args = probe.parse_args(["--model", "unused", "--out", str(out), "--rows", "1,3", "--vocoder", "2x2",
                             "--repeats", "2", "--prestep", "1"])
    try:
        result = probe.run(engine, args)
        assert len(engine.backend.free_slots) == 4  # every call it opened is closed again
    finally:
        engine.close()
    assert "nothing claimed" in capsys.readouterr().out
    assert json.loads((out / probe.RESULT).read_text()) == result
    assert [(c["rows"], c["call"]) for c in result["cells"]] == [(1, "2x2"), (3, "2x2")]
    for cell in result["cells"]:
        assert all(cell[w]["n"] == 2 and cell[w]["median"] > 0 for w in probe.WAYS)
    assert (out / probe.MARKDOWN).read_text().count("\n| ") == 3
    assert probe.parse_calls("32x2,2x32") == [(32, 2), (2, 32)]
    with pytest.raises(SystemExit):
        probe.parse_args(["--model", "m", "--out", "o", "--vocoder", "3"])


@pytest.mark.timeout(300)
def test_round_probes_run_both_on_one_engine(tiny_checkpoint, tmp_path):
    driver = load_probe("round_probes")
    engine = cpu_batch_engine(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8)
    try:
        failed = driver.run_all(engine, Path("unused"), tmp_path, extra={
            "batch_overlap": ["--rows", "2", "--vocoder", "2x1", "--repeats", "1", "--prestep", "0"],
            "row_prefill_ab": ["--opens-per-round", "2", "--repeats", "1", "--live", "1"]})
    finally:
        engine.close()
    assert failed == []
    assert (tmp_path / "batch-overlap" / "batch_overlap.json").exists()
    assert (tmp_path / "row-prefill" / "row_prefill_ab.json").exists()
