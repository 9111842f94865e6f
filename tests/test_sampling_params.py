import dataclasses
import re

import pytest

from prefixserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.max_tokens, p.min_tokens) == ((), (), False, 16, 0)
    assert (p.logprobs, p.include_stop_str_in_output, p.skip_special_tokens) == (None, False, True)
    assert not p.greedy


@pytest.mark.parametrize(
    "stop, expected",
    [(None, ()), ("###", ("###",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",))],
)
def test_stop_normalised_to_tuple(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_normalisation():
    p = SamplingParams(stop_token_ids=[5, 7], top_k=-1, max_tokens=None, temperature=0.0)
    assert p.stop_token_ids == (5, 7)
    assert p.top_k == 0
    assert p.max_tokens is None
    assert p.greedy


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens must be an int >= 1 or None, got -1"),
        ({"max_tokens": 0}, "got 0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"n": 0}, "n must be an int >= 1, got 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5 > max_tokens=4"),
        ({"min_tokens": -1}, "min_tokens must be an int >= 0, got -1"),
        ({"temperature": -0.1}, "temperature must be finite and >= 0, got -0.1"),
        ({"temperature": float("inf")}, "got inf"),
        ({"top_k": -2}, "top_k must be an int >= -1, got -2"),
        ({"min_p": 1.2}, "min_p must be in [0, 1], got 1.2"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be finite and > 0, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"logprobs": -1}, "logprobs must be an int in [0, 100] or None, got -1"),
        ({"seed": 1.5}, "seed must be an int in [-2**63, 2**63 - 1 - n] or None, got 1.5"),
        ({"seed": "7"}, "seed must be an int in [-2**63, 2**63 - 1 - n] or None, got '7'"),
        ({"seed": 2**63 - 1, "n": 2}, f"seed must be an int in [-2**63, 2**63 - 1 - n] or None, got {2**63 - 1}"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty str, got ''"),
        ({"stop": ""}, "got ''"),
        ({"stop_token_ids": [1, 2.0]}, "stop_token_ids must be ints, got 2.0"),
    ],
)
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_boundaries_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=0, seed=0)
    SamplingParams(min_tokens=16, max_tokens=16)
    SamplingParams(min_tokens=100, max_tokens=None)


def test_for_model():
    SamplingParams(stop_token_ids=[0, 99]).for_model(vocab_size=100)
    with pytest.raises(ValueError, match=re.escape("stop_token_ids must be in [0, 100), got 100")):
        SamplingParams(stop_token_ids=[3, 100]).for_model(vocab_size=100)
    with pytest.raises(ValueError, match=re.escape("got -1")):
        SamplingParams(stop_token_ids=[-1]).for_model(vocab_size=100)


def test_top_k_above_the_vocabulary_keeps_it_all_as_vllm_does():
    assert SamplingParams(top_k=99).for_model(vocab_size=100).top_k == 99
    assert SamplingParams(top_k=100).for_model(vocab_size=100).top_k == 0
    assert SamplingParams(top_k=10**9).for_model(vocab_size=100).top_k == 0


def test_temperatures_below_1e_5_are_greedy_as_in_vllm():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), "0.5", None, True, [1]])
def test_every_float_field_refuses_non_numbers(name, value):
    with pytest.raises(ValueError, match=re.escape(f"{name} must be")):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens"])
def test_flags_must_be_bools(name):
    with pytest.raises(ValueError, match=re.escape(f"{name} must be a bool, got 1")):
        SamplingParams(**{name: 1})


def test_logprobs_are_bounded():
    SamplingParams(logprobs=100)
    with pytest.raises(ValueError, match=re.escape("logprobs must be an int in [0, 100] or None, got 101")):
        SamplingParams(logprobs=101)
