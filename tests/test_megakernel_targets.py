"""bench/targets.py: issue 4's targets judged on a megakernel_check result, on the committed H200
run of kernel v25 and on made-up results that meet every bar or lack the engine stage."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
V25C = ROOT / "bench" / "results" / "megakernel_h200_2026-11-24_v25c.json"


def load_targets():
    spec = importlib.util.spec_from_file_location("bench_targets", ROOT / "bench" / "targets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def targets():
    return load_targets()


@pytest.fixture(scope="module")
def v25c():
    return json.loads(V25C.read_text())


def test_the_v25_run_misses_three_bars_by_its_own_numbers(targets, v25c):
    rows = {r["target"].split(" ")[0]: r for r in targets.summarize_targets(v25c)}
    modes = v25c["sizes"]["0.6b"]["modes"]
    talker = rows["talker"]
    assert talker["measured"] == modes["talker_only_sampling_pos100"]["median_ms"]
    assert talker["status"] == "missed"
    assert talker["missed_by"] == pytest.approx(talker["measured"] - 0.3)
    assert talker["ratio"] == pytest.approx(talker["measured"] / 0.3)
    floor = v25c["sizes"]["0.6b"]["floor_at_copy_bw"]["talker_step_ms"]
    assert talker["percent_of_floor"] == pytest.approx(100 * floor / talker["measured"])
    assert rows["15"]["measured"] == modes["predictor_only_sampling"]["median_ms"] and rows["15"]["status"] == "missed"
    frame = rows["a"]
    assert frame["measured"] == pytest.approx(v25c["engine"]["streaming"]["rtf"] * 80.0)
    assert frame["where_the_time_goes"]["kernel_frame_ms"] == modes["frame_sampling_pos100"]["median_ms"]
    assert rows["time"]["status"] == "met" and rows["time"]["measured"] == v25c["engine"]["ttfc_warm_ms"]["p50"]
    assert rows["first"]["status"] == "met"
    assert rows["first"]["measured"] == pytest.approx(
        v25c["engine"]["first_request_ttfc_ms"] / v25c["engine"]["ttfc_warm_ms"]["p50"])


def test_a_missed_kernel_bar_lists_only_its_own_stacks_phases_largest_first(targets, v25c):
    rows = targets.summarize_targets(v25c)
    for row, stack in ((rows[0], "talker."), (rows[1], "predictor.")):
        where = row["where_the_time_goes"]
        names = [p["phase"] for p in where["phases"]]
        profile = v25c["sizes"]["0.6b"]["profile_sampling_pos100"]["phases"]
        assert sorted(names) == sorted(n for n in profile if n.startswith(stack))
        totals = [p["total_us"] for p in where["phases"]]
        assert totals == sorted(totals, reverse=True)
        assert where["total_us"] == pytest.approx(sum(totals))
    md = targets.render_markdown(v25c, rows)
    assert "missed by 0.275 ms (1.92x the bar)" in md
    assert md.count("## Where the time goes") == 3
    assert "| predictor.attention_o | 75 |" in md


def test_bars_met_leave_no_breakdown_and_a_run_without_the_engine_says_not_measured(targets, v25c):
    fast = copy.deepcopy(v25c)
    for mode in fast["sizes"]["0.6b"]["modes"].values():
        mode["median_ms"] /= 4
    fast["engine"]["streaming"]["rtf"] = 0.02
    rows = targets.summarize_targets(fast)
    assert [r["status"] for r in rows] == ["met"] * 5
    assert "Where the time goes" not in targets.render_markdown(fast, rows)

    del fast["engine"]
    rows = targets.summarize_targets(fast)
    assert [r["status"] for r in rows] == ["met", "met", "not measured", "not measured", "not measured"]
    assert "| n/a | not measured |" in targets.render_markdown(fast, rows)
