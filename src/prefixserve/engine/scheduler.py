"""Continuous batching by tokens, not phases.

Each step grants every running sequence the tokens between its computed frontier and its end,
under a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Prefill,
chunked prefill, prefix-cache hits and decode all fall out of that one rule:

    path tokens:  [ computed (own or shared) | granted this step | later ]
                  0                     frontier             frontier+n   num_tokens

A prefix found in the tree is computed already (a hit) or is being computed by the sequence
that inserted it (in-batch sharing): the node at a sequence's frontier is *claimed* by the
first sequence granted tokens in it this step, and any other sequence whose frontier lies in
a claimed node waits one step, then finds those tokens computed. A sequence samples when its
grant reaches its last token. When a decode step finds no chunk, the most recently admitted
sequence is preempted (its path released; it is recomputed, from the cache where it survives).

Chunked prefill that lets others through. A sequence's *demand* is the tokens between its
frontier and its end (1 for a decode). Grants go in increasing demand, so decodes come first
and a long prompt last; every sequence but the last granted is held to half the budget
(`_half`), the last takes what is left. So a long prompt is prefilled over several steps of
at most `max_num_batched_tokens` tokens while the others keep decoding, and two prompts
prefilling together share the step. Admission counts each sequence's demand at most at half
the budget: a request that arrives while a long prompt prefills is admitted at once and is
granted beside it, instead of waiting for the whole prompt.

Overlapped scheduling (engine.py) schedules a step while the previous one still runs: a
sequence's last token may then be PENDING (sampled, not read). It is put in the tree and
granted like any other token (its value reaches the model on the device); a sequence whose
pending tokens already make `max_tokens` is granted nothing.

Samples of one prompt fork (vLLM V0's fork). A sequence is admitted one token short of a full
match, so that its last prompt token is computed and gives the logits of its first sample.
With prefix caching on, the samples (`n > 1`) of a request do that once: the first admitted
with no output is the request's *leader*; a sibling admitted while the leader has not yet
sampled *follows* it: it holds the leader's path (the whole prompt, last token included) and
is never granted; the step that samples the leader lists each follower in `forks`, and the
follower draws its first token from the leader's logits row. So the samples share every
prompt token, not all but the last one. A leader that leaves before sampling (preempted,
aborted) hands its followers to the first of them. Followers are admitted after their leader,
so preemption (last admitted first) takes them before it.

The scheduler owns the sequences' and the tree's bookkeeping (vLLM's `update_from_output`):
what a launched step computed (`on_launched`), the tokens a step sampled (`on_sampled`), and
pinning. The engine reaches the tree only through it; the model runner only reads paths
(`PrefixTree.segments`, `slot`).
`running` and `waiting` are insertion-ordered (a dict, an OrderedDict): `finish` is O(1).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from ..config import SchedulerConfig
from ..kvcache.chunk_pool import OutOfChunks
from ..kvcache.prefix_tree import PENDING, Node, PrefixTree
from .request import Request, Sequence, Status


class ScheduledSeq(NamedTuple):  # a tuple: built for every running sequence, every step
    seq: Sequence
    start: int  # first position computed this step (the frontier)
    num_tokens: int
    sample: bool  # the grant reaches the sequence's last token


@dataclasses.dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]  # depth-first tree order
    preempted: list[Sequence]
    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (follower, its leader)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclasses.dataclass
class Fork:
    """The samples of one request that share its prompt's last token (module docstring)."""

    leader: Sequence  # computes the prompt; its sampling step gives the followers' logits
    followers: list[Sequence]  # running, never granted, in admission order


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, tree: PrefixTree):
        self.cfg, self.tree = cfg, tree
        self.waiting: collections.OrderedDict[Sequence, None] = collections.OrderedDict()  # head first
        self.running: dict[Sequence, None] = {}  # in admission order (the last is preempted first)
        self.prefix_hit_tokens = self.prompt_tokens = self.num_preemptions = 0
        self.computed_prompt_tokens = 0  # prompt tokens run through the model
        self.pinned_chunks = 0  # tree.pinned_chunks(), recounted when a pin comes or goes
        self.tenant_tokens: dict[str, list[int]] = {}  # tenant -> [prompt tokens, prefix hit tokens]
        self._last_sig: tuple[int, tuple[int, ...]] | None = None  # (tree version, leaves' ids) of the last sorted grant
        self._last_perm: list[int] = []
        self._forks: dict[str, Fork] = {}  # request id -> its leader (not yet sampled) and followers
        self._following: set[Sequence] = set()  # the followers

    def add(self, seq: Sequence) -> None:
        self.waiting[seq] = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        preempted = self._grow_running()
        if not preempted:
            self._admit_waiting()
        budget = self.cfg.max_num_batched_tokens
        claimed: set[int] = set()  # ids of the nodes a grant starts in
        granted: list[ScheduledSeq] = []
        by_demand = sorted((s for s in self.running if s not in self._following),
                           key=self._demand)  # stable: ties keep admission order
        for i, seq in enumerate(by_demand):
            cap = budget if i == len(by_demand) - 1 else min(budget, self._half)
            if budget > 0 and (g := self._grant(seq, cap, claimed)):
                granted.append(g)
                budget -= g.num_tokens
        forks = [(f, g.seq) for g in granted if g.sample and (fork := self._fork_led_by(g.seq))
                 for f in fork.followers]
        return SchedulerOutput(self._in_tree_order(granted), preempted, forks)

    @property
    def _half(self) -> int:
        """The most tokens a sequence that is not the last granted gets in one step."""
        return max(1, self.cfg.max_num_batched_tokens // 2)

    def _demand(self, seq: Sequence) -> int:
        """Tokens from the sequence's computed frontier to its end (1 for a decode); 0 for a
        follower (its leader computes its path)."""
        if seq in self._following:
            return 0
        return seq.num_tokens - self.tree.frontier(seq.held_leaf)[0]

    def _in_tree_order(self, granted: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Depth-first order (by the node ids of each path). The same leaves in an unchanged
        tree (every decode step after the first) sort the same way: the last permutation is
        reused."""
        sig = (self.tree.version, tuple(id(g.seq.leaf) for g in granted))
        if sig != self._last_sig:
            keys = [[n.id for n in self.tree.path(g.seq.held_leaf)] for g in granted]
            self._last_perm = sorted(range(len(granted)), key=keys.__getitem__)
            self._last_sig = sig
        return [granted[i] for i in self._last_perm]

    def _admit_waiting(self) -> None:
        """Admit in arrival order while the step's token budget has room, counting each
        sequence's demand at most at half the budget (a long prefill does not keep others out).
        All admissions come before any grant: an admission may split a node, and claims name
        nodes."""
        if not self.waiting:
            return
        demand = sum(min(self._demand(s), self._half) for s in self.running)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and demand < self.cfg.max_num_batched_tokens:
            seq = next(iter(self.waiting))
            matched = self._admit(seq)
            if matched is None:
                break
            del self.waiting[seq]
            demand += min(seq.num_tokens - matched, self._half)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence (running or waiting) and release its path. O(1) but for the release."""
        seq.drop_pending()
        if seq.status is Status.RUNNING:
            self._unfork(seq)
            del self.running[seq]
            self.tree.release(seq.held_leaf)
            seq.leaf = None
        elif seq.status is Status.WAITING:
            del self.waiting[seq]
        seq.status, seq.finish_reason = Status.FINISHED, reason

    # ---- after the model: what a step computed and sampled ------------------------------------
    def on_launched(self, sched: SchedulerOutput) -> None:
        """`sched` is queued on the device: its K/V counts as computed from now on (later steps
        queue behind it), and each sampled row's token is PENDING until `on_sampled`."""
        for g in sched.seqs:
            seq, upto = g.seq, g.start + g.num_tokens
            self.tree.mark_computed(seq.held_leaf, upto)
            self.computed_prompt_tokens += max(0, min(upto, len(seq.prompt_token_ids)) - g.start)
            if g.sample and not seq.request.prefill_only:
                seq.output_token_ids.append(PENDING)
                seq.pending += 1
                if self._fork_led_by(seq):
                    del self._forks[seq.request.request_id]
        for follower, _ in sched.forks:
            self._following.remove(follower)
            follower.output_token_ids.append(PENDING)
            follower.pending += 1

    def on_sampled(self, rows: list[Sequence], token_ids: list[int],
                   stop: Callable[[Sequence, int, int], str | None]) -> dict[str, Request]:
        """Row i of a launched step (sequence rows[i]) drew token_ids[i]. Row by row: the token
        fills its sequence's oldest PENDING one (in the tree too), then `stop(seq, i, token)`
        (detokenization and stop checks) gives a finish reason or None. A row whose sequence
        finished since the launch is dropped. -> the requests of the rows taken, by id."""
        touched: dict[str, Request] = {}
        for i, seq in enumerate(rows):
            if seq.request.prefill_only or seq.finished:
                continue
            token = token_ids[i]
            pos = seq.resolve_pending(token)
            if seq.leaf is not None and seq.leaf.end > pos:
                self.tree.resolve(seq.leaf, pos, token)
            if reason := stop(seq, i, token):
                self.finish(seq, reason)
            touched[seq.request.request_id] = seq.request
        return touched

    # ---- pins (engine/pins.py) -----------------------------------------------------------------
    def prompt_computed(self, seq: Sequence) -> bool:
        """The running sequence's whole path has its K/V computed."""
        return seq.leaf is not None and self.tree.frontier(seq.leaf)[1] is None

    def chunks_to_pin(self, seq: Sequence) -> int:
        """Chunks that pinning the sequence's path would add to the pinned ones."""
        return sum(len(n.owned_chunks) for n in self.tree.path(seq.held_leaf) if not n.pins)

    def pin(self, seq: Sequence) -> Node:
        """Pin the sequence's (computed) path; -> its leaf, the pin's handle for `unpin`."""
        leaf = seq.held_leaf
        self.tree.pin(leaf)
        self.pinned_chunks = self.tree.pinned_chunks()
        return leaf

    def unpin(self, leaf: Node) -> None:
        self.tree.unpin(leaf)
        self.pinned_chunks = self.tree.pinned_chunks()

    # ---- state ---------------------------------------------------------------------------------
    def live(self) -> Iterator[Sequence]:
        """The running sequences, then the waiting ones."""
        yield from self.running
        yield from self.waiting

    def num_requests(self) -> tuple[int, int]:
        """(requests with a sequence running, requests with sequences waiting and none running)."""
        running = {s.request.request_id for s in self.running}
        return len(running), len({s.request.request_id for s in self.waiting} - running)

    def logical_tokens(self) -> int:
        return sum(s.num_tokens for s in self.running)

    def chunk_counts(self) -> dict[str, int]:
        return self.tree.chunk_counts()

    def pinned_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.tree.iter_nodes() if n.pins)

    def check_integrity(self, pinned_leaves: Iterable[Node]) -> None:
        self.tree.check_integrity()
        assert self.pinned_chunks == self.tree.pinned_chunks(), "pinned chunks miscounted"
        for leaf in pinned_leaves:
            assert leaf.pins > 0, leaf
        for seq in self.running:
            assert seq.status is Status.RUNNING and seq.leaf is not None and seq.leaf.end <= seq.num_tokens
        for seq in self.waiting:
            assert seq.status is Status.WAITING and seq.leaf is None
        for fork in self._forks.values():
            assert fork.leader in self.running and not fork.leader.output_token_ids, fork
            for f in fork.followers:
                assert f in self._following and f in self.running and f.leaf is fork.leader.leaf, (fork, f)
        assert len(self._following) == sum(len(f.followers) for f in self._forks.values())

    def _admit(self, seq: Sequence) -> int | None:
        """Insert the sequence's tokens into the tree (or follow its request's leader); -> tokens
        matched, None if out of chunks."""
        tokens, req = seq.token_ids, seq.request
        forkable = self.tree.caching and len(req.seqs) > 1 and not seq.output_token_ids
        if forkable and (fork := self._forks.get(req.request_id)):
            seq.leaf, matched = self.tree.hold(fork.leader.held_leaf), len(tokens)
            fork.followers.append(seq)
            self._following.add(seq)
        else:
            limit = len(tokens) if req.prefill_only else len(tokens) - 1
            try:
                seq.leaf, matched = self.tree.insert(tokens, limit, req.partition)
            except OutOfChunks:
                return None
            if forkable:
                self._forks[req.request_id] = Fork(seq, [])
        if seq.cached_prompt_tokens is None:  # first admission (not a return from preemption)
            seq.cached_prompt_tokens = matched
            self.prefix_hit_tokens += matched
            self.prompt_tokens += len(seq.prompt_token_ids)
            counts = self.tenant_tokens.setdefault(req.tenant, [0, 0])
            counts[0] += len(seq.prompt_token_ids)
            counts[1] += matched
        seq.status = Status.RUNNING
        self.running[seq] = None
        return matched

    def _grant(self, seq: Sequence, budget: int, claimed: set[int]) -> ScheduledSeq | None:
        start, node = self.tree.frontier(seq.held_leaf)
        if node is None or node.id in claimed or seq.at_max_tokens:
            return None
        claimed.add(node.id)
        n = min(budget, seq.num_tokens - start)
        return ScheduledSeq(seq, start, n, start + n == seq.num_tokens)

    def _grow_running(self) -> list[Sequence]:
        """Put each running sequence's newly sampled tokens into the tree, preempting on OOM."""
        preempted: list[Sequence] = []
        for seq in list(self.running):
            while seq.status is Status.RUNNING and (leaf := seq.held_leaf).end < seq.num_tokens:
                try:
                    seq.leaf = self.tree.extend(leaf, seq.tokens_from(leaf.end))
                except OutOfChunks:
                    preempted.append(self._preempt_last())
        return preempted

    def _fork_led_by(self, seq: Sequence) -> Fork | None:
        fork = self._forks.get(seq.request.request_id)
        return fork if fork is not None and fork.leader is seq else None

    def _unfork(self, seq: Sequence) -> None:
        """`seq` stops running: it leaves its leader's followers, or, a leader, hands its
        followers to the first of them (who computes the path they all hold)."""
        rid = seq.request.request_id
        if seq in self._following:
            self._following.remove(seq)
            self._forks[rid].followers.remove(seq)
        elif fork := self._fork_led_by(seq):
            del self._forks[rid]
            if fork.followers:
                head = fork.followers[0]
                self._following.remove(head)
                self._forks[rid] = Fork(head, fork.followers[1:])

    def _preempt_last(self) -> Sequence:
        victim, _ = self.running.popitem()  # the last admitted
        self._unfork(victim)
        self.num_preemptions += 1
        self.tree.release(victim.held_leaf)
        victim.leaf, victim.status = None, Status.WAITING
        self.waiting[victim] = None
        self.waiting.move_to_end(victim, last=False)  # first in line
        return victim
