"""Every bad request gets its 4xx with an OpenAI-shaped body, and the server keeps serving."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from server_process import launch

CONCURRENCY_LIMIT = 2
MAX_TOKENS_LIMIT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch(tmp_path_factory, "--max-concurrent-requests", str(CONCURRENCY_LIMIT),
                      "--max-body-bytes", str(256 << 10), "--max-tokens", str(MAX_TOKENS_LIMIT),
                      "--request-body-timeout", str(BODY_TIMEOUT_S))


BODY_TIMEOUT_S = 2


def completion(server, **fields) -> dict:
    return {"model": server.model, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(server, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serves(server) -> None:
    r = server.post("/v1/completions", completion(server, max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


BAD_BODIES = {
    "malformed json": (b'{"model": "x", "prompt": ', None),
    "json not an object": (b"[1, 2, 3]", None),
    "invalid utf-8": (b'{"model": "M", "prompt": "caf\xe9 \xff\xfe"}', None),
    "empty body": (b"", None),
    "lone surrogate": (b'{"model": "M", "prompt": "a\\ud800b"}', None),
    "NaN": (b'{"model": "M", "prompt": "a", "temperature": NaN}', None),
    "int beyond int64": (b'{"model": "M", "prompt": "a", "seed": 1' + b"0" * 30 + b"}", None),
}

BAD_COMPLETIONS = {
    "max_tokens wrong type": ({"max_tokens": "8"}, "max_tokens"),
    "temperature wrong type": ({"temperature": "hot"}, "temperature"),
    "stream wrong type": ({"stream": "yes"}, "stream"),
    "n not an int": ({"n": 1.5}, "n"),
    "prompt wrong type": ({"prompt": {"text": "hi"}}, "prompt"),
    "prompt token not an int": ({"prompt": [1, "a"]}, "prompt.1"),
    "prompt token out of vocabulary": ({"prompt": [1, 10 ** 9]}, None),
    "negative max_tokens": ({"max_tokens": -1}, "max_tokens"),
    "zero max_tokens": ({"max_tokens": 0}, "max_tokens"),
    "huge max_tokens": ({"max_tokens": 10 ** 12}, "max_tokens"),
    "max_tokens over the server's limit": ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    "n zero": ({"n": 0}, "n"),
    "n huge": ({"n": 10 ** 6}, "n"),
    "negative temperature": ({"temperature": -1}, "temperature"),
    "top_p zero": ({"top_p": 0}, "top_p"),
    "huge logprobs": ({"logprobs": 10 ** 6}, "logprobs"),
    "too many stop strings": ({"stop": [f"s{i}" for i in range(50)]}, "stop"),
    "stop string too long": ({"stop": "x" * 10_000}, "stop"),
    "empty stop string": ({"stop": [""]}, "stop"),
    "prompt over the context": ({"prompt": "hello " * 9000}, None),
    "empty prompt": ({"prompt": []}, None),
    "batched prompts": ({"prompt": ["a", "b"]}, "prompt"),
    "echo unsupported": ({"echo": True}, None),
    "top_k below -1": ({"top_k": -2}, "top_k"),
    "min_p above 1": ({"min_p": 1.5}, "min_p"),
    "presence_penalty above 2": ({"presence_penalty": 3}, "presence_penalty"),
    "repetition_penalty zero": ({"repetition_penalty": 0}, "repetition_penalty"),
    "min_tokens above max_tokens": ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    "suffix unsupported": ({"suffix": "end"}, None),
    "missing model": ({"model": None}, "model"),
    "stop token id negative": ({"stop_token_ids": [-1]}, None),
    "stop token id out of vocabulary": ({"stop_token_ids": [10 ** 9]}, None),
    "stop_token_ids wrong type": ({"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    "prompt_logprobs unsupported": ({"prompt_logprobs": 1}, None),
    "guided_json unsupported": ({"guided_json": {"type": "object"}}, None),
    "guided_choice unsupported": ({"guided_choice": ["a", "b"]}, None),
}

BAD_CHATS = {
    "messages not a list": ({"messages": "hi"}, "messages"),
    "no messages": ({"messages": []}, "messages"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    "huge top_logprobs": ({"logprobs": True, "top_logprobs": 10 ** 6}, "top_logprobs"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, None),
    "logprobs wrong type": ({"logprobs": 1}, "logprobs"),
    "huge max_completion_tokens": ({"max_completion_tokens": 10 ** 12}, "max_completion_tokens"),
    "tools unsupported": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, None),
    "tool_choice unsupported": ({"tool_choice": "required"}, None),
    "response_format json_object": ({"response_format": {"type": "json_object"}}, None),
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
    "functions unsupported": ({"functions": [{"name": "f", "parameters": {}}]}, None),
    "function_call unsupported": ({"function_call": "auto"}, None),
    "audio output unsupported": ({"audio": {"voice": "alloy", "format": "wav"}}, None),
    "audio modality unsupported": ({"modalities": ["text", "audio"]}, None),
    "echo unsupported": ({"echo": True}, None),
    "continue_final_message unsupported": ({"continue_final_message": True}, None),
    "chat_template_kwargs unsupported": ({"chat_template_kwargs": {"enable_thinking": True}}, None),
    "guided_regex unsupported": ({"guided_regex": "a+"}, None),
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_unparsable_body_is_400(server, body):
    content, param = body
    assert_error(server.post("/v1/completions", content=content), 400, param)
    assert_serves(server)


@pytest.mark.parametrize("case", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_bad_completion_is_400(server, case):
    fields, param = case
    body = {k: v for k, v in completion(server, **fields).items() if v is not None}
    assert_error(server.post("/v1/completions", body), 400, param)
    assert_serves(server)


@pytest.mark.parametrize("case", BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_is_400(server, case):
    fields, param = case
    assert_error(server.post("/v1/chat/completions", chat(server, **fields)), 400, param)
    assert_serves(server)


def test_unset_max_tokens_is_capped_by_the_limit(server):
    r = server.post("/v1/chat/completions", {k: v for k, v in chat(server, ignore_eos=True).items() if k != "max_tokens"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_model_is_404(server):
    assert_error(server.post("/v1/completions", completion(server, model="gpt-17")), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert_error(server.get("/v1/models/gpt-17"), 404, "model", "model_not_found")
    assert_serves(server)


def test_body_over_the_limit_is_413(server):
    big = completion(server, prompt="word " * 100_000)
    assert_error(server.post("/v1/completions", big), 413, code="request_too_large")
    chunked = server.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * (300 << 10), b'"}']))
    assert_error(chunked, 413)
    assert_serves(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/metrics", "/version", "/no/such/route",
                                  "/health?detail=1"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_auth_is_required_everywhere_but_health(server, path, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    method = httpx.post if path == "/v1/completions" else httpx.get
    r = method(server.url + path, headers=headers, **({"json": completion(server)} if method is httpx.post else {}))
    assert_error(r, 401, code="invalid_api_key")


def test_auth_with_the_client(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert_error(server.get("/no/such/route"), 404, code="unknown_url")
    assert_error(server.get("/v1/completions"), 405)


def test_too_many_concurrent_requests_is_429(server):
    """Hold every slot with long streams, then one more request is refused; afterwards all is well."""
    long = completion(server, max_tokens=MAX_TOKENS_LIMIT, ignore_eos=True, stream=True)
    started = threading.Barrier(CONCURRENCY_LIMIT + 1)
    results = []

    def hold():
        with httpx.stream("POST", server.url + "/v1/completions", json=long, headers=server.headers, timeout=120) as r:
            lines = r.iter_lines()
            results.append((r.status_code, next(lines)))  # the first event: the request is running
            started.wait()
            started.wait()  # until the 429 was seen; closing the stream then aborts the request

    threads = [threading.Thread(target=hold) for _ in range(CONCURRENCY_LIMIT)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    try:
        assert_error(server.post("/v1/completions", completion(server)), 429)
    finally:
        started.wait(timeout=60)
        for t in threads:
            t.join()
    assert [status for status, _ in results] == [200] * CONCURRENCY_LIMIT
    server.wait_idle(timeout=30)
    assert_serves(server)


def test_top_k_above_the_vocabulary_is_clamped_not_fatal(server):
    r = server.post("/v1/completions", completion(server, top_k=10 ** 6, temperature=1.0, max_tokens=4, seed=1))
    assert r.status_code == 200, r.text
    assert_serves(server)


def test_a_tiny_temperature_is_greedy(server):
    texts = [server.post("/v1/completions", completion(server, temperature=t, max_tokens=8)).json()["choices"][0]["text"]
             for t in (0, 1e-40)]
    assert texts[0] and texts[0] == texts[1]


def test_a_stalled_half_sent_body_times_out_with_408(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {server.headers['Authorization']}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ".encode())
        t = time.monotonic()
        first = s.recv(4096)  # the reply's head and body may come as two segments: read to the close
        reply = (first + b"".join(iter(lambda: s.recv(4096), b""))).decode()
    assert reply.startswith("HTTP/1.1 408") and '"code":"request_timeout"' in reply, reply
    assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - t < BODY_TIMEOUT_S + 20
    assert_serves(server)


def test_vllm_stop_fields_are_honoured_not_ignored(server, tokenizer):
    """stop_token_ids, include_stop_str_in_output and skip_special_tokens (vLLM's) reach the
    sampler and the detokenizer: they were accepted and dropped."""
    greedy = completion(server, prompt="The capital of France is", temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    first = server.post("/v1/completions", greedy).json()["choices"][0]
    second = first["logprobs"]["tokens"][1]
    (stop_id,) = tokenizer.encode(second, add_special_tokens=False)
    choice = server.post("/v1/completions", {**greedy, "stop_token_ids": [stop_id]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["logprobs"]["tokens"] == first["logprobs"]["tokens"][:2], choice
    word = second.strip()
    for include in (False, True):
        r = server.post("/v1/completions", {**greedy, "logprobs": None, "stop": [word], "include_stop_str_in_output": include})
        assert r.json()["choices"][0]["text"].endswith(word) == include, (word, r.text)
    say_hi = chat(server, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=16, ignore_eos=True)
    replies = {skip: server.post("/v1/chat/completions", {**say_hi, "skip_special_tokens": skip}) for skip in (True, False)}
    texts = {skip: r.json()["choices"][0]["message"]["content"] for skip, r in replies.items()}
    assert "<|im_end|>" in texts[False] and "<|im_end|>" not in texts[True], texts
