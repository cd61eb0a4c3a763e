"""Serving under tensor parallelism: rank 0 serves HTTP, the other ranks follow its engine steps.

    torchrun --nproc-per-node 2 -m atb serve --tp 2 --model DIR

Every rank holds a shard of the model and runs the same engine, so the
collectives inside a step (the all-reduces after o/down, the logits gather or
argmax reduction) line up only if every rank makes the same engine calls in
the same order. Rank 0's engine thread is the only one that decides: it wraps
its engine in a `Leader`, which records each ``add_request`` / ``abort`` that
succeeded and, before each ``step()``, broadcasts them with the command to
step; a `follow` loop on every other rank applies them and steps too.

Wire format, over the tp group (``torch.distributed.broadcast`` from rank 0):
a header of two int64 (command, payload length), then, only when requests
were added or aborted since the last message, the pickled list of those
changes as a uint8 tensor. A plain decode step is one 16-byte broadcast;
``torch.distributed.broadcast_object_list`` always costs two broadcasts and a
pickle (``python -m atb.bench.tp --control`` measures both).

Lifetime:

* Idle, rank 0 sends a heartbeat (``NOOP``) every ``heartbeat`` seconds, so a
  follower waiting for the next command never reaches the group's timeout,
  and a rank 0 that hangs is noticed within it.
* SIGTERM/SIGINT on rank 0 shuts the server down gracefully; its engine
  thread then sends ``SHUTDOWN`` and every follower returns normally.
* A follower that receives SIGTERM/SIGINT keeps following, for up to
  ``grace`` seconds, so that rank 0 (usually signalled at the same moment, by
  torchrun or a terminal) can shut everyone down cleanly; then it leaves, and
  rank 0 fails at its next message.
* A rank that dies makes every collective of the others fail
  (`TensorParallelError`, at once when its connection closes, else within the
  group's timeout): rank 0 fails the requests in flight, stops the server and
  exits with that error; a follower exits with it.
"""
from __future__ import annotations

import logging
import pickle
import signal
import time

import torch

from atb.distributed import TensorParallelError

log = logging.getLogger("atb.serve")

NOOP, STEP, SHUTDOWN = 0, 1, 2


class ControlStats:
    """Time rank 0 spends broadcasting control messages (the per-step cost of following)."""

    def __init__(self):
        self.messages = 0
        self.payloads = 0       # messages that carried added/aborted requests
        self.seconds = 0.0

    def line(self) -> str:
        mean = self.seconds / self.messages * 1e6 if self.messages else 0.0
        return (f"tp control: {self.messages} messages ({self.payloads} with requests), "
                f"{mean:.0f} us each on average")


class _Channel:
    """The broadcast protocol over a `TensorParallel` group's collectives (its timeout and errors)."""

    def __init__(self, tp):
        self.tp = tp
        dist = tp._dist
        self._src = 0 if tp.group is None else dist.get_global_rank(tp.group, 0)
        self._header = torch.zeros(2, dtype=torch.int64)

    def _bcast(self, what: str, t: torch.Tensor) -> None:
        self.tp._run(f"broadcast ({what})", lambda: self.tp._dist.broadcast(t, self._src, group=self.tp.group))

    def send(self, command: int, changes: list) -> None:
        payload = pickle.dumps(changes, protocol=pickle.HIGHEST_PROTOCOL) if changes else b""
        self._header[0], self._header[1] = command, len(payload)
        self._bcast("serve control", self._header)
        if payload:
            self._bcast("serve requests", torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def receive(self) -> tuple[int, list]:
        self._bcast("serve control", self._header)
        command, n = int(self._header[0]), int(self._header[1])
        if not n:
            return command, []
        buf = torch.empty(n, dtype=torch.uint8)
        self._bcast("serve requests", buf)
        return command, pickle.loads(buf.numpy().tobytes())


class Leader:
    """Rank 0's engine as the server sees it: the engine's calls, with every change mirrored to the followers.

    ``add_request`` and ``abort`` act on the local engine at once (so errors surface to the caller) and are
    recorded; ``step`` first broadcasts the recorded changes with ``STEP``. Everything else (``stats``,
    ``max_seq_len``, ...) is the engine's own. All collectives are made by the one thread that steps.
    """

    def __init__(self, engine, tp, heartbeat: float):
        self._engine = engine
        self._channel = _Channel(tp)
        self._changes: list = []
        self.heartbeat_interval = heartbeat
        self.fatal_errors = (TensorParallelError,)
        self.control = ControlStats()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt_ids, sampling_params=None, request_id=None) -> str:
        rid = self._engine.add_request(prompt_ids, sampling_params, request_id=request_id)
        self._changes.append(("add", rid, [int(t) for t in prompt_ids], sampling_params))
        return rid

    def abort(self, request_id: str) -> bool:
        found = self._engine.abort(request_id)
        if found:
            self._changes.append(("abort", request_id))
        return found

    def stats(self) -> dict:
        """The engine's stats plus the control broadcast counters (``/metrics`` shows them)."""
        return dict(self._engine.stats(), tp_control_messages=self.control.messages,
                    tp_control_seconds=self.control.seconds)

    def _send(self, command: int) -> None:
        changes, self._changes = self._changes, []
        t0 = time.perf_counter()
        self._channel.send(command, changes)
        self.control.seconds += time.perf_counter() - t0
        self.control.messages += 1
        self.control.payloads += bool(changes)

    def step(self):
        self._send(STEP)
        return self._engine.step()

    def heartbeat(self) -> None:
        self._send(NOOP)

    def shutdown(self) -> None:
        self._send(SHUTDOWN)
        log.info("%s", self.control.line())


def follow(engine, tp, grace: float = 15.0) -> None:
    """A follower rank's life: apply rank 0's changes and step with it until it says ``SHUTDOWN``.

    Raises `TensorParallelError` when rank 0 (or another rank) is gone, and RuntimeError when this rank's
    engine refuses a change rank 0's accepted (the ranks would no longer make the same collectives).
    """
    channel = _Channel(tp)
    signalled: list[float] = []

    def on_signal(signum, _frame):
        if not signalled:
            log.info("rank %d: %s received; following rank 0 for up to %g s more", tp.rank,
                        signal.Signals(signum).name, grace)
            signalled.append(time.monotonic())

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            command, changes = channel.receive()
            for change in changes:
                try:
                    if change[0] == "add":
                        engine.add_request(change[2], change[3], request_id=change[1])
                    else:
                        engine.abort(change[1])
                except Exception as e:
                    raise RuntimeError(f"tensor parallel serve: rank {tp.rank} could not apply rank 0's "
                                       f"{change[0]} of request {change[1]!r}: {e}") from e
            if command == SHUTDOWN:
                return
            if command == STEP:
                try:
                    engine.step()
                except TensorParallelError:
                    raise
                except Exception:   # noqa: BLE001 - rank 0 hit it too and aborts the requests in the engine
                    log.exception("rank %d: engine step failed", tp.rank)
            if signalled and time.monotonic() - signalled[0] > grace:
                log.warning("rank %d: rank 0 did not shut down within %g s of the signal; leaving", tp.rank,
                            grace)
                return
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
