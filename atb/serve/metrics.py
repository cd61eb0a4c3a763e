"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Counters and histograms are updated on the event loop as tokens are delivered;
gauges (running, waiting, KV blocks) are read from the engine when scraped.
Written out by hand: the format is a few lines per metric and does not need
the ``prometheus_client`` package.
"""
from __future__ import annotations

import bisect
import threading

PREFIX = "atb_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip([*map(_num, self.buckets), "+Inf"], self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


class Metrics:
    """What the server counts; ``render(engine_stats)`` gives the ``/metrics`` text."""

    def __init__(self):
        self._lock = threading.Lock()  # updates come from the event loop, scrapes from a worker thread
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.rejected: dict[int, int] = {}  # HTTP status -> requests refused before reaching the engine
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.ttft.observe(seconds)

    def tokens(self, n: int, seconds_each: float | None) -> None:
        """``n`` output tokens delivered; ``seconds_each`` is the time per token since the previous delivery."""
        with self._lock:
            self.generation_tokens += n
            if seconds_each is not None:
                for _ in range(n):
                    self.tpot.observe(seconds_each)

    def finish(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.latency.observe(seconds)

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def render(self, stats: dict) -> str:
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {PREFIX}{name} {help_}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            lines.extend(f"{PREFIX}{name}{s}" for s in samples)

        gauges = (("requests_running", "running", "Requests in the running batch."),
                  ("requests_prefilling", "prefilling",
                   "Requests in the running batch whose prompt is still being prefilled in chunks."),
                  ("requests_waiting", "waiting", "Requests waiting to be admitted to the batch."),
                  ("kv_blocks_total", "kv_blocks_total", "KV cache blocks in the pool."),
                  ("kv_blocks_used", "kv_blocks_used", "KV cache blocks held by requests."),
                  ("kv_blocks_free", "kv_blocks_free", "KV cache blocks free."),
                  ("kv_blocks_cached", "kv_blocks_cached",
                   "KV cache blocks held by no request, kept for prefix reuse until the pool needs them."))
        for name, key, help_ in gauges:
            metric(name, "gauge", help_, [f" {stats[key]}"])
        counters = (("prefix_cache_queries_total", "prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache on admission."),
                    ("prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                    ("spec_decode_steps_total", "spec_decode_steps",
                     "Speculative decoding: decode steps that verified draft tokens."),
                    ("spec_decode_draft_tokens_total", "spec_draft_tokens", "Speculative decoding: draft tokens verified."),
                    ("spec_decode_accepted_tokens_total", "spec_accepted_tokens",
                     "Speculative decoding: draft tokens accepted (each one a decode step saved)."))
        for name, key, help_ in counters:
            metric(name, "counter", help_, [f" {stats.get(key, 0)}"])
        if "tp_control_messages" in stats:   # serving under tensor parallelism (atb.serve.tp)
            metric("tp_control_messages_total", "counter", "Control messages rank 0 broadcast to the other ranks.",
                   [f" {stats['tp_control_messages']}"])
            metric("tp_control_seconds_total", "counter", "Time rank 0 spent broadcasting control messages.",
                   [f" {stats['tp_control_seconds']:.6f}"])
        with self._lock:
            metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [f" {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Output tokens generated.", [f" {self.generation_tokens}"])
            metric("requests_finished_total", "counter", "Requests finished, by reason.",
                   [f'{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())] or [' 0'])
            metric("requests_rejected_total", "counter", "Requests refused before reaching the engine, by status.",
                   [f'{{status="{s}"}} {n}' for s, n in sorted(self.rejected.items())] or [' 0'])
            for name, hist, help_ in (
                    ("time_to_first_token_seconds", self.ttft, "Time from arrival to the first output token."),
                    ("time_per_output_token_seconds", self.tpot, "Time between output tokens of a request."),
                    ("request_latency_seconds", self.latency, "Time from arrival to the last output token.")):
                lines.append(f"# HELP {PREFIX}{name} {help_}")
                lines.append(f"# TYPE {PREFIX}{name} histogram")
                lines.extend(hist.lines(PREFIX + name))
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """``{sample name with labels: value}`` of a ``/metrics`` text (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
