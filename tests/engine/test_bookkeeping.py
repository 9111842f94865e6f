"""The scheduler owns the sequences' and the tree's bookkeeping: what `on_launched` and
`on_sampled` do to them, O(1) `finish` in any order with admission and preemption order kept,
and `LLMEngine.stats()` agreeing with the engine's state."""

from __future__ import annotations

import random

import torch

from prefixserve import SamplingParams
from prefixserve.config import SchedulerConfig
from prefixserve.engine.request import Request, Sequence, Status
from prefixserve.engine.scheduler import Scheduler
from prefixserve.kvcache.chunk_pool import ChunkPool
from prefixserve.kvcache.prefix_tree import PENDING, PrefixTree

C = 4


def make_scheduler(num_chunks=64, **cfg) -> Scheduler:
    pool = ChunkPool(1, num_chunks, C, 1, 2, torch.float32, torch.device("cpu"))
    return Scheduler(SchedulerConfig(**cfg), PrefixTree(pool, True))


def add(sched: Scheduler, prompt: list[int], max_tokens=8, name=None) -> Sequence:
    req = Request(name or f"r{len(sched.running) + len(sched.waiting)}-{prompt[0]}", None, prompt,
                  SamplingParams(max_tokens=max_tokens))
    seq = Sequence(len(req.request_id), req, 0, None)
    req.seqs.append(seq)
    sched.add(seq)
    return seq


def test_on_launched_marks_computed_and_leaves_pending_tokens():
    sched = make_scheduler(max_num_batched_tokens=6)
    seq = add(sched, list(range(10)))
    out = sched.schedule()
    assert [(g.start, g.num_tokens, g.sample) for g in out.seqs] == [(0, 6, False)]
    sched.on_launched(out)
    assert sched.tree.frontier(seq.leaf)[0] == 6 and seq.output_token_ids == []
    assert sched.computed_prompt_tokens == 6
    out = sched.schedule()
    assert [(g.start, g.num_tokens, g.sample) for g in out.seqs] == [(6, 4, True)]
    sched.on_launched(out)
    assert sched.prompt_computed(seq) and sched.computed_prompt_tokens == 10
    assert seq.output_token_ids == [PENDING] and seq.pending == 1


def add_samples(sched: Scheduler, prompt: list[int], n: int, name: str) -> list[Sequence]:
    req = Request(name, None, prompt, SamplingParams(max_tokens=8, n=n))
    req.seqs = [Sequence(i, req, i, None) for i in range(n)]
    for seq in req.seqs:
        sched.add(seq)
    return req.seqs


def grants(out):
    return [(g.seq.index, g.start, g.num_tokens, g.sample) for g in out.seqs]


def test_samples_of_one_prompt_compute_it_once_and_fork_from_its_last_token():
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b, c = add_samples(sched, list(range(10)), 3, "r")
    out = sched.schedule()
    assert grants(out) == [(0, 0, 6, False)] and out.forks == []  # the followers are never granted
    assert a.leaf is b.leaf is c.leaf
    sched.on_launched(out)
    sched.check_integrity(())
    out = sched.schedule()
    assert grants(out) == [(0, 6, 4, True)] and out.forks == [(b, a), (c, a)]
    sched.on_launched(out)
    assert sched.computed_prompt_tokens == 10 and all(s.output_token_ids == [PENDING] for s in (a, b, c))
    sched.on_sampled([a, b, c], [7, 8, 7], lambda *_: None)
    out = sched.schedule()  # each sample decodes its own token below the whole shared prompt
    assert sorted(grants(out)) == [(0, 10, 1, True), (1, 10, 1, True), (2, 10, 1, True)] and out.forks == []
    assert {len(sched.tree.path(s.leaf)) for s in (a, b, c)} == {2}
    sched.check_integrity(())


def test_a_leader_leaving_before_it_samples_hands_its_followers_on():
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b, c = add_samples(sched, list(range(10)), 3, "r")
    sched.on_launched(sched.schedule())
    sched.finish(a, "abort")
    sched.check_integrity(())
    out = sched.schedule()  # b takes over the path a half computed; c follows b
    assert grants(out) == [(1, 6, 4, True)] and out.forks == [(c, b)]
    sched.on_launched(out)
    assert sched.computed_prompt_tokens == 10
    sched.check_integrity(())


def test_a_preempted_follower_follows_again_or_computes_its_own_last_token():
    sched = make_scheduler()
    a, b, c = add_samples(sched, list(range(10)), 3, "r")
    sched.schedule()
    assert sched._preempt_last() is c and list(sched.waiting) == [c]
    sched.check_integrity(())
    out = sched.schedule()  # c is admitted again behind its leader
    assert grants(out) == [(0, 0, 10, True)] and out.forks == [(b, a), (c, a)]
    sched.on_launched(out)
    sched.on_sampled([a, b, c], [7, 8, 9], lambda *_: None)
    assert sched._preempt_last() is c
    out = sched.schedule()  # its leader has sampled: c recomputes its last token itself
    assert (2, 10, 1, True) in grants(out) and out.forks == []
    sched.check_integrity(())


def test_samples_do_not_fork_with_prefix_caching_off():
    pool = ChunkPool(1, 64, C, 1, 2, torch.float32, torch.device("cpu"))
    sched = Scheduler(SchedulerConfig(), PrefixTree(pool, False))
    add_samples(sched, list(range(10)), 2, "r")
    out = sched.schedule()
    assert grants(out) == [(0, 0, 10, True), (1, 0, 10, True)] and out.forks == []


def test_on_sampled_resolves_in_sequence_and_tree_and_finishes_on_stop():
    sched = make_scheduler()
    a, b = add(sched, [1, 2, 3], name="a"), add(sched, [5, 6, 7], name="b")
    first = sched.schedule()
    sched.on_launched(first)
    second = sched.schedule()  # overlapped: the PENDING tokens go into the tree
    sched.on_launched(second)
    assert a.leaf.tokens[-1] == PENDING and a.pending == 2
    calls = []

    def stop(seq, row, token):
        calls.append((seq.request.request_id, row, token))
        return "stop" if seq is b else None

    touched = sched.on_sampled([s.seq for s in first.seqs], [40, 50], stop)
    assert calls == [("a", 0, 40), ("b", 1, 50)] and set(touched) == {"a", "b"}
    assert a.output_token_ids == [40, PENDING] and a.leaf.tokens[-1] == 40  # the 2nd is not in the tree yet
    assert b.finished and b.finish_reason == "stop" and b.output_token_ids == [50] and b.leaf is None
    calls.clear()
    touched = sched.on_sampled([s.seq for s in second.seqs], [41, 51], stop)  # b's token is dropped
    assert calls == [("a", 0, 41)] and set(touched) == {"a"} and a.output_token_ids == [40, 41]
    assert list(sched.running) == [a]
    sched.tree.check_integrity()


def test_finish_in_any_order_keeps_admission_order():
    sched = make_scheduler(num_chunks=512, max_num_seqs=1000, max_num_batched_tokens=100_000)
    seqs = [add(sched, [i, i + 1, i + 2], name=f"s{i}") for i in range(300)]
    sched.schedule()
    assert list(sched.running) == seqs
    waiting = [add(sched, [7, i], name=f"w{i}") for i in range(50)]
    order = seqs + waiting
    random.Random(0).shuffle(order)
    for k, seq in enumerate(order):
        sched.finish(seq, "abort")
        assert seq.status is Status.FINISHED and seq.leaf is None
        if k % 37 == 0:
            left = set(order[k + 1:])
            assert list(sched.running) == [s for s in seqs if s in left]
            assert list(sched.waiting) == [s for s in waiting if s in left]
            sched.check_integrity(())
    assert not sched.has_work() and sched.tree.chunk_counts()["in_use"] == 0


def test_preemption_takes_the_last_admitted_and_puts_it_first_in_line():
    sched = make_scheduler(num_chunks=7, max_num_batched_tokens=64)
    seqs = [add(sched, [10 * i + j for j in range(C)], max_tokens=20, name=f"s{i}") for i in range(3)]
    late = add(sched, [99] * C, name="late")
    sched.on_launched(sched.schedule())  # all four admitted, a chunk each: growing needs more than 7
    admitted = list(sched.running)
    preempted = []
    for _ in range(12):
        out = sched.schedule()
        preempted += out.preempted
        sched.on_launched(out)
        sched.on_sampled([g.seq for g in out.seqs if g.sample], [1] * len(out.seqs), lambda *_: None)
        sched.check_integrity(())
    assert preempted and sched.num_preemptions == len(preempted)
    assert preempted[0] is admitted[-1]  # the most recently admitted goes first
    assert all(s.status is Status.WAITING for s in sched.waiting)
    assert late in sched.live() and all(s in sched.live() for s in seqs)


def test_stats_match_the_engine(make_llm):
    llm = make_llm(max_num_seqs=2)
    engine = llm.engine
    before = engine.stats()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 4, 3]]
    for i, p in enumerate(prompts):
        engine.add_request(f"stats-{i}", p, SamplingParams(max_tokens=5, n=2 if i == 0 else 1, ignore_eos=True))
    s = engine.stats()
    assert (s.running_requests, s.waiting_requests) == (0, 3)
    engine.step()
    s = engine.stats()
    assert (s.running_requests, s.waiting_requests) == (1, 2)  # request 0's two samples fill max_num_seqs
    assert s.kv == engine.kv_cache_stats() and s.kv.logical_tokens == sum(q.num_tokens for q in engine.requests["stats-0"].seqs)
    assert s.schedule == (engine.backend.chosen or engine.backend_name) and s.preemptions == before.preemptions
    assert s.kv.prompt_tokens - before.kv.prompt_tokens == 2 * len(prompts[0])
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert (s.running_requests, s.waiting_requests) == (0, 0) and s.kv.in_use_tokens == 0
    assert s.kv.prompt_tokens - before.kv.prompt_tokens == sum(map(len, prompts)) + len(prompts[0])
