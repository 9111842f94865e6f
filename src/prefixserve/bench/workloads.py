"""The seeds' end-to-end workloads, as token-id prompts with their sampling params.

    sharegpt       system prompt (s tokens) + a real ShareGPT question; output length from the
                   real answer, capped (RelayAttention Fig. 7 / 8)       [sys | q_1] [sys | q_2] ...
    synthetic      system prompt + fixed-length user prompt, fixed generation length (RelayAttention App. C)
    multi-sample   one prompt of p tokens, n sampled completions (Hydragen Fig. 3)     [p] -> n samples
    hierarchical   few-shot prefix -> problem descriptions -> sampled solutions (Hydragen Sec. 4.4)
                       [fewshot | problem_1] -> k samples, [fewshot | problem_2] -> k samples, ...
    long-doc       one long document + many short questions (Hydragen Sec. 4.3) [doc | question_i]
    multi-tenant   T distinct system prompts, ShareGPT questions under each, tenants interleaved
                   at random (scale-out routing)      [sys_3 | q_1] [sys_0 | q_2] [sys_3 | q_3] ...

Prompts are token ids, so a model without a tokenizer (load_format=dummy) runs them too: text
is tokenized with the model's tokenizer, or the embedded model's, and ids are mapped into the
model's vocabulary (`id % vocab_size`). Text comes from ShareGPT (real conversations), except
the system prompt, a synthetic numbered rule list cut to exactly `system_prompt_len` tokens.
Greedy workloads (sharegpt, synthetic, long-doc) ignore eos so that every config generates the
same number of tokens and their outputs can be compared token for token; sampled ones
(multi-sample, hierarchical) are seeded.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

from ..sampling_params import SamplingParams
from .datasets import sharegpt_conversations, sharegpt_first_turns

WORKLOADS = ("sharegpt", "synthetic", "multi-sample", "hierarchical", "long-doc", "multi-tenant")
# Offline throughput runs these; multi-tenant needs a tenant per request, which only serving sends.
OFFLINE_WORKLOADS = tuple(w for w in WORKLOADS if w != "multi-tenant")

_RULES = (
    "Answer the user's question accurately, and say so when you are not sure.",
    "Prefer short, plain sentences; explain technical terms the first time they appear.",
    "When the user asks for code, give a complete, runnable example and explain how to run it.",
    "Never invent citations, statistics or quotations.",
    "If a request is ambiguous, state the interpretation you chose before answering.",
    "Keep personal data out of your answers and do not ask for it.",
    "Use metric units unless the user uses other units first.",
    "For calculations, show the steps so that the user can check them.",
    "Decline requests for harmful instructions, and briefly explain why.",
    "Summaries come first; details, caveats and alternatives follow.",
)
_SAMPLE_TEMPERATURE = 1.0


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt; n > 1 for sampled completions of one prompt
    settings: dict[str, Any]  # the parameters that define it, recorded in the results
    shared_prefix_len: int  # tokens that every prompt starts with (multi-tenant: every prompt of a tenant)
    tenants: tuple[int, ...] = ()  # multi-tenant: the tenant of each prompt

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def num_sequences(self) -> int:
        return sum(p.n for p in self.params)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(x) * p.n for x, p in zip(self.prompts, self.params, strict=True))

    @property
    def max_tokens(self) -> list[int]:
        """Each prompt's output length: every workload sets one (`_ignore_eos`)."""
        caps = []
        for p in self.params:
            assert p.max_tokens is not None, f"{self.name}: a prompt without max_tokens"
            caps.append(p.max_tokens)
        return caps

    @property
    def output_tokens(self) -> int:
        return sum(n * p.n for n, p in zip(self.max_tokens, self.params, strict=True))


class TokenSource:
    """Text -> token ids in the model's vocabulary, and a stream of real ShareGPT tokens."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._turns = sharegpt_first_turns()
        self._stream: list[int] = []
        self._pos = 0

    def encode(self, text: str) -> list[int]:
        return [t % self.vocab_size for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def take(self, n: int) -> list[int]:
        """The next n tokens of the conversations in file order: no span is handed out twice."""
        while self._pos + n > len(self._stream):
            question, answer = next(self._turns)
            self._stream += self.encode(question + "\n" + answer + "\n")
        span = self._stream[self._pos:self._pos + n]
        self._pos += n
        return span

    def system_prompt(self, length: int, owner: str = "") -> list[int]:
        """A synthetic system prompt of exactly `length` tokens: a numbered list of rules. With an
        `owner`, its name comes first and its rules are in an order of its own, so that two
        owners' prompts differ from their first tokens on."""
        lines = [f"{owner}: you are a helpful, honest assistant. Follow these rules in every answer." if owner
                 else "You are a helpful, honest assistant. Follow these rules in every answer."]
        rules = list(_RULES)
        if owner:
            random.Random(owner).shuffle(rules)
        ids: list[int] = []
        for i, rule in enumerate(itertools.cycle(rules), 1):
            if len(ids) >= length:
                break
            lines.append(f"{i}. {rule}")
            ids = self.encode("\n".join(lines))
        return ids[:length]


def token_source(engine_kw: dict[str, Any]) -> TokenSource:
    """For the model `engine_kw` names: its tokenizer (or the embedded model's, for a model
    without one) and its vocabulary size; the model's weights are not loaded."""
    from ..config import EngineConfig
    from ..model import loader
    cfg = EngineConfig.from_kwargs(**engine_kw)
    src = loader.resolve(cfg)
    tok = loader.load_tokenizer(src, cfg.tokenizer)
    if tok is None:
        tok = loader.load_tokenizer(loader.resolve(EngineConfig()), None)
    return TokenSource(tok, src.config["vocab_size"])


def _ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def sharegpt(src: TokenSource, system_prompt_len: int, num_prompts: int, max_output_len: int,
             max_prompt_len: int = 1024, seed: int = 0) -> Workload:
    """Real first turns: the question after the system prompt, output length = the real
    answer's token count capped at `max_output_len`. Like vLLM's benchmark, pairs whose
    question is over `max_prompt_len` tokens, or whose question or answer is under 4, are skipped."""
    system = src.system_prompt(system_prompt_len)
    prompts, params = [], []
    for question, answer in sharegpt_conversations(4 * num_prompts, seed=seed):
        q = src.encode(f"\n\nUser: {question}\nAssistant:")
        answer_len = len(src.encode(answer))
        if 4 <= len(q) <= max_prompt_len and answer_len >= 4:
            prompts.append(system + q)
            params.append(_ignore_eos(min(answer_len, max_output_len), temperature=0.0))
        if len(prompts) == num_prompts:
            break
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} ShareGPT prompts fit --max-prompt-len {max_prompt_len}")
    settings = dict(system_prompt_len=system_prompt_len, num_prompts=num_prompts,
                    max_output_len=max_output_len, max_prompt_len=max_prompt_len, seed=seed)
    return Workload("sharegpt", prompts, params, settings, system_prompt_len)


def multi_tenant(src: TokenSource, tenants: int, system_prompt_len: int, num_prompts: int, max_output_len: int,
                 max_prompt_len: int = 1024, seed: int = 0, run: int = 0) -> Workload:
    """`sharegpt`'s questions and output lengths, each under the system prompt of a tenant drawn
    at random (seeded); `run` names a fresh set of tenants, so no run finds another's prompts cached."""
    if tenants < 1 or tenants > num_prompts:
        raise ValueError(f"tenants must be in [1, num_prompts={num_prompts}], got {tenants}")
    base = sharegpt(src, system_prompt_len, num_prompts, max_output_len, max_prompt_len, seed)
    systems = [src.system_prompt(system_prompt_len, f"Tenant {t} of run {run}") for t in range(tenants)]
    rng = random.Random(f"{seed}:{run}")
    owner = list(range(tenants)) + [rng.randrange(tenants) for _ in range(num_prompts - tenants)]
    rng.shuffle(owner)  # every tenant has at least one request
    prompts = [systems[t] + p[system_prompt_len:] for t, p in zip(owner, base.prompts, strict=True)]
    settings = dict(base.settings, tenants=tenants, run=run)
    return Workload("multi-tenant", prompts, base.params, settings, system_prompt_len, tuple(owner))


def ideal_cached_tokens(wl: Workload) -> int:
    """Prompt tokens one cache that kept everything would serve, requests in order: each one's
    longest common prefix with an earlier prompt. For multi-tenant that is, after a tenant's
    first request, its whole system prompt (and the few tokens every question starts with)."""
    total = 0
    for i, prompt in enumerate(wl.prompts):
        total += max((_common_prefix(prompt, earlier) for earlier in wl.prompts[:i]), default=0)
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # the lengths may differ: the common prefix ends at the shorter
        if x != y:
            break
        n += 1
    return n


def synthetic(src: TokenSource, system_prompt_len: int, num_prompts: int, prompt_len: int,
              gen_len: int) -> Workload:
    """Fixed-length user prompts (real text) after the system prompt, fixed generation length."""
    system = src.system_prompt(system_prompt_len)
    prompts = [system + src.take(prompt_len) for _ in range(num_prompts)]
    params = [_ignore_eos(gen_len, temperature=0.0)] * num_prompts
    settings = dict(system_prompt_len=system_prompt_len, num_prompts=num_prompts,
                    prompt_len=prompt_len, gen_len=gen_len)
    return Workload("synthetic", prompts, params, settings, system_prompt_len)


def multi_sample(src: TokenSource, prefix_len: int, batch: int, gen_len: int, seed: int = 0) -> Workload:
    """One prompt, `batch` seeded samples (temperature 1): the whole prompt is shared."""
    params = _ignore_eos(gen_len, n=batch, temperature=_SAMPLE_TEMPERATURE, seed=seed)
    settings = dict(prefix_len=prefix_len, batch=batch, gen_len=gen_len, seed=seed)
    return Workload("multi-sample", [src.take(prefix_len)], [params], settings, prefix_len)


def hierarchical(src: TokenSource, fewshot_len: int, problems: int, problem_len: int, samples: int,
                 gen_len: int, seed: int = 0) -> Workload:
    """Two levels of sharing: the few-shot prefix by all, each problem by its samples."""
    fewshot = src.take(fewshot_len)
    prompts = [fewshot + src.take(problem_len) for _ in range(problems)]
    params = [_ignore_eos(gen_len, n=samples, temperature=_SAMPLE_TEMPERATURE, seed=seed + 1000 * i)
              for i in range(problems)]
    settings = dict(fewshot_len=fewshot_len, problems=problems, problem_len=problem_len,
                    samples=samples, gen_len=gen_len, seed=seed)
    return Workload("hierarchical", prompts, params, settings, fewshot_len)


def long_doc(src: TokenSource, doc_len: int, questions: int, question_len: int, gen_len: int) -> Workload:
    """One long document, then each question (greedy answers)."""
    doc = src.take(doc_len)
    prompts = [doc + src.take(question_len) for _ in range(questions)]
    params = [_ignore_eos(gen_len, temperature=0.0)] * questions
    settings = dict(doc_len=doc_len, questions=questions, question_len=question_len, gen_len=gen_len)
    return Workload("long-doc", prompts, params, settings, doc_len)


def sweep_points(primary: tuple[str, list[int]], secondary: tuple[str, list[int]] | None = None) -> list[dict]:
    """Hydragen Fig. 3's two lines: `primary` swept at the first `secondary` value, then
    `secondary` swept at the largest `primary` value (duplicates dropped, order kept)."""
    a, avals = primary
    b, bvals = (None, [None]) if secondary is None else secondary  # no second axis: a None key, dropped below
    points = [{a: v, b: bvals[0]} for v in avals] + [{a: max(avals), b: v} for v in bvals]
    unique = []
    for p in points:
        p = {k: v for k, v in p.items() if k is not None}
        if p not in unique:
            unique.append(p)
    return unique
