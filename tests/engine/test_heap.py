"""An engine freezes the heap it starts with (heap.py): the modules' and the model's objects
stay out of the full collections that would otherwise stall a step, and a closed engine gives
them back, so that what it held in cycles is collected."""

from __future__ import annotations

import gc
import weakref

from prefixserve import LLM


def test_an_engine_freezes_its_start_up_heap_and_a_closed_one_is_collected():
    gc.unfreeze()  # (whatever an earlier test's engine left frozen)
    llm = LLM(kv_cache_memory=64 << 20)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 100_000  # torch's, transformers' and the model's objects: ~316K
        assert len(gc.get_objects()) < frozen // 10  # a full collection walks the rest only
        assert llm.generate("The capital of France is")[0].outputs[0].token_ids  # it serves so
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
    pool = weakref.ref(llm.engine.pool)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None and pool() is None


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


def test_an_engine_dropped_without_close_is_freed_and_the_next_collects_its_cycles():
    """A notebook that builds a second LLM without closing the first: the first engine holds no
    reference cycle, so dropping it frees it and its KV pool although the heap it froze stays
    frozen; a cycle frozen with it (here one alive when it started) is collected once the next
    engine starts, before that one allocates its pool."""
    gc.unfreeze()
    alive = _Cyclic()  # (a cycle: once dropped, only the collector frees it)
    cycle = weakref.ref(alive)
    llm = LLM(kv_cache_memory=64 << 20)
    engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.pool)
    del llm, alive
    gc.collect()
    assert engine() is None and pool() is None
    assert cycle() is not None and gc.get_freeze_count() > 100_000  # frozen with the first engine
    with LLM(kv_cache_memory=64 << 20):
        assert cycle() is None
