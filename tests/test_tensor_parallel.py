"""Tensor parallelism on CPU with gloo: the embedded model (9 query heads, 3 KV heads) over 3
processes gives the same greedy tokens as one process; bad sizes fail clearly; no orphans."""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams


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
    assert not any(p.is_alive() for p in procs), "workers outlived the engine"


def test_tp_size_that_does_not_divide_the_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide num_heads \(9\)"):
        LLM(tensor_parallel_size=2, device="cpu")


def test_workers_die_when_the_engine_process_is_killed(tmp_path):
    import os
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
