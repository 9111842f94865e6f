"""The offline API and the CLI on the real embedded model: answers, seeds, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixserve import SamplingParams

from engine_checks import run_checked

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_paris(make_llm):
    out = make_llm().chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_cli_generate_answers_paris():
    out = subprocess.run([sys.executable, "-m", "prefixserve.cli", "generate", "--prompt",
                          "What is the capital of France?", "--kv-cache-memory", str(64 << 20)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout


def test_cli_help_explains_every_command():
    out = subprocess.run([sys.executable, "-m", "prefixserve.cli", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for command in ("serve", "generate", "chat", "bench"):
        assert command in out.stdout


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(make_llm, sharegpt_questions):
    llm = make_llm()
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, n=2)
    prompt = sharegpt_questions[3]
    alone = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    again = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    others = [sharegpt_questions[i] for i in (4, 5, 6)]
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=30)] * 2 + [params]
                         + [SamplingParams(temperature=0.5, seed=9, max_tokens=5)])
    assert alone == again == [c.token_ids for c in mixed[2].outputs]
    assert alone[0] != alone[1], "the n samples must differ (seed + index)"


def test_logprobs_stop_strings_and_n(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3, stop=["Paris"], n=2)
    out = llm.chat(QUESTION, params)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and "Paris" not in c.text
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in lp and len(lp) >= 3 for t, lp in zip(c.token_ids, c.logprobs, strict=True))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=-1), "-1"), (dict(top_p=1.5), "1.5"), (dict(n=0), "n must"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(temperature=-0.1), "-0.1"),
])
def test_invalid_sampling_params_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_chunk_size_defaults_by_device_and_is_validated(make_llm):
    from prefixserve.config import EngineConfig
    from prefixserve.engine.workers import CPU_CHUNK_SIZE
    assert make_llm().engine.pool.chunk_size == CPU_CHUNK_SIZE  # chunk_size=None on the CPU
    assert make_llm(chunk_size=64).engine.pool.chunk_size == 64
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        EngineConfig.from_kwargs(chunk_size=0)


def test_bad_requests_raise_and_the_engine_keeps_serving(make_llm, sharegpt_questions):
    llm = make_llm(max_model_len=256)
    with pytest.raises(ValueError, match="99999999"):
        llm.generate("hi", SamplingParams(stop_token_ids=[99999999]))
    with pytest.raises(ValueError, match="context is 256 tokens"):
        llm.generate(" ".join(sharegpt_questions[:20]), SamplingParams(max_tokens=8))  # 9,000+ tokens
    with pytest.raises(ValueError, match="49152"):
        llm.generate([[1, 2, 49152]], SamplingParams(max_tokens=8))
    # a bad request inside a batch rejects the batch, and leaves nothing behind
    with pytest.raises(ValueError):
        llm.generate(["fine", "x" * 5000], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    outs = run_checked(llm, ["Tell me a joke."], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 8
