"""`prefixserve bench throughput` end to end at tiny scale on the embedded model: valid JSON
with every requested config (and sweep point), identical greedy outputs, a PNG."""

from __future__ import annotations

import json
import shlex

import pytest

from prefixserve.bench import results as R
from prefixserve.bench import throughput as T
from prefixserve.bench import workloads as W
from prefixserve.cli import build_parser, main

TINY = ("--kv-cache-memory", str(64 << 20), "--threads", "1", "--no-progress")


def _run(tmp_path, *argv) -> dict:
    assert main(["bench", "throughput", "--out-dir", str(tmp_path), *TINY, *argv]) == 0
    (path,) = tmp_path.glob("throughput-*-SmolLM2-135M-Instruct-*.json")
    assert path.with_suffix(".png").stat().st_size > 10_000
    return json.loads(path.read_text())


def test_sharegpt_all_configs_identical_greedy_outputs(tmp_path):
    doc = _run(tmp_path, "--workload", "sharegpt", "--system-prompt-len", "48", "--num-prompts", "3",
               "--max-output-len", "6", "--max-prompt-len", "48")
    assert doc["workload"] == "sharegpt" and doc["model"] == "SmolLM2-135M-Instruct"
    assert doc["system_prompt_len"] == 48 and doc["hardware"]["device"] in ("cpu", "cuda")
    assert [e["config"] for e in doc["results"]] == list(R.CONFIGS)
    by = {e["config"]: e for e in doc["results"]}
    for name, e in by.items():
        assert e["output_tokens"] == by["paged-nocache"]["output_tokens"] > 0
        assert e["output_tokens_per_s"] > 0 and e["requests_per_s"] > 0 and e["requests"] == 3
        assert e["vs_paged_nocache"] > 0 and e["vs_no_attention"] > 0 and e["cpu_time_vs_paged_nocache"] > 0
        assert 0 < e["prefill_s"] + e["decode_s"] <= e["elapsed_s"] + 0.01 and e["process_cpu_s"] > 0
        # the reference, and the configs whose outputs are not the 16-bit model's: not compared
        assert e["identical_outputs"] is (None if name in ("paged-nocache", *R.INEXACT) else True), name
        assert e["preemptions"] == 0
    fp8, auto = by["auto-fp8"], by["auto"]
    assert fp8["fp8_vs_default"] == pytest.approx(fp8["output_tokens_per_s"] / auto["output_tokens_per_s"], rel=1e-3)
    assert by["auto-det"]["det_vs_default"] > 0 and "fp8_vs_default" not in by["auto"]
    nocache, cached = by["paged-nocache"], by["auto"]
    assert nocache["prompt_tokens_computed"] == nocache["prompt_tokens"]
    # the 48-token system prompt (and the "User:" line after it) is computed once, not 3 times
    assert cached["prompt_tokens_computed"] <= nocache["prompt_tokens"] - 2 * 48
    assert cached["peak_kv_tokens_physical"] < nocache["peak_kv_tokens_physical"]
    assert cached["peak_kv_tokens_logical"] >= nocache["peak_kv_tokens_physical"] - 3 * 16


def test_multi_sample_sweep_is_hydragen_fig3(tmp_path):
    doc = _run(tmp_path, "--workload", "multi-sample", "--configs", "paged,hydragen", "--batch", "2,4",
               "--prefix-len", "32,48", "--gen-len", "3")
    points = [(e["config"], e["batch"], e["prefix_len"]) for e in doc["results"]]
    assert points == [(c, b, p) for b, p in ((2, 32), (4, 32), (4, 48)) for c in ("paged", "hydragen")]
    assert doc["sweep"] == [{"x": "batch", "fixed": {"prefix_len": 32}}, {"x": "prefix_len", "fixed": {"batch": 4}}]
    for e in doc["results"]:
        assert e["sequences"] == e["batch"] and e["output_tokens"] == 3 * e["batch"]
        # the prompt is computed once, its last token too: the other samples fork from it
        assert e["prompt_tokens_computed"] == e["prefix_len"]
        assert e["identical_outputs"] is None  # sampled, not greedy: not compared
        assert e["vs_paged_nocache"] is None  # paged-nocache not run


def test_rounds_rotate_the_order_and_keep_each_configs_fastest_run(tmp_path, monkeypatch):
    """A run's elapsed time varies with the host (on an H200 the no-attention ceiling's by 20%
    between two rounds, more than the 2% within which auto must stay of the best backend): with
    --rounds every config runs once a round, each round starting at the next config, and keeps
    its least elapsed time."""
    order, run_config = [], T.run_config
    monkeypatch.setattr(T, "run_config", lambda name, *a: order.append(name) or run_config(name, *a))
    doc = _run(tmp_path, "--workload", "multi-sample", "--configs", "paged,hydragen,relay", "--batch", "2",
               "--prefix-len", "32", "--gen-len", "2", "--rounds", "4")
    assert order == ["paged", "hydragen", "relay", "hydragen", "relay", "paged", "relay", "paged", "hydragen",
                     "paged", "hydragen", "relay"]
    assert [e["config"] for e in doc["results"]] == ["paged", "hydragen", "relay"]
    for e in doc["results"]:
        assert len(e["round_elapsed_s"]) == 4 and e["elapsed_s"] == min(e["round_elapsed_s"])
        assert e["output_tokens"] == 2 * 2
    assert "--rounds 4" in doc["command"]


@pytest.mark.parametrize("workload, flags, unique_prompt", [
    ("hierarchical", ("--fewshot-len", "40", "--problems", "2", "--problem-len", "8", "--samples", "3"), 40 + 2 * 8),
    ("long-doc", ("--doc-len", "60", "--questions", "3", "--question-len", "5"), 60 + 3 * 5),
])
def test_shared_prefixes_computed_once(workload, flags, unique_prompt):
    args = build_parser().parse_args(["bench", "throughput", "--workload", workload, *flags, "--gen-len", "2"])
    src = W.token_source({})
    wl = T._build(args, src, T._points(args)[0])
    kw = {"kv_cache_memory": 64 << 20}
    entries = T.compare_configs(["paged-nocache", "auto"], kw, wl, {}, progress=False)
    nocache, auto = entries
    assert auto["prompt_tokens_computed"] == unique_prompt  # samples fork from one last prompt token
    assert nocache["prompt_tokens_computed"] == wl.prompt_tokens
    if wl.greedy:
        assert auto["identical_outputs"] is True


def test_warmup_runs_the_whole_workload_shifted():
    """Row counts and tail lengths pick kernels (1,024 samples of a 16K prompt take the
    chunk-pair products, and 64-key tiles again past ~115 keys of their own): the warm-up runs
    every request with all its samples and tokens, on ids that share no prefix with the real
    prompts, so that the first config compiles nothing while timed."""
    from prefixserve import LLM
    wl = W.hierarchical(W.token_source({}), 16, 3, 4, 5, 2)  # 3 prompts x 5 samples, 2 tokens
    llm = LLM(kv_cache_memory=64 << 20)
    seen, generate = [], llm.generate
    llm.generate = lambda prompts, params, **kw: seen.append((prompts, params)) or generate(prompts, params, **kw)
    try:
        T._warmup(llm, wl)
    finally:
        llm.close()
    ((prompts, params),) = seen
    assert params == wl.params and [len(p) for p in prompts] == [len(p) for p in wl.prompts]
    assert all(a[0] != b[0] for a, b in zip(prompts, wl.prompts, strict=True))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_steps_time_is_charged_to_the_batch_it_waited_for(monkeypatch, asynchronous):
    """With overlapped scheduling on CUDA a step launches its batch and waits for the one before
    (`Engine.waits_for_previous`): the first decode step's wall time there is the prefill's GPU
    time (a 16K prompt's: 0.73 s of relay's 7.75 s of "decode" on an H200), so it counts as
    prefill. On the CPU a launch computes before it returns, and each step is its own batch's:
    the real engine says so; the asynchronous case is the CUDA engine's answer given to it."""
    from prefixserve import LLM
    wl = W.hierarchical(W.token_source({}), 16, 3, 4, 5, 2)  # 3 prompts x 5 samples, 2 tokens
    llm = LLM(kv_cache_memory=64 << 20)
    try:
        assert llm.engine.waits_for_previous is False  # a CPU engine
        own, _ = T._timed_run(llm.engine, wl, False, "own")
    finally:
        llm.close()
    monkeypatch.setattr(type(llm.engine), "waits_for_previous", property(lambda self: asynchronous))
    llm = LLM(kv_cache_memory=64 << 20)
    try:
        charged, _ = T._timed_run(llm.engine, wl, False, "charged")
    finally:
        llm.close()
    assert own["prefill_steps"] >= 1 and charged["steps"] == own["steps"]
    # the prefill batches come first: the step after the last of them waits for it
    assert charged["prefill_steps"] == own["prefill_steps"] + asynchronous
    assert charged["output_tokens"] == own["output_tokens"] == 3 * 5 * 2


def test_a_host_bound_ceiling_is_flagged_and_gpu_steps_compared(caplog):
    """Where the host bounds the no-attention ceiling's steps its tokens/s understate the GPU's,
    so `vs_no_attention` reads high: the run says so, and `device_vs_no_attention` compares the
    median GPU steps (the step profiles of one H200 run of 1,024 x 16K, Llama-2-7B dims)."""
    def entry(config, tok_s, device_ms, host_busy_ms):
        return {"config": config, "output_tokens_per_s": tok_s, "output_tokens_per_cpu_s": tok_s,
                "decode_tokens_per_s": tok_s, "decode_profile": {"device_ms": device_ms, "host_busy_ms": host_busy_ms}}
    entries = [entry("relay", 15640.5, 54.077, 23.087), entry("no-attention", 25235.4, 25.998, 33.322)]
    with caplog.at_level("WARNING", logger=T.log.name):
        T._add_comparisons(entries, {}, greedy=False)
    relay, ceiling = entries
    assert relay["vs_no_attention"] == 0.6198 and relay["device_vs_no_attention"] == 0.4808
    assert ceiling["device_vs_no_attention"] == 1.0
    assert "host-bound (host 33.3 ms a decode step, GPU 26.0)" in caplog.text
    caplog.clear()
    entries = [entry("relay", 15640.5, 54.077, 23.087), entry("no-attention", 32195.4, 26.298, 17.052)]
    T._add_comparisons(entries, {}, greedy=False)
    assert entries[0]["device_vs_no_attention"] == 0.4863 and "host-bound" not in caplog.text


def test_command_reproduces_the_arguments():
    argv = ["bench", "throughput", "--workload", "multi-sample", "--batch", "8,16", "--no-warmup",
            "--no-enable-prefix-caching", "--chunk-size", "32"]
    args = build_parser().parse_args(argv)
    cmd = R.command_line(args._parser, args, "prefixserve bench throughput")
    again = build_parser().parse_args(["bench", "throughput", *shlex.split(cmd)[3:]])
    assert {k: v for k, v in vars(again).items() if k != "_parser"} == {k: v for k, v in vars(args).items() if k != "_parser"}


def test_results_are_named_by_model_and_hardware(tmp_path):
    (tmp_path / "llama-2-7b.json").write_text("{}")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    dummy = {"load_format": "dummy"}
    assert R.model_name({"model": str(tmp_path / "llama-2-7b.json"), **dummy}) == "llama-2-7b"
    assert R.model_name({"model": str(tmp_path / "tiny" / "config.json"), **dummy}) == "tiny"
    assert R.model_name({"model": str(tmp_path / "tiny"), **dummy}) == "tiny"
    assert R.model_name({}) == "SmolLM2-135M-Instruct"
    gpu = {"device": "cuda", "name": "NVIDIA H200", "count": 2}
    path = R.result_path(tmp_path, "throughput", "sharegpt", "llama-2-7b", gpu)
    assert path.name == "throughput-sharegpt-llama-2-7b-h200-x2.json"
    assert R.result_path(tmp_path, "serve", "sharegpt", "m", {"device": "cpu"}).name == "serve-sharegpt-m-cpu.json"


def test_multi_tenant_is_a_serving_workload_only(capsys):
    """Offline throughput has no tenants to send: the choice is refused up front, not a KeyError later."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--workload", "multi-tenant"])
    assert e.value.code == 2 and "invalid choice: 'multi-tenant'" in capsys.readouterr().err
