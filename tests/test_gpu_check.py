"""benchmarks/gpu_check.py runs where CUDA is; CI runs it on CPU so that it keeps working."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_check_runs_on_cpu_and_measures_the_modelled_figures(tmp_path, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "figures.json"
    assert gpu_check.main(["--tiny", "--gbs", "8", "--steps", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert "errors" not in figures, figures.get("errors")  # each check ran, none failed
    assert figures["device"] == "cpu" and figures["gbs"] == 8
    for key in ("modelled_peak_bytes", "measured_peak_bytes", "modelled_step_s",
                "measured_step_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key
    # the live-storage count and the model describe the same step: a unit slip or a
    # missing term (gradients, AdamW's two moments) would be far outside this
    assert 0.5 < figures["memory_ratio"] < 2.0, figures
    # the device checks: the step against a hand loop, and exactness on the device's kernels
    assert [row["mbs"] for row in figures["overhead"]] == [8, 4]
    assert figures["float64"]["grad_rel"] < 1e-12 and figures["float64"]["loss_rel"] < 1e-12
    assert figures["bf16"]["mbcompile"] <= 1.1 * figures["bf16"]["hand_loop"]
    scales = figures["fp16_scaler"]["scales"]
    assert figures["fp16_scaler"]["same_as_eager"] and scales[5] < scales[4]  # skipped, as eager
    text = capsys.readouterr().out
    assert "peak memory, MiB" in text and "Exactness on the device" in text
