"""bench/probes/open_profile.py on the CPU with the tiny checkpoint: every phase of an open is
timed, the phases fit inside the whole open, and the profile (CPU ops only here) and the markdown
table are written. No speed is asserted."""

from __future__ import annotations

import json

import pytest
from helpers_probes import load_probe


@pytest.mark.timeout(300)
def test_open_profile_times_every_phase_inside_the_open(tiny_checkpoint, tmp_path, capsys):
    probe = load_probe("open_profile")
    out = tmp_path / "open-profile"
    opens = 3
    rc = probe.main(["--model", str(tiny_checkpoint("custom_voice", zero_eos=True)), "--out", str(out),
                     "--opens", str(opens), "--live", "2", "--prestep", "1", "--warm-opens", "1",
                     "--profile-opens", "1", "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "CUDA parts skipped" in printed  # and why
    result = json.loads((out / probe.RESULT).read_text())
    assert result["cuda_skipped"] and result["live_calls"] == 2
    assert result["placement_counts"]["refused"] == 0

    plain, split = result["plain_opens"], result["split_opens"]
    assert len(plain) == len(split) == opens
    assert all(r["open_ms"] > 0 for r in plain)
    for r in split:
        phases = r["phases_ms"]
        assert set(phases) == set(probe.PHASES)
        assert all(phases[p] > 0 for p in probe.PHASES), phases
        # The phases do not nest in one another: together at most the whole open (1e-9 ms: float rounding).
        assert sum(phases.values()) <= r["open_ms"] + 1e-9, r
        assert r["other_ms"] == pytest.approx(r["open_ms"] - sum(phases.values()), abs=1e-9)
        assert r["prompt_positions"][0] > 0

    summary = result["summary"]
    for name in (*probe.PHASES, "other"):
        st = summary["phases_ms"][name]
        assert st["n"] == opens and st["median"] > 0 and st["p90"] >= st["median"]
    assert summary["open_plain_ms"]["median"] > 0

    profile = result["profile"]
    assert profile["opens"] == 1 and profile["cuda"] is False
    for name in ("prompt", "prefill", "vocoder_stream"):
        entry = profile["phases"][name]
        assert entry["top_ops_by_count"] and entry["top_ops_by_host_time"]
        assert len(entry["top_ops_by_count"]) <= probe.TOP
        assert "kernels_per_open" not in entry  # no CUDA here
    # A fresh vocoder stream is made of zeroed tensors.
    assert any(op["op"] == "aten::zeros" for op in profile["phases"]["vocoder_stream"]["top_ops_by_count"])

    md = (out / probe.MARKDOWN).read_text()
    assert md in printed
    for name in (*probe.PHASES, "other"):
        assert f"| {name} |" in md


def test_profile_events_go_to_the_innermost_phase_that_holds_them():
    """The CUDA side of the profile's bookkeeping, on made-up events (no GPU here): kernels, copies
    and syncs counted in the innermost phase, `prefill` holding its subphases, the probe's own
    device syncs apart, annotations, other threads' ops and events outside the open left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    probe = load_probe("open_profile")
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA

    def ev(name, start, end, device=cpu, thread=1, self_us=1.0, total_us=2.0):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               thread=thread, self_cpu_time_total=self_us, cpu_time_total=total_us)

    events = [
        ev("phase::open", 0, 100), ev("phase::validate", 1, 5), ev("phase::prompt", 6, 30),
        ev("phase::backend_state", 20, 28), ev("phase::prefill", 31, 80), ev("phase::prefill.graph", 40, 70),
        ev("phase::vocoder_stream", 81, 95), ev("phase::prompt", 6, 30, device=gpu),  # the annotation's GPU side
        ev("aten::embedding", 8, 11), ev("aten::foo", 8, 9, thread=7),  # another thread's op: left out
        ev("cudaLaunchKernel", 9, 9.5, thread=99), ev("cudaStreamSynchronize", 10, 11.5),
        ev("embedding_kernel", 12, 13, device=gpu),
        ev("cudaMemcpyAsync", 21, 22), ev("Memcpy HtoD (Pageable -> Device)", 22, 23, device=gpu),
        ev("cudaGraphLaunch", 45, 46), ev("k1", 46, 50, device=gpu), ev("k2", 50, 60, device=gpu),
        ev("cudaLaunchKernel", 72, 72.5), ev("copy_kernel", 73, 74, device=gpu),
        ev("cudaDeviceSynchronize", 79, 80),  # the probe's own
        ev("aten::zeros", 82, 83), ev("Memset (Device)", 85, 86, device=gpu),
        ev("late_kernel", 150, 151, device=gpu),  # after the open
    ]
    per_phase: dict = {}
    probe.attribute(events, per_phase)
    out = probe.phase_entries(per_phase, 1, cuda=True)

    prompt = out["prompt"]
    assert (prompt["kernels_per_open"], prompt["launch_calls_per_open"], prompt["syncs_per_open"]) == (1, 1, 1)
    assert prompt["syncs_by_kind_per_open"] == {"cudaStreamSynchronize": 1}
    assert [op["op"] for op in prompt["top_ops_by_count"]] == ["aten::embedding"]
    assert prompt["gpu_busy_ms_per_open"] == pytest.approx(1e-3)
    state = out["backend_state"]
    assert (state["memcpy_per_open"], state["memcpy_calls_per_open"], state["kernels_per_open"]) == (1, 1, 0)
    assert out["prefill.graph"]["kernels_per_open"] == 2 and out["prefill.graph"]["launch_calls_per_open"] == 1
    assert out["prefill.rest"]["kernels_per_open"] == 1
    prefill = out["prefill"]
    assert (prefill["kernels_per_open"], prefill["launch_calls_per_open"], prefill["syncs_per_open"]) == (3, 2, 0)
    assert prefill["probe_device_syncs_per_open"] == 1
    assert prefill["gpu_busy_ms_per_open"] == pytest.approx(15e-3)
    assert prefill["top_kernels_by_gpu_time"][0] == {"kernel": "k2", "count_per_open": 1, "gpu_us_per_open": 10.0}
    voc = out["vocoder_stream"]
    assert (voc["memset_per_open"], voc["kernels_per_open"], voc["ops_per_open"]) == (1, 0, 1)
    assert "validate" not in out and "other" not in out  # no event of theirs
    assert sum(e["kernels_per_open"] for k, e in out.items() if k != "prefill") == 4  # late_kernel left out
