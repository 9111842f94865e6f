"""`prefixserve bench kernels` on a CPU: the command's whole path on a tiny two-level row (JSON,
table, PNG; every backend and peer right), the bars against both peer sets, and the page tables
handed to FlashInfer, checked by attending through them in PyTorch (FlashInfer needs a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from prefixserve.attention import create_backend
from prefixserve.bench.kernels.flashinfer import cascade_tables, decode_tables, nodes_by_depth
from prefixserve.bench.kernels.peers import ALL_PEERS, PEERS
from prefixserve.bench.kernels.report import BACKENDS, finish_row, summarize
from prefixserve.bench.kernels.rows import Workload, build
from prefixserve.cli import main

ROW = ("--batch", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--context", "96",
       "--shared", "64,16", "--chunk-size", "16", "--dtype", "float32", "--device", "cpu")


@pytest.fixture
def one_thread():
    """Two busy cores: torch's own threads would only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_cpu_row_json_table_png(tmp_path, capsys, one_thread):
    assert main(["bench", "kernels", *ROW, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "kernels-cpu.json").read_text())
    assert doc["git"]["commit"] and "--batch 4" in doc["command"] and doc["hardware"]["device"] == "cpu"
    assert (tmp_path / "kernels-cpu.png").stat().st_size > 10_000
    (r,) = doc["rows"]
    assert (r["grid"], r["label"], r["shared"]) == ("custom", "b4 ctx96 sh64+16", [64, 16])
    # keys read: 64 (all) + 4 x 16 (groups) + 4 x 17 (own + decoded); K+V of a key: 2 x 2 x 16 x 4 B
    assert r["bytes"] == (64 + 64 + 68) * 256 + 2 * 4 * 4 * 16 * 4
    assert r["flops"] == 4 * 16 * 4 * 4 * 97
    ceil = doc["ceilings"]
    assert r["limit_us"] == pytest.approx(1e6 * max(r["bytes"] / ceil["copy_bandwidth"],
                                                    r["flops"] / ceil["matrix_rate"]))
    for name in BACKENDS:
        b = r["backends"][name]
        assert b["us"] > 0 and b["ratio_to_limit"] == pytest.approx(b["us"] / r["limit_us"])
        assert b["max_err_vs_paged"] < 1e-5 and b["timing"].startswith("cpu")
    assert r["ratio_to_limit"] == pytest.approx(r["best_us"] / r["limit_us"])
    assert r["backends"]["auto"]["chose"] in BACKENDS

    peers = r["peers"]
    assert set(peers) == set(ALL_PEERS)
    for name, p in peers.items():
        assert ("us" in p) != ("error" in p), name
        if "us" in p:
            assert p["max_err_vs_paged"] < 1e-5 and p["counted"] and p["us"] > 0, name
        else:
            assert p["error"], name
    assert peers["sdpa"]["sdpa_backend"] == "FLASH_ATTENTION" and not peers["sdpa"]["scaled"]
    assert peers["hydragen-pub"]["op"] == "flash" and "us" in peers["hydragen-pub"]
    assert peers["hydragen-cudnn"]["op"] == "cudnn" and "CUDA only" in peers["hydragen-cudnn"]["error"]
    assert "CUDA only" in peers["flashinfer-decode"]["error"]
    assert r["best_peer"] in PEERS and r["best_peer_incl_cudnn"] in ALL_PEERS
    assert r["speedup_vs_best_peer"] == pytest.approx(r["best_peer_us"] / r["best_us"])

    s = doc["summary"]
    for key in ("table3_geomean_ratio_to_limit", "table3_rows_worse_than_best_peer",
                "hydragen_geomean_ratio_to_limit", "hydragen_min_speedup_vs_best_peer",
                "table3_rows_worse_than_best_peer_incl_cudnn",
                "hydragen_min_speedup_vs_best_peer_incl_cudnn"):
        assert s[key] is None, key  # no Table 3 or Hydragen row was run
    assert s["bars"]["hydragen_2x_vs_best_peer"] is None and s["bars"]["auto_within_5pct"] is not None
    assert s["grids"]["custom"]["geomean_ratio_to_limit"] == pytest.approx(r["ratio_to_limit"])
    out = capsys.readouterr().out
    assert all(col in out for col in ("sdpa", "hyd-pub", "hyd-cdnn", "fi-dec", "fi-casc", "vs all"))


def test_fp8_twin_rows(tmp_path, one_thread):
    """--kv-cache-dtype both: each row, then its fp8 twin (grid custom-fp8) over an e4m3 cache,
    whose backends agree with each other, whose 16-bit peers say why they did not run, and
    whose time is paired with its twin's; the run records the one-kernel graph floor."""
    assert main(["bench", "kernels", *ROW, "--kv-cache-dtype", "both", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "kernels-cpu.json").read_text())
    wide, fp8 = doc["rows"]
    assert (fp8["grid"], fp8["label"], fp8["kv_dtype"]) == ("custom-fp8", wide["label"] + " fp8", "fp8")
    assert fp8["bytes"] == (64 + 64 + 68) * 2 * 2 * 16 * 1 + 2 * 4 * 4 * 16 * 4  # K/V one byte, q/o fp32
    for name in BACKENDS:
        assert fp8["backends"][name]["max_err_vs_paged"] < 1e-5, name
    assert "16-bit" in fp8["peers"]["sdpa"]["error"] and "CUDA only" in fp8["peers"]["flashinfer-decode"]["error"]
    assert fp8["fp8_over_16bit"] == pytest.approx(fp8["best_us"] / wide["best_us"])
    assert doc["summary"]["fp8_over_16bit"] == {fp8["label"]: fp8["fp8_over_16bit"]}
    assert doc["ceilings"]["graph_launch_us"] > 0


def _row(label, best_us, peers):
    res = {"grid": "hydragen", "label": label, "limit_us": 10.0,
           "backends": {"paged": {"us": 2 * best_us}, "hydragen": {"us": best_us},
                        "auto": {"us": best_us}},
           "peers": {k: {"us": us, "counted": ok} for k, (us, ok) in peers.items()}}
    finish_row(res)
    return res


def test_bars_against_the_issues_peers_and_against_all():
    rows = [_row("a", 10.0, {"hydragen-pub": (30.0, True), "hydragen-cudnn": (15.0, True),
                             "sdpa": (5.0, False)}),  # wrong output: never compared
            _row("b", 10.0, {"hydragen-pub": (25.0, True), "flashinfer-cascade": (40.0, True)})]
    assert rows[0]["best_peer"] == "hydragen-pub" and rows[0]["best_peer_incl_cudnn"] == "hydragen-cudnn"
    s = summarize(rows)
    assert s["hydragen_min_speedup_vs_best_peer"] == pytest.approx(2.5)
    assert s["hydragen_min_speedup_vs_best_peer_incl_cudnn"] == pytest.approx(1.5)
    assert s["hydragen_geomean_ratio_to_limit"] == pytest.approx(1.0)
    assert s["bars"]["hydragen_2x_vs_best_peer"] is True
    assert s["bars"]["hydragen_2x_vs_best_peer_incl_cudnn"] is False
    assert s["bars"]["hydragen_within_1.4x"] is True and s["bars"]["table3_limit30_within_1.10x"] is None


def _attend(q, k_cache, v_cache, qo, indptr, indices, last, scale):
    """FlashInfer's paged semantics in PyTorch: request r's queries qo[r]:qo[r+1] attend to the
    keys of pages indices[indptr[r]:indptr[r+1]], all full but the last (last[r] keys)."""
    c, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    o, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    for r in range(len(last)):
        pages = indices[indptr[r]:indptr[r + 1]].long()
        n = (len(pages) - 1) * c + int(last[r])
        k, v = (x[pages].flatten(0, 1)[:n].repeat_interleave(hq // hkv, 1) for x in (k_cache, v_cache))
        s = torch.einsum("qhd,khd->hqk", q[qo[r]:qo[r + 1]], k) * scale
        lse[qo[r]:qo[r + 1]] = torch.logsumexp(s, -1).T
        o[qo[r]:qo[r + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return o, lse


@pytest.mark.parametrize("shared, decode_ok", [((64, 16), True), ((40,), False)])
def test_flashinfer_page_tables_attend_like_paged(shared, decode_ok):
    """The decode page table (whole paths) and the cascade levels (one per tree depth, merged by
    LSE) give the paged backend's output; a shared level ending inside a chunk has no decode
    page table (FlashInfer's pages are full but the last) while the cascade still works."""
    w = Workload("custom", 8, 4, 2, 16, 96, shared, 16, "float32", groups=2)
    row = build(w, torch.device("cpu"))
    be = create_backend("paged", row.shape)
    be.plan(row.batch)
    ref = be.run(row.q, row.k, row.v, row.k_cache, row.v_cache)  # writes the decoded K/V too
    args = (row.k_cache, row.v_cache)
    if decode_ok:
        o, _ = _attend(row.q, *args, range(w.batch + 1), *decode_tables(row.batch, "cpu"), row.shape.scale)
        assert torch.allclose(o, ref, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="inside a 16-key page"):
            decode_tables(row.batch, "cpu")
    assert [len(lv) for lv in nodes_by_depth(row.batch)] == [w.nodes(i) for i in range(len(shared))] + [w.batch]
    parts = [_attend(row.q, *args, *level, row.shape.scale) for level in cascade_tables(row.batch, "cpu")]
    wts = torch.softmax(torch.stack([lse for _, lse in parts]), 0)[..., None]  # the LSE merge
    assert torch.allclose((torch.stack([o for o, _ in parts]) * wts).sum(0), ref, atol=1e-5)
