"""`prefixserve bench side-channel` on a CPU: the command's whole path on a tiny run (JSON with
both parts, PNG), and its two-sample statistics against scipy's. The timing verdict itself is
the benchmark's to report (benchmarks/results/), never a test's."""

from __future__ import annotations

import json
import random

import pytest
from scipy import stats

from prefixserve.bench.twosample import ks_distance, mann_whitney, summary
from prefixserve.cli import main


@pytest.mark.parametrize("shift", [0.0, 0.4, 1.5])
def test_statistics_match_scipy(shift):
    rng = random.Random(int(shift * 10))
    x = [round(rng.gauss(0, 1), 1) for _ in range(50)]  # rounded: ties, as timings have
    y = [round(rng.gauss(shift, 1), 1) for _ in range(61)]
    ours, ref = mann_whitney(x, y), stats.mannwhitneyu(x, y, method="asymptotic")
    assert ours["u"] == ref.statistic and ours["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert ks_distance(x, y) == pytest.approx(stats.ks_2samp(x, y).statistic, rel=1e-12)
    s = summary(x)
    assert (s["n"], s["min"], s["max"]) == (50, min(x), max(x)) and s["q1"] <= s["median"] <= s["q3"]


def test_identical_samples_are_not_told_apart():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert mann_whitney(x, list(x))["p"] == 1.0 and mann_whitney(x, list(x))["effect_size"] == 0.5
    assert ks_distance(x, list(x)) == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        mann_whitney([1.0], x)


def test_cpu_run_json_and_png(tmp_path, capsys):
    args = ["bench", "side-channel", "--trials", "3", "--prompt-len", "24", "--decode-len", "3",
            "--decode-batch", "2", "--threads", "1", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    path = tmp_path / "side-channel-p24-SmolLM2-135M-Instruct-cpu.json"
    doc = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert doc["hardware"]["device"] == "cpu" and "--trials 3" in doc["command"]
    for part in ("ttft", "tpot"):
        assert {len(v) for v in doc["raw"][part].values()} == {3}
        assert set(doc[part]) >= {"probe", "control", "cached", "mann_whitney", "ks_distance", "within_tenant_ratio"}
        assert all(v > 0 for values in doc["raw"][part].values() for v in values)
    assert "within a tenant" in capsys.readouterr().out
