"""`prefixserve bench kv-accuracy`: its metrics on known outputs, and the command end to end on
the embedded model (a few requests)."""

from __future__ import annotations

import json

import pytest

from prefixserve.bench.kv_accuracy import compare
from prefixserve.cli import main


def test_metrics_compare_only_the_agreed_positions():
    wide = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([5, 6], [-1.0, -2.0]), ([7, 8], [-0.5, -0.5])]
    fp8 = [([1, 2, 3, 4], [-0.1, -0.3, -0.3, -0.2]), ([5, 9], [-1.5, -0.1]), ([0, 8], [-9.0, -0.5])]
    m = compare(wide, fp8)
    assert m["identical"] == pytest.approx(1 / 3) and m["first_token"] == pytest.approx(2 / 3)
    assert m["agreed_fraction"] == [1.0, 0.5, 0.0] and m["agreement"] == pytest.approx(0.5)
    # positions 0-3 of the first request and 0 of the second; none past a difference
    assert m["positions_compared"] == 5
    assert m["mean_abs_logprob"] == pytest.approx((0 + 0.1 + 0 + 0.2 + 0.5) / 5)
    assert m["max_abs_logprob"] == pytest.approx(0.5)


def test_command_on_the_embedded_model(tmp_path):
    assert main(["bench", "kv-accuracy", "--num-prompts", "3", "--max-output-len", "4", "--system-prompt-len", "32",
                 "--kv-cache-memory", str(64 << 20), "--out-dir", str(tmp_path), "--no-progress"]) == 0
    (path,) = tmp_path.glob("kv-accuracy-sharegpt-SmolLM2-135M-Instruct-cpu.json")
    doc = json.loads(path.read_text())
    assert doc["requests"] == 3 and 0 <= doc["agreement"] <= 1 and doc["first_token"] > 0
    assert doc["positions_compared"] > 0 and "--num-prompts 3" in doc["command"]
