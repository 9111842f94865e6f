"""CUDA graphs of decode steps: the buckets (anywhere), and graph replay against eager execution,
overlapped or not (on a GPU: run with a CUDA build of torch; the CPU CI has none, and there the engine never
captures). The GPU check uses a small Llama with random weights in fp32: graphs and eager run
the same kernels on differently padded batches, so their outputs may differ only by the
order of fp32 sums in the attention merge, far below any greedy margin of a random model."""

from __future__ import annotations

import json

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.engine.cuda_graphs import buckets

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("max_rows", [1, 7, 256, 1000, 1024])
def test_buckets_cover_every_batch_with_little_padding(max_rows):
    sizes = buckets(max_rows)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_rows
    for n in range(1, max_rows + 1):
        r = next(s for s in sizes if s >= n)
        assert r - n <= max(n // 16, 15 if n <= 256 else 63), (n, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend,n", [(b, 3) for b in ("paged", "hydragen", "chunk", "auto", "no-attention")]
                         + [("relay", 8), ("auto", 8)])
def test_graphs_replay_what_eager_computes(tmp_path, backend, n):
    """Eager one step at a time, graphs one step at a time, graphs overlapped (the default).
    n 8: each prompt's 8 samples x G 4 make wide units, and the decode steps' narrow units
    merge the rows (`worklist`'s fused: the narrow launch started beside the wide one by
    programmatic dependent launch, inside the graph)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    prompts = [[5 + i for i in range(300)] + [700 + j, 800 + j] for j in range(3)]
    params = SamplingParams(temperature=0, n=n, max_tokens=40, ignore_eos=True)
    outs = {}
    for eager, overlap in ((True, False), (False, False), (False, True)):
        llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", device="cuda",
                  attention_backend=backend, enforce_eager=eager, overlap_schedule=overlap,
                  kv_cache_memory=64 << 20)
        outs[eager, overlap] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = llm.engine.runner.rank.graphs
        assert (graphs is None) == eager and (eager or graphs.graphs)  # decode steps were captured
        assert llm.engine.runner.advanced_steps > 0
        if backend == "relay" and not eager:  # (the last step's plan: a padded decode step's)
            assert llm.engine.runner.rank.backend.current.extra["fused"] == 1
        llm.close()
    assert outs[False, False] == outs[True, False] == outs[False, True]
