"""`prefixserve bench kernels-ab` on a CPU: real worker processes, each importing prefixserve from its
arm's tree; the report, the JSON, and the exit status where an arm's outputs differ."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

import prefixserve
from prefixserve.cli import main

SRC = pathlib.Path(prefixserve.__file__).resolve().parents[1]
ROW = ("--batch", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--context", "96",
       "--shared", "64,16", "--chunk-size", "16", "--dtype", "float32", "--device", "cpu")


def test_two_arms_alternated_on_the_same_rows(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert main(["bench", "kernels-ab", "--tree", f"a={SRC}", "--tree", f"b={SRC}", *ROW,
                 "--kv-cache-dtype", "both", "--rounds", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["trees"] == {"a": str(SRC), "b": str(SRC)} and doc["rounds"] == 2 and doc["backend"] == "relay"
    assert [r["label"] for r in doc["rows"]] == ["b4 ctx96 sh64+16", "b4 ctx96 sh64+16 fp8"]
    for r in doc["rows"]:
        a, b = r["arms"]["a"], r["arms"]["b"]
        assert len(a["us"]) == len(b["us"]) == 2 and min(a["us"]) == a["least_us"] > 0
        assert a["vs_first"] == 1.0 and b["vs_first"] == pytest.approx(b["least_us"] / a["least_us"])
        assert a["equal_to_first"] and b["equal_to_first"]  # the same tree, seeded rows: bit for bit
    table = capsys.readouterr().out
    assert "row | a us | b us | b / a | rounds' spread | outputs equal" in table
    assert table.count("| yes") == 2


def test_an_arm_whose_outputs_differ_fails(tmp_path, capsys):
    """A copy of the tree whose rows are drawn from another seed: its outputs differ, the report
    says so and the command exits 1 (0 with --allow-different)."""
    other = tmp_path / "src"
    shutil.copytree(SRC / "prefixserve", other / "prefixserve", ignore=shutil.ignore_patterns("__pycache__"))
    rows_py = other / "prefixserve" / "bench" / "kernels" / "rows.py"
    text = rows_py.read_text()
    assert "seed: int = 0" in text
    rows_py.write_text(text.replace("seed: int = 0", "seed: int = 1"))
    args = ["bench", "kernels-ab", "--tree", f"base={SRC}", "--tree", f"other={other}", *ROW, "--rounds", "1"]
    assert main(args) == 1
    assert "| NO" in capsys.readouterr().out
    assert main([*args, "--allow-different"]) == 0


@pytest.mark.parametrize("tree", ["nosep", "x=/nonexistent/src", f"={SRC}"])
def test_a_bad_tree_is_refused(tree, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels-ab", "--tree", tree, "--tree", f"b={SRC}", *ROW])
    assert e.value.code == 2 and "expected NAME=PATH" in capsys.readouterr().err


@pytest.mark.parametrize("names", [("a", "a"), ("a", "b", "a")], ids=["one-arm", "a-name-twice"])
def test_one_arm_or_a_name_twice_is_refused(names):
    trees = [x for n in names for x in ("--tree", f"{n}={SRC}")]
    with pytest.raises(SystemExit, match="two or more --tree"):
        main(["bench", "kernels-ab", *trees, *ROW])


def test_an_arm_that_fails_is_named(tmp_path):
    """A tree whose worker cannot build the rows (its `build` raises): the command stops and names the arm."""
    broken = tmp_path / "src"
    shutil.copytree(SRC / "prefixserve", broken / "prefixserve", ignore=shutil.ignore_patterns("__pycache__"))
    rows_py = broken / "prefixserve" / "bench" / "kernels" / "rows.py"
    text = rows_py.read_text()
    assert "def build(w: Workload, device: torch.device, seed: int = 0) -> Row:\n" in text
    rows_py.write_text(text.replace("def build(w: Workload, device: torch.device, seed: int = 0) -> Row:\n",
                                                   "def build(w: Workload, device: torch.device, seed: int = 0) -> Row:\n"
                                                   "    raise RuntimeError('broken tree')\n"))
    with pytest.raises(SystemExit, match="arm 'broken' .* exited 1"):
        main(["bench", "kernels-ab", "--tree", f"base={SRC}", "--tree", f"broken={broken}", *ROW, "--rounds", "1"])
