"""`AsyncEngine`: the `LLMEngine` on its own thread, driven from asyncio.

The engine is not thread-safe, so exactly one thread (started by `start()`) ever touches it.
Everything else reaches it through a command queue of closures run between steps:

    asyncio ── add / abort / inspect ──> command queue ──> engine thread: commands, step(), repeat
       ^                                                       │
       └──── loop.call_soon_threadsafe(RequestStream._put) <───┘  (one per request, per step)

The thread sleeps on an event while it has no work. `add_request` returns a `RequestStream`
once the engine accepted the request (its `ValueError` is re-raised in the caller). Outputs
are cumulative, so a consumer that falls behind reads only the newest one. After each loop
iteration the thread records a heartbeat and, at most every `SNAPSHOT_INTERVAL_S`, a snapshot
of the engine's state (`LLMEngine.stats()`), which readers on other threads (health, metrics) may use freely.

A step that fails ends only its own requests (engine.py): their streams raise `RequestFailed`.
If the thread itself dies, every stream raises `EngineDeadError`, `failure` says why, and
`on_death` (set by the server's runner) is called once, on the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..sampling_params import SamplingParams
from .engine import STEP_ERROR, EngineStats, LLMEngine
from .request import RequestOutput

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.2

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a step raised)."""


class RequestFailed(RuntimeError):
    """A step of this request raised; the engine serves on (the cause is in the server's log)."""


class RequestAborted(Exception):
    """The request was aborted before it finished (by the caller or at shutdown)."""


class StepObserver(Protocol):
    """Called on the engine thread (metrics); must be quick and must not touch the engine."""

    def on_add(self, request_id: str, now: float) -> None: ...
    def on_step(self, outputs: list[RequestOutput], schedule: str, now: float) -> None: ...
    def on_remove(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the finished output.
    Raises `RequestAborted` if the request was aborted, `EngineDeadError` if the engine died."""

    def __init__(self, request_id: str, engine: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.request_id, self._engine, self.loop = request_id, engine, loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()  # cumulative outputs: the newest is enough
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; idempotent."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None):
        self._engine, self._observer = engine, observer
        self.tokenizer, self.model_name = engine.tokenizer, engine.model_name
        self.max_model_len = engine.max_model_len
        self.backend_name = engine.backend_name
        # (command, the future of its result; None: fire and forget)
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any] | None]] = \
            collections.deque()
        self._lock = threading.Lock()  # guards _commands' closing: no command is queued after the last drain
        self._stopped = False
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._loop, name="prefixserve-engine", daemon=True)
        self._closing = False
        self._error: BaseException | None = None
        self._busy = False
        self._heartbeat = time.monotonic()
        self.on_death: Callable[[], None] | None = None
        self._snapshot_time = 0.0
        self.snapshot: EngineStats = engine.stats()

    # ---- lifecycle (any thread / the event loop) -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        """From now on add_request raises EngineDeadError and health() reports shutting down."""
        self._closing = True

    def abort_all(self) -> None:
        """Abort every request in flight; their streams raise RequestAborted."""
        self._submit(self._abort_all)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting requests, abort those in flight, and join the engine thread."""
        self.stop_accepting()
        self._submit(self._stop)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)
        log.info("engine thread stopped")

    @property
    def failure(self) -> str | None:
        """Why the engine thread died (None: it has not)."""
        return None if self._error is None else f"engine failed: {self._error!r}"

    def health(self, stall_timeout: float) -> str | None:
        """None when healthy; else why not: the thread is gone, or it has work but no step
        finished within `stall_timeout` seconds."""
        if self._error is not None:
            return self.failure
        if self._closing:
            return "the server is shutting down"
        if not self._thread.is_alive():
            return "engine is not running"
        stalled = time.monotonic() - self._heartbeat
        if self._busy and stalled > stall_timeout:
            return f"engine has made no progress for {stalled:.0f} s"
        return None

    @property
    def max_sequence_tokens(self) -> int:
        return self._engine.max_sequence_tokens  # one int read; it shrinks as prefixes are pinned

    # ---- requests (the event loop) ---------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          tenant: str = "", cache_salt: str = "") -> RequestStream:
        """Raises ValueError (bad input, from the engine) or EngineDeadError. The request shares
        cached prefixes only within (tenant, cache_salt) and with public pins."""
        return await self._start(request_id, lambda: self._engine.add_request(
            request_id, prompt, params, tenant=tenant, cache_salt=cache_salt))

    async def pin(self, pin_id: str, prompt: list[int], **kwargs: Any) -> dict[str, Any]:
        """Pin a prefix (LLMEngine.add_pin's keywords) and wait until it is settled; its info().
        ValueError: refused (quota, bad ttl, or no room: then nothing is pinned)."""
        stream = await self._start(pin_id, lambda: self._engine.add_pin(pin_id, prompt, **kwargs))
        try:
            out = [o async for o in stream][-1]
        finally:
            stream.abort()
        if out.outputs[0].finish_reason != "pinned":
            raise ValueError(f"the pin of {len(prompt)} tokens does not fit in the KV cache beside the pinned "
                             f"prefixes and the requests that may run")
        return await asyncio.wrap_future(self._call(lambda: self._pin_info(pin_id)))

    async def unpin(self, pin_id: str, owner: str | None) -> dict[str, Any]:
        """Remove the owner's pin (None: anyone's); ValueError if there is none."""
        return await asyncio.wrap_future(self._call(lambda: self._engine.unpin(pin_id, owner).info()))

    async def list_pins(self, owner: str | None) -> list[dict[str, Any]]:
        return await asyncio.wrap_future(self._call(lambda: [p.info() for p in self._engine.list_pins(owner)]))

    def _pin_info(self, pin_id: str) -> dict[str, Any]:
        pin = self._engine.pins.pins.get(pin_id)
        if pin is None:
            raise ValueError(f"the pin {pin_id!r} expired before it could be reported: give a longer ttl")
        return pin.info()

    async def _start(self, request_id: str, add: Callable[[], Any]) -> RequestStream:
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        future = self._call(lambda: self._add(stream, add))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away while the engine was busy
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id, RequestAborted(request_id)))

    async def inspect(self, timeout: float | None = None) -> dict[str, Any]:
        """check_integrity() and kv_cache_stats() on the engine thread (health detail, tests);
        raises AssertionError if the integrity check fails."""
        return await asyncio.wait_for(asyncio.wrap_future(self._call(self._inspect)), timeout)

    # ---- helpers ----------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        if self._closing:
            raise EngineDeadError(self.health(0.0) or "engine is not running")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(fn, future)
        return future

    def _submit(self, fn: Callable[[], Any], future: concurrent.futures.Future[Any] | None = None) -> None:
        with self._lock:
            if self._stopped:
                if future is not None:
                    future.set_exception(EngineDeadError(self.health(0.0) or "engine is not running"))
                return
            self._commands.append((fn, future))
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._run_commands():
                self._busy = self._engine.has_unfinished()
                self._heartbeat = time.monotonic()
                if self._busy:
                    self._step()
                else:
                    self._publish(force=True)
                    self._wake.wait()
        except BaseException as e:  # reported through health and every stream
            log.exception("engine step failed; the engine is stopped")
            self._error = e
            self._fail_all(EngineDeadError(f"engine failed: {e!r}"))
        finally:
            self._close_commands()
        if self._error is not None and self.on_death is not None:
            self.on_death()

    def _run_commands(self) -> bool:
        """Run the queued commands; False once the stop command ran."""
        self._wake.clear()
        while self._commands:
            fn, future = self._commands.popleft()
            if future is None:
                if fn() is False:
                    return False
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # handed to the caller
                    future.set_exception(e)
        return True

    def _close_commands(self) -> None:
        with self._lock:
            self._stopped = True
        error = EngineDeadError("engine is not running")
        for _, future in self._commands:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._commands.clear()

    def _step(self) -> None:
        outputs = self._engine.step()
        now = time.monotonic()
        if self._observer is not None:
            self._observer.on_step(outputs, self._engine.last_schedule, now)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                failed = out.finished and any(c.finish_reason == STEP_ERROR for c in out.outputs)
                self._send(stream, RequestFailed(f"request {out.request_id} failed in an engine step") if failed
                           else out)
            if out.finished:
                self._forget(out.request_id)
        self._publish(force=False)

    def _add(self, stream: RequestStream, add: Callable[[], Any]) -> None:
        add()
        self._streams[stream.request_id] = stream
        if self._observer is not None:
            self._observer.on_add(stream.request_id, time.monotonic())

    def _abort(self, request_id: str, reason: BaseException) -> None:
        self._engine.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            self._send(stream, reason)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self._streams[request_id]
        if self._observer is not None:
            self._observer.on_remove(request_id)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, RequestAborted("the server is shutting down"))

    def _stop(self) -> bool:
        self._abort_all()
        return False

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            self._send(stream, error)
        self._streams.clear()

    @staticmethod
    def _send(stream: RequestStream, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream._put, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._snapshot_time >= SNAPSHOT_INTERVAL_S:
            self.snapshot, self._snapshot_time = self._engine.stats(), now

    def _inspect(self) -> dict[str, Any]:
        self._engine.check_integrity()
        snap = self._engine.stats()
        return {"integrity": "ok", "running": snap.running_requests, "waiting": snap.waiting_requests,
                "streams": len(self._streams), **dataclasses.asdict(snap.kv)}
