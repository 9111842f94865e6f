"""`prefixserve generate` (one answer) and `prefixserve chat` (interactive)."""

from __future__ import annotations

import argparse


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", dest="sampling_seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _params(args):
    from .sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop)


def register(sub) -> None:
    from .cli import add_engine_args
    gen = sub.add_parser("generate", help="answer one prompt (chat template applied) and exit",
                         description="Answer one prompt with the model's chat template applied; prints the answer.")
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--system", default=None, help="an optional system message")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=generate)
    chat = sub.add_parser("chat", help="talk to the model in the terminal",
                          description="Interactive chat; an empty line or Ctrl-D ends it.")
    chat.add_argument("--system", default=None, help="an optional system message")
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=chat_loop)


def _llm(args):
    from .cli import engine_kwargs
    from .llm import LLM
    return LLM(**engine_kwargs(args))


def generate(args) -> int:
    llm = _llm(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    print(llm.chat(messages, _params(args), use_tqdm=False)[0].outputs[0].text)
    return 0


def chat_loop(args) -> int:
    llm, params = _llm(args), _params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": answer})
        print(f"model> {answer}", flush=True)
    return 0
