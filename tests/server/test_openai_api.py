"""The OpenAI API, driven by the official client against a real server process."""

from __future__ import annotations

import re

import pytest

from server_process import SYSTEM_PROMPT, launch

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, server, content: str, system: str | None = None, **kwargs):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=server.model, messages=messages, **kwargs)


def streamed_chat(client, server, content: str, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons by choice index, and the chunks."""
    chunks = list(chat(client, server, content, stream=True, **kwargs))
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def test_models_version_health(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model]
    assert server.client().models.retrieve(server.model).id == server.model
    assert server.get("/version").json()["version"]
    assert server.get("/health", headers={}).json() == {"status": "ok"}


def test_chat(client, server):
    r = chat(client, server, "What is the capital of France?", temperature=0)
    assert r.object == "chat.completion" and r.model == server.model and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_text_equals_non_streamed(client, server, endpoint):
    if endpoint == "chat":
        full = chat(client, server, "Name three colors.", temperature=0).choices[0]
        texts, reasons, _ = streamed_chat(client, server, "Name three colors.", temperature=0)
        assert (texts[0], reasons[0]) == (full.message.content, full.finish_reason)
    else:
        kwargs = dict(model=server.model, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0)
        full = client.completions.create(**kwargs).choices[0]
        chunks = list(client.completions.create(stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in chunks) == full.text
        assert chunks[-1].choices[0].finish_reason == full.finish_reason


def boundary_stop(tokens: list[str], text: str) -> str:
    """A stop string that starts on the last character of one token and ends inside the next:
    when it completes, text already streamed must be taken back (unless it was held back)."""
    for k in range(1, len(tokens) - 1):
        a, b = tokens[k], tokens[k + 1]
        stop = a[-1:] + b[:2]
        if a.strip() and len(b) >= 2 and text.find(stop) == len("".join(tokens[:k + 1])) - 1:
            return stop
    pytest.fail(f"no token boundary to put a stop string on in {tokens}")


def test_stop_string_cuts_streamed_and_non_streamed_alike(client, server):
    kwargs = dict(model=server.model, prompt="The numbers from one to ten are", max_tokens=16, temperature=0)
    r = client.completions.create(logprobs=0, **kwargs).choices[0]
    assert "".join(r.logprobs.tokens) == r.text
    stop = boundary_stop(r.logprobs.tokens, r.text)
    cut = r.text[:r.text.index(stop)]
    full = client.completions.create(stop=[stop, "@@@@"], **kwargs).choices[0]
    assert full.text == cut and full.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop, "@@@@"], stream=True, **kwargs))
    assert streamed == cut


def test_n_samples(client, server):
    r = client.completions.create(model=server.model, prompt="My favourite animal is", n=3, max_tokens=8,
                                  temperature=1.0, seed=11)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens >= 3
    again = client.completions.create(model=server.model, prompt="My favourite animal is", n=3, max_tokens=8,
                                      temperature=1.0, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    texts, reasons, _ = streamed_chat(client, server, "Say something.", n=2, temperature=1.0, seed=3)
    assert set(texts) == set(reasons) == {0, 1}


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.model, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and value <= 0
        assert value == pytest.approx(max(top.values()))  # greedy: the sampled token is the top one


def test_chat_logprobs_streamed_and_not(client, server):
    kwargs = dict(temperature=0, logprobs=True, top_logprobs=2, max_tokens=6)
    r = chat(client, server, "Hello!", **kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token
    _, _, chunks = streamed_chat(client, server, "Hello!", **kwargs)
    streamed = [e.token for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == [e.token for e in content]


def test_shared_system_prompt_is_cached(client, server):
    system = "You are a careful reviewer of tests. Keep every answer brief and precise."
    first = chat(client, server, "Is this fine?", system=system, temperature=0, max_tokens=2)
    second = chat(client, server, "And this one?", system=system, temperature=0, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens
    assert cached >= 15  # at least the system turn


def test_pinned_system_prompt_is_cached_on_first_use(client, server):
    chunks = list(chat(client, server, "Hi there, first time here.", system=SYSTEM_PROMPT, temperature=0,
                       max_tokens=2, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens >= 15
    assert all(c.usage is None for c in chunks[:-1])


def test_metrics(client, server):
    chat(client, server, "Count to three.", temperature=0)
    text = server.get("/metrics").text
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(prefixserve_[^\s]+) (\S+)$", text, re.M)}
    assert values["prefixserve_generation_tokens_total"] > 0
    assert values["prefixserve_time_to_first_token_seconds_count"] > 0
    assert values["prefixserve_inter_token_latency_seconds_count"] > 0
    assert values["prefixserve_prefix_cache_hit_tokens_total"] > 0
    assert 0 < values['prefixserve_kv_cache_tokens{state="pinned"}']
    assert 0 <= values["prefixserve_kv_cache_usage_ratio"] <= 1
    assert any(k.startswith("prefixserve_attention_backend_info{backend=") for k in values)
    assert any(k.startswith("prefixserve_attention_schedule_steps_total{schedule=") for k in values)
    assert server.get("/metrics", headers={}).status_code == 401


def test_max_tokens_beyond_the_context_is_400(server):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 10 ** 6}
    r = server.post("/v1/completions", body)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_integrity_after_requests(server):
    report = server.wait_idle()
    assert report["integrity"] == "ok" and report["status"] == "ok"
    assert report["in_use_tokens"] >= report["pinned_tokens"] > 0
