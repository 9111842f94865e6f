"""results.publish: the one writer of every bench's JSON (+ PNG), with what reproduces a result."""

from __future__ import annotations

import argparse
import json
import re

from prefixserve.bench import results as R
from prefixserve.cli import main


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args._parser = p
    return args


def test_publish_records_command_commit_hardware_and_date(tmp_path, capsys):
    plotted = []
    path = R.publish({"results": [1]}, tmp_path / "sub" / "x.json", _args("--rate", "2"), "prefixserve bench x",
                     lambda doc, png: plotted.append((doc["results"], png)))
    doc = json.loads(path.read_text())
    assert doc["results"] == [1] and doc["command"] == "prefixserve bench x --rate 2.0"
    assert re.fullmatch(r"[0-9a-f]{40}", doc["git"]["commit"]) and isinstance(doc["git"]["dirty"], bool)
    assert doc["hardware"]["device"] in ("cpu", "cuda") and re.match(r"\d{4}-\d\d-\d\dT", doc["created"])
    assert plotted == [([1], tmp_path / "sub" / "x.png")]
    assert capsys.readouterr().out == f"wrote {path} and x.png\n"


def test_publish_without_plot_or_git(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to run
    plotted = []
    R.publish({"hardware": {"device": "cpu"}}, tmp_path / "x.json", _args("--no-plot"), "b",
              lambda doc, png: plotted.append(png))
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["git"] == {"commit": None, "dirty": None} and doc["hardware"] == {"device": "cpu"}
    assert not plotted and capsys.readouterr().out == f"wrote {tmp_path / 'x.json'}\n"
    R.publish({}, tmp_path / "y.json", _args(), "b", partial=True)  # a checkpoint: written, silently
    assert (tmp_path / "y.json").exists() and capsys.readouterr().out == ""


def test_moe_command_writes_its_rows(tmp_path):
    """`prefixserve bench moe` on the CPU, on a tiny config (fp32)."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 16, "hidden_size": 32,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    assert main(["bench", "moe", "--config", str(tmp_path / "tiny.json"), "--tokens", "4,8", "--device", "cpu",
                 "--dtype", "float32", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "moe-tiny-cpu.json").read_text())
    assert [r["tokens"] for r in doc["rows"]] == [4, 8] and doc["rows"][0]["limit_us"] > 0
    assert "--tokens 4,8" in doc["command"] and doc["git"]["commit"]
