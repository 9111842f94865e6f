"""Tensor parallelism on CPU with gloo: the embedded model (9 query heads, 3 KV heads) over 3
processes gives the same greedy tokens as one process, also launched from standard input; bad
sizes fail clearly; a worker that dies (before the rendezvous, or mid-step) or is late ends the
engine with an error naming it, within seconds; no orphans."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.engine.workers import WorkerError, Workers


def test_tp3_matches_tp1_on_a_shared_prefix_batch(make_llm, sharegpt_questions, tokenizer):
    system = tokenizer.encode(sharegpt_questions[10])[:80]
    prompts = [system + tokenizer.encode(q)[:40] for q in sharegpt_questions[11:14]]
    params = SamplingParams(temperature=0, n=2, max_tokens=16, ignore_eos=True)
    expected = [[c.token_ids for c in o.outputs] for o in make_llm().generate(prompts, params)]
    llm = LLM(tensor_parallel_size=3, device="cpu", kv_cache_memory=64 << 20)
    procs = list(llm.engine.workers.procs)
    try:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        llm.check_integrity()
    finally:
        llm.engine.close()
    assert got == expected
    assert all(p.poll() is not None for p in procs), "workers outlived the engine"


def test_tp_launched_from_standard_input(make_llm):
    """spawn-based workers re-import __main__, which cannot be read back from stdin: this hung."""
    script = ("from prefixserve import LLM, SamplingParams\n"
              "llm = LLM(tensor_parallel_size=3, device='cpu', kv_cache_memory=16 << 20)\n"
              "p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
              "print(llm.generate([[1, 2, 3, 4, 5]], p, use_tqdm=False)[0].outputs[0].token_ids)\n"
              "llm.close()\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert out.stdout.strip() == str(make_llm().generate([[1, 2, 3, 4, 5]], p, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_worker_dead_before_the_rendezvous_fails_the_start_at_once(monkeypatch):
    started, start = [], Workers._start

    def start_then_oom_kill(self, args):  # as the OOM killer would, before the worker joins
        start(self, args)
        started.append(self.procs[-1])
        if args.rank == 2:
            self.procs[-1].send_signal(signal.SIGKILL)
    monkeypatch.setattr(Workers, "_start", start_then_oom_kill)
    t = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 2 \(pid \d+\) was killed by SIGKILL"):
        LLM(tensor_parallel_size=3, device="cpu", kv_cache_memory=16 << 20)
    assert time.monotonic() - t < 60
    assert all(p.poll() is not None for p in started), "orphaned workers"


def test_a_worker_late_for_the_rendezvous_times_out():
    with pytest.raises(WorkerError, match=r"ranks \[1, 2\] did not join within 0.001 s \(tp_join_timeout\)"):
        Workers(_cfg(tp_join_timeout=0.001))


def test_a_worker_that_dies_mid_run_ends_the_engine_naming_it():
    llm = LLM(tensor_parallel_size=3, device="cpu", kv_cache_memory=16 << 20)
    procs = list(llm.engine.workers.procs)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    procs[0].send_signal(signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL") as failure:
        llm.generate([[4, 5, 6]], params, use_tqdm=False)
    assert all(p.poll() is not None for p in procs), "orphaned workers"
    # the stderr tail in the error is the worker's own: `python -m` starting it warned here once
    assert "Warning" not in str(failure.value), failure.value


def _cfg(**kwargs):
    from prefixserve.config import EngineConfig
    return EngineConfig.from_kwargs(tensor_parallel_size=3, device="cpu", **kwargs)


def test_tp_size_that_does_not_divide_the_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide num_heads \(9\)"):
        LLM(tensor_parallel_size=2, device="cpu")


def test_workers_die_when_the_engine_process_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    script = ("import os, signal\nfrom prefixserve import LLM\n"
              "llm = LLM(tensor_parallel_size=3, device='cpu', kv_cache_memory=16 << 20)\n"
              "print(' '.join(str(p.pid) for p in llm.engine.workers.procs), flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"orphaned workers {alive}"


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped
        return f.read().split()[2] != "Z"
