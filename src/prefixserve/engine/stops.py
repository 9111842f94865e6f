"""When a sequence stops, checked after each sampled token (in this order: a stop string in the
text, a stop token, the length limits)."""

from __future__ import annotations

from .detokenizer import check_stop_strings
from .request import Sequence


def check_stop(seq: Sequence, token: int, delta: str, eos_token_ids: tuple[int, ...],
               max_model_len: int) -> str | None:
    """Updates `seq.text` with `delta` (cut at a stop string) and returns the finish reason, if any.
    `token` is the newest output token read (later ones may be pending). Stop strings and tokens
    count only once `min_tokens` are out; `max_tokens` is resolved (not None)."""
    p = seq.params
    text = seq.text + delta
    n_out = seq.num_read
    if p.stop and delta and n_out >= p.min_tokens:
        res = check_stop_strings(text, delta, p.stop, p.include_stop_str_in_output)
        seq.text = res.text
        if res.stop_str is not None:
            return "stop"
    else:
        seq.text = text
    if n_out >= p.min_tokens and (token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos)):
        return "stop"
    if n_out >= seq.max_tokens or len(seq.prompt_token_ids) + n_out >= max_model_len:
        return "length"
    return None
