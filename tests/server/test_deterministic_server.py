"""`prefixserve serve --deterministic` with the official client: a completion's tokens and
logprobs are the same alone and among concurrent requests sharing its system prompt, and an
unseeded sampled request repeats itself (it draws with the server's --seed)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from server_process import launch

SYSTEM = "You are a terse assistant for a hardware store. " * 6
QUESTIONS = ["Which glue holds wood best?", "How do I cut tile?", "What drill bit for concrete?",
             "Is a torx screw better?", "How long does paint dry?", "What is a spline?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch(tmp_path_factory, "--deterministic")


def ask(server, question: str, **kwargs):
    r = server.client().chat.completions.create(
        model=server.model, max_tokens=8, logprobs=True, top_logprobs=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **kwargs)
    c = r.choices[0]
    return c.message.content, [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                               for t in c.logprobs.content]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9}])
def test_alone_equals_among_others(server, sampling):
    alone = ask(server, QUESTIONS[0], **sampling)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(server, q, **sampling), QUESTIONS))
    assert together[0] == alone
    assert ask(server, QUESTIONS[0], **sampling) == alone  # and again, its prefix now cached
    server.wait_idle()
