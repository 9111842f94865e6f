"""The exactness harness every model family's test uses: a tiny random checkpoint built with
transformers from a config (seeded), saved as a safetensors folder, loaded by prefixserve, and
compared with transformers itself.

Weights are drawn at unit gain (std 1/sqrt(fan_in), norms near their identity) rather than
transformers' 0.02 init: then logits spread over several units and the greedy pick has a gap
far above fp32 rounding, so token identity tests the model and not the luck of a near-tie.

Prompts share one long prefix (longer than any sliding window in these configs, and many
chunks of CHUNK_SIZE slots), then diverge; they run twice through one engine (the second time
from the prefix cache when it is on), with n = 2 samples each.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from prefixserve import LLM, SamplingParams

from engine_checks import run_checked

BACKENDS = ("paged", "relay", "hydragen", "chunk", "auto")
CHUNK_SIZE = 4
PREFIX_LEN = 45
SUFFIX_LENS = (1, 6, 13)
NEW_TOKENS = 10
LOGPROB_TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Reference:
    folder: Path  # what prefixserve loads: a checkpoint folder or a GGUF file
    prompts: list[list[int]]
    greedy: list[list[int]]  # transformers' greedy continuation of each prompt
    first_logprobs: list[torch.Tensor]  # [vocab] fp32 log-softmax at each prompt's last token


def save_checkpoint(hf_config, folder: Path, seed: int, norm_center: float = 1.0,
                    max_shard_size: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers model from `hf_config` with seeded unit-gain weights, saved in `folder`
    (safetensors in `dtype`, sharded with an index if max_shard_size); returns the model with
    those weights, in fp32. norm_center: the norms' weights are norm_center + N(0, 0.1) (0 for
    (1 + w) norms)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_(norm_center + 0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(1 if "embed" in name else p.shape[-1]))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with torch.no_grad():  # the weights as saved (every 16-bit value is an fp32 value);
        for p in model.parameters():  # buffers (inv_freq) stay fp32
            p.copy_(p.to(dtype))
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    model.save_pretrained(folder, state_dict=state, **kwargs)
    model.generation_config.eos_token_id = None  # compared with ignore_eos=True
    return model


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    prefix = ids(PREFIX_LEN)
    return [prefix + ids(n) for n in SUFFIX_LENS]


def reference(hf_config, folder: Path, seed: int, **save_kwargs) -> Reference:
    return greedy_reference(save_checkpoint(hf_config, folder, seed, **save_kwargs), folder, seed)


def greedy_reference(model, source: Path, seed: int) -> Reference:
    """transformers' outputs of `model` on the prompts; `source`: what prefixserve loads."""
    prompts = make_prompts(model.config.get_text_config().vocab_size, seed)
    greedy, first = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])  # an explicit mask: token 0 is a prompt token, not padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
            logits = model(torch.tensor([p])).logits[0, -1].float()
            first.append(torch.log_softmax(logits, dim=-1))
    return Reference(source, prompts, greedy, first)


def check_engine(ref: Reference, backend: str, prefix_caching: bool, **engine_kwargs) -> None:
    """Greedy tokens identical to transformers for every prompt and both samples, twice (the
    second round from the cache when caching is on); first-token logprobs within LOGPROB_TOL."""
    llm = LLM(str(ref.folder), attention_backend=backend, enable_prefix_caching=prefix_caching,
              chunk_size=CHUNK_SIZE, kv_cache_memory=16 << 20, device="cpu", **engine_kwargs)
    params = SamplingParams(temperature=0, n=2, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=3)
    with llm:  # closes tensor-parallel workers and their process group
        for round in range(2):
            outs = run_checked(llm, ref.prompts, params)
            for out, greedy, first in zip(outs, ref.greedy, ref.first_logprobs, strict=True):
                assert [c.token_ids for c in out.outputs] == [greedy, greedy], (backend, prefix_caching)
                for token, lp in out.outputs[0].logprobs[0].items():
                    assert abs(lp.logprob - first[token].item()) <= LOGPROB_TOL, (token, lp)
                if round == 1 and prefix_caching:  # the prefix (at least) came from the cache
                    assert out.num_cached_tokens >= PREFIX_LEN


def check_deterministic(ref: Reference) -> None:
    """Deterministic mode (fp32, CPU): under every setting of `prefixserve bench determinism`'s
    matrix, each request's tokens and logprobs are bit for bit those it has alone."""
    from prefixserve.bench import determinism as D
    base = {"deterministic": True, "device": "cpu", "dtype": "float32", "model": str(ref.folder)}
    doc = D.check_matrix(base, prefix_len=150, max_tokens=10)
    assert [r["name"] for r in doc["settings"] if not r["identical"]] == []
