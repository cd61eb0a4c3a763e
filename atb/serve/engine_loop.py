"""The one engine thread serving every connection.

HTTP handlers never add or abort requests themselves: a step holds the
engine's lock for tens of milliseconds and the event loop must keep streaming
meanwhile. They hand ``add``/``abort`` commands to this thread, which applies them between
steps (so a new request joins the running batch at the next step and an abort
frees its blocks before the next step starts), then calls ``engine.step()``
while anything is unfinished. When nothing is, the thread sleeps on a
condition variable until a command arrives: no polling.

Each step's outputs are handed to the event loop in one
``call_soon_threadsafe`` and put on the asyncio queue of the request they
belong to. Everything about streams (the id -> queue map, the waiting count) is
touched on the event loop only.

Failure isolation: ``add_request`` raising fails that request alone. If
``step()`` itself raises, the engine cannot say which request caused it, so
every request in the engine is aborted and failed; the thread survives and
serves the next request.

Under tensor parallelism (``followers``, an ``atb.serve.tp.Leader``, which is
then also the engine) the thread sends the followers a heartbeat when it has
been idle for the leader's interval and the shutdown message when it stops;
an error of the leader's ``fatal_errors`` (a rank is gone) fails every request,
stops accepting, records itself in ``fatal`` and calls ``on_fatal`` (the
server then exits), since no step can run without the lost rank.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("atb.serve")


class QueueFull(Exception):
    """The waiting queue is at its limit (answered with 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests (answered with 503)."""


class EngineError(Exception):
    """The engine failed this request (answered with 500 or an error event)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    started: bool = False  # the first output arrived: the request left the waiting queue
    done: bool = False


@dataclass
class _Commands:
    adds: list = field(default_factory=list)  # (request_id, prompt_ids, sampling_params)
    aborts: list = field(default_factory=list)


class EngineLoop:
    """Drives ``engine`` (add_request / step / abort / has_unfinished / stats) from one thread."""

    def __init__(self, engine, max_waiting: int, followers=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.followers = followers
        self.fatal: Exception | None = None
        self.on_fatal = None   # called (on the engine thread) after a fatal error
        self._cond = threading.Condition()
        self._cmds = _Commands()
        self._busy = False  # the engine has unfinished requests (engine thread's view)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._in_engine: set[str] = set()  # engine thread only: added and not yet finished or aborted
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}  # event loop only
        self._waiting = 0  # event loop only: submitted requests with no output yet
        self.accepting = True

    # ---- lifecycle (event loop) ----------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="atb-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Stops taking requests and aborts every one in flight (their streams end at once)."""
        self.accepting = False
        for rid in list(self._streams):
            self.abort(rid, error=ShuttingDown("the server is shutting down; request aborted"))

    def begin_shutdown_threadsafe(self) -> None:
        """``begin_shutdown`` from any thread (a signal handler)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_shutdown)

    async def stop(self) -> None:
        """Joins the engine thread (after ``begin_shutdown``)."""
        self.begin_shutdown()
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ---- handlers' side (event loop) -----------------------------------------
    @property
    def queued(self) -> int:
        """Requests handed to the engine thread and not yet added to the engine (any thread)."""
        with self._cond:
            return len(self._cmds.adds)

    def submit(self, request_id: str, prompt_ids: list[int], params) -> asyncio.Queue:
        """Queues a request for the next step; its outputs (or an exception) will arrive on the returned queue."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if self._waiting >= self.max_waiting:
            raise QueueFull(f"{self._waiting} requests are already waiting (limit {self.max_waiting}); retry later")
        stream = _Stream(asyncio.Queue())
        self._streams[request_id] = stream
        self._waiting += 1
        with self._cond:
            self._cmds.adds.append((request_id, prompt_ids, params))
            self._cond.notify()
        return stream.queue

    def abort(self, request_id: str, error: Exception | None = None) -> None:
        """Aborts a request (a no-op if unknown). Its queue receives ``error`` if given, then nothing more."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if not stream.started:
            self._waiting -= 1
        if error is not None and not stream.done:
            stream.queue.put_nowait(error)
        with self._cond:
            self._cmds.aborts.append(request_id)
            self._cond.notify()

    def finished(self, request_id: str) -> None:
        """The handler is done with a request: forget it (aborting it in the engine if it still runs)."""
        stream = self._streams.get(request_id)
        if stream is not None and stream.done:
            del self._streams[request_id]
        else:
            self.abort(request_id)

    def _deliver(self, items: list) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None or stream.done:
                continue  # aborted meanwhile
            if not stream.started:
                stream.started = True
                self._waiting -= 1
            if isinstance(item, Exception) or item.finished:
                stream.done = True
            stream.queue.put_nowait(item)

    # ---- engine thread -----------------------------------------------------
    def _post(self, items: list) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _run(self) -> None:
        followers = self.followers
        heartbeat = followers.heartbeat_interval if followers is not None else None
        fatal = followers.fatal_errors if followers is not None else ()
        while True:
            with self._cond:
                while not (self._cmds.adds or self._cmds.aborts or self._busy or self._stop):
                    if not self._cond.wait(heartbeat):
                        break   # idle for a heartbeat interval (never without followers)
                if self._stop:
                    break
                cmds, self._cmds = self._cmds, _Commands()
                work = bool(cmds.adds or cmds.aborts or self._busy)
            try:
                if work:
                    self._iteration(cmds)
                else:
                    followers.heartbeat()
            except fatal as e:
                self._die(e)
                return
            except Exception as e:  # noqa: BLE001 - the loop outlives any failure
                log.exception("engine step failed; failing every request in the engine")
                self._post(self._fail_all(EngineError(f"engine step failed: {e}")))
            with self._cond:
                self._busy = self.engine.has_unfinished()
        # Shutting down: free whatever is still held, then release the followers.
        self._fail_all(None)
        if followers is not None:
            try:
                followers.shutdown()
            except fatal as e:
                log.error("could not tell the other ranks to shut down: %s", e)

    def _die(self, e: Exception) -> None:
        """A fatal error: every request fails with it and the server is told to stop."""
        log.error("%s; stopping the server", e)
        self.fatal = e
        self.accepting = False
        self._post(self._fail_all(EngineError(str(e))))
        if self.on_fatal is not None:
            self.on_fatal()

    def _iteration(self, cmds: _Commands) -> None:
        """Applies aborts, then adds (each failing alone), then one engine step; posts what came out."""
        engine = self.engine
        aborted = set(cmds.aborts)
        for rid in cmds.aborts:
            if rid in self._in_engine:
                self._in_engine.discard(rid)
                try:
                    engine.abort(rid)
                except Exception:  # noqa: BLE001 - the other commands still apply
                    log.exception("abort of %s failed", rid)
        failed, added = [], False
        for rid, ids, params in cmds.adds:
            if rid in aborted:
                continue  # gone before it was ever scheduled
            try:
                engine.add_request(ids, params, request_id=rid)
                self._in_engine.add(rid)
                added = True
            except Exception as e:  # noqa: BLE001 - fails this request only
                log.warning("request %s rejected by the engine: %s", rid, e)
                failed.append((rid, EngineError(str(e))))
        self._post(failed)
        # A request finished as it was added (nothing to generate) is reported by the next step all the same.
        if engine.has_unfinished() or added:
            outputs = engine.step()
            self._in_engine.difference_update(o.request_id for o in outputs if o.finished)
            self._post([(o.request_id, o) for o in outputs])

    def _fail_all(self, error: Exception | None) -> list:
        """Aborts every request the engine holds; returns (id, error) items for their streams."""
        engine, items = self.engine, []
        for rid in self._in_engine:
            try:
                engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", rid)
            items.append((rid, error))
        self._in_engine.clear()
        return items
