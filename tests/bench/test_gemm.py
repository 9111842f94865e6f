"""`prefixserve bench gemm` and `prefixserve bench determinism` on a CPU: each command's whole path
on a tiny run (JSON, its verdicts). The GPU runs are the benchmarks' to report
(benchmarks/results/gemm-*, determinism-*)."""

from __future__ import annotations

import json

from prefixserve.cli import main


def test_gemm_cpu_run(tmp_path, capsys):
    args = ["bench", "gemm", "--device", "cpu", "--config", "benchmarks/configs/smollm2-135m.json", "--rows", "1,5,17",
            "--cublas-rows", "1,2", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    doc = json.loads((tmp_path / "gemm-smollm2-135m-cpu.json").read_text())
    assert {r["layer"] for r in doc["rows"]} == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(i["rows_identical"] and i["shapes_identical"] for i in doc["invariance"])
    assert all(r["invariant_us"] > 0 and r["limit_us"] > 0 for r in doc["rows"])
    assert "rows identical across M: True" in capsys.readouterr().out


def test_determinism_cpu_run(tmp_path):
    args = ["bench", "determinism", "--prefix-len", "24", "--max-tokens", "3", "--threads", "1",
            "--no-progress", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    doc = json.loads((tmp_path / "determinism-float32-SmolLM2-135M-Instruct-cpu.json").read_text())
    assert doc["all_identical"] and len(doc["settings"]) >= 17
