"""`prefixserve serve --replicas 2 --router prefix` (Ray Serve) against the single-process
server: the official client, the real embedded model, real processes on loopback. One Ray
application for the module; the replica-kill test runs last."""

from __future__ import annotations

import collections
import itertools
import os
import re
import signal
import time

import httpx
import openai
import pytest

from servers import API_KEY, launch

REPLICAS = 2
SYSTEMS = [f"You are assistant number {i}. " + text * 6 for i, text in enumerate((
    "You answer questions about astronomy with care, citing the instrument that measured each value. ",
    "You are a terse pirate who answers in rhyme and never breaks character, whatever is asked. ",
    "You review Python code for a bank and flag every unchecked input and every silent exception. "))]
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is a comet?", "Name a colour.", "How do magnets work?"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    yield from launch(tmp_path_factory, "--replicas", str(REPLICAS), "--cpus-per-replica", "0.5",
                      "--router", "prefix")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    yield from launch(tmp_path_factory)


def _chat(server, system: str, question: str, **kwargs):
    """(text, usage, replica header) of a greedy chat completion."""
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0, max_tokens=kwargs.pop("max_tokens", 8), **kwargs)
    r = raw.parse()
    return r.choices[0].message.content, r.usage, raw.headers.get("x-prefixserve-replica")


def test_a_system_prompt_sticks_to_one_replica_and_outputs_equal_one_process(app, single):
    replicas, seen = collections.defaultdict(set), {}
    for question in QUESTIONS[:2]:
        for system in SYSTEMS:
            text, usage, replica = _chat(app, system, question)
            replicas[system].add(replica)
            if system in seen:  # the replica that has the system prompt cached got it again
                assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 24, usage
            seen[system] = True
            assert text == _chat(single, system, question)[0]
    assert all(len(r) == 1 for r in replicas.values()), replicas
    assert len(set().union(*replicas.values())) == REPLICAS  # new prefixes go to the emptier replica


def test_streaming_and_completions_equal_one_process(app, single):
    def streamed(server) -> str:
        stream = server.client().chat.completions.create(
            model=MODEL, stream=True, temperature=0, max_tokens=12,
            messages=[{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": QUESTIONS[2]}])
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion(server, prompt) -> tuple[str, int]:
        r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2,
                                               seed=3)
        return [c.text for c in r.choices], r.usage.prompt_tokens

    assert streamed(app) == streamed(single) == _chat(single, SYSTEMS[0], QUESTIONS[2], max_tokens=12)[0]
    for prompt in ("The capital of France is", [504, 3458, 282, 4649, 314]):
        assert completion(app, prompt) == completion(single, prompt)


@pytest.mark.parametrize("method,path,body,auth", [
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, False),
    ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, True),
    ("POST", "/v1/completions", b'{"model": ', True),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 99}, True),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": "1"}, True),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)}, True),
    ("GET", "/v1/nowhere", None, True),
    ("GET", "/v1/models/nope", None, True),
    ("DELETE", "/v1/models", None, True),
])
def test_errors_are_the_single_process_servers(app, single, method, path, body, auth):
    def call(server) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        content = body if isinstance(body, bytes) else None
        r = httpx.request(method, server.url + path, headers={**headers, "Content-Type": "application/json"},
                          json=None if content is not None else body, content=content, timeout=60)
        return r.status_code, r.json()
    status, error = call(app)
    assert 400 <= status < 500 and set(error["error"]) == {"message", "type", "param", "code"}
    assert (status, error) == call(single)


def test_health_and_metrics_of_every_replica(app):
    assert app.get("/health", auth=False).json() == {"status": "ok"}
    assert app.get("/metrics", auth=False).status_code == 401
    text = app.get("/metrics").text
    where = _replica_pids(text)
    assert len(where) == REPLICAS
    for replica in where:
        assert re.search(rf'prefixserve_prompt_tokens_total\{{replica="{replica}"\}} \d', text), text[:2000]


def _replica_pids(metrics_text: str) -> dict[str, int]:
    """Replica id -> its process id, from `prefixserve_replica{node, pid, replica} 1`."""
    found = re.findall(r'prefixserve_replica\{node="[^"]*",pid="(\d+)",replica="(\w+)"\}', metrics_text)
    return {replica: int(pid) for pid, replica in found}


def test_a_client_that_leaves_mid_stream_aborts_its_request_on_the_replica(app):
    raw = app.client().chat.completions.with_raw_response.create(
        model=MODEL, stream=True, max_tokens=2000, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEMS[2]}, {"role": "user", "content": "Count to a million."}])
    replica, stream = raw.headers["x-prefixserve-replica"], raw.parse()
    for _ in itertools.islice(stream, 3):
        pass
    stream.close()
    aborted = rf'prefixserve_requests_finished_total\{{reason="abort",replica="{replica}"\}} 1\.0'
    idle = rf'prefixserve_requests_running\{{replica="{replica}"\}} 0\.0'
    deadline = time.monotonic() + 30
    while not (re.search(aborted, text := app.get("/metrics").text) and re.search(idle, text)):
        assert time.monotonic() < deadline, "the replica did not abort the request of a client that left"
        time.sleep(0.5)


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_and_is_replaced(app):
    client = app.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, max_tokens=2000, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "Tell a long story."}])
    victim = raw.headers["x-prefixserve-replica"]
    stream = iter(raw.parse())
    for _ in range(3):
        next(stream)
    os.kill(_replica_pids(app.get("/metrics").text)[victim], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="replica"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30  # an error event, not a hang
    # the other replica serves meanwhile, and Ray Serve replaces the dead one
    assert _chat(app, SYSTEMS[0], QUESTIONS[0])[0]
    deadline = time.monotonic() + 180
    while (victim in (pids := _replica_pids(app.get("/metrics").text)) or len(pids) < REPLICAS):
        assert time.monotonic() < deadline, pids
        time.sleep(1)
    for system in SYSTEMS:
        assert _chat(app, system, QUESTIONS[1])[0]
    assert app.get("/health", auth=False).status_code == 200
