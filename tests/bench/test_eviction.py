"""`prefixserve bench eviction`: runs end to end on small sizes, the heap evicting exactly what the
old scan evicts (the bench raises otherwise), and writes its result through results.publish."""

from __future__ import annotations

import json

from prefixserve.cli import main


def test_bench_eviction_writes_heap_and_scan_rows(tmp_path):
    assert main(["bench", "eviction", "--sizes", "16,64", "--steps", "3", "--batch", "4",
                 "--out-dir", str(tmp_path), "--no-plot"]) == 0
    doc = json.loads((tmp_path / "eviction-cpu.json").read_text())
    assert [r["nodes"] for r in doc["results"]] == [16, 64]
    assert all(r["scan_us"] > 0 and r["heap_us"] > 0 and r["ratio"] > 0 for r in doc["results"])
    assert doc["command"].startswith("prefixserve bench eviction --sizes 16,64") and "git" in doc
