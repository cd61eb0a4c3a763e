"""`atb serve` under load: throughput and latency through HTTP at several concurrencies.

    python -m atb.bench.serve [--dtype bfloat16] [--quantize SPEC] [--concurrency 1,4,16,32]
                              [--requests-per-client 2] [--prompt 128] [--new 128] [--threads N]
                              [--max-prefill-tokens N]
                              [--rounds 3] [--overhead-rounds 3] [--json PATH]

Starts ``python -m atb serve`` as a subprocess on 127.0.0.1 (the load
generator here shares no interpreter lock with the engine), then, for each
concurrency C, runs C clients that each send ``--requests-per-client``
streaming completions back to back: random ``--prompt``-token prompts (token
ids, so every prompt has exactly that length), ``--new`` output tokens with
EOS ignored. The levels take turns for ``--rounds`` rounds. Reported per level,
as medians over the rounds: requests/s and output tok/s over the level's wall
time, time to first token (request sent -> first text chunk) and inter-token
latency (gaps between chunks) at p50/p99; the scaling from concurrency 1 to 16
is the median of the rounds' ratios.

Finally (when concurrency 1 is among the levels), with the server still up but
idle, the same prompt runs in turns through one HTTP request and through
``TransformerInfer.generate`` in this process (batch 1, same dtype and
lengths), ``--overhead-rounds`` times: one minus the median of the per-round
ratios of their tok/s is the HTTP overhead. The machine is shared and its
speed drifts, so read the ratios, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary tokens only (ids below 17 are SmolLM2's special tokens).
    return torch.randint(17, vocab, (n, length), generator=g).tolist()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "atb", "serve", "--dtype", args.dtype, "--port", str(port), "--quiet",
           "--max-batch-size", str(max(args.concurrency)), "--max-seq-len", str(args.prompt + args.new),
           "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.max_prefill_tokens:
        cmd += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    proc = subprocess.Popen(cmd)
    import httpx

    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"atb serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("atb serve did not come up in 300 s")
        time.sleep(0.5)


class _Connection:
    """One keep-alive HTTP/1.1 connection that streams a completion's server-sent events.

    A load generator on the same 2 cores as the server takes CPU from it: httpx's streaming client cost
    about a third of a core at 16 streams (~1 ms per chunk), which the server's kernels then lost. This
    reads the chunked body and its ``data:`` lines straight off an asyncio stream.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()

    async def stream(self, path: str, body: dict):
        """POSTs body as JSON; yields each event's data line (bytes, without ``data: ``) until the body ends."""
        if self.writer is None:
            await self._open()
        payload = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        if headers.get("transfer-encoding", "").lower() != "chunked":
            data = await self.reader.readexactly(int(headers.get("content-length", 0)))
            raise RuntimeError(f"HTTP {status}: {data[:500]!r}")
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        pending = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # the empty trailer
                break
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: "):
                    yield line[6:]


async def _one(conn: _Connection, prompt: list[int], new: int) -> dict:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    async for data in conn.stream("/v1/completions", body):
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0]["text"]:
            stamps.append(time.perf_counter())
    t1 = time.perf_counter()
    return {"ttft": stamps[0] - t0 if stamps else t1 - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens, "seconds": t1 - t0}


def _median_level(runs: list[dict]) -> dict:
    """One level's rounds as one row: the median of each measure over the rounds."""
    return {k: (statistics.median(r[k] for r in runs) if k.endswith(("_s", "_per_s")) else runs[0][k])
            for k in runs[0]} | {"rounds": len(runs)}


async def run_level(port: int, prompts: list[list[int]], concurrency: int, per_client: int, new: int) -> dict:
    conns = [_Connection("127.0.0.1", port) for _ in range(concurrency)]
    try:
        await _one(conns[0], prompts[0], 4)  # warm connection and engine

        async def worker(w: int) -> list[dict]:
            return [await _one(conns[w], prompts[(w * per_client + i) % len(prompts)], new) for i in range(per_client)]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*[worker(w) for w in range(concurrency)]) for r in rs]
        wall = time.perf_counter() - t0
    finally:
        for c in conns:
            await c.close()
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall, "output_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99)}


class InProcess:
    """``TransformerInfer.generate`` in this process on one prompt (batch 1), for the HTTP overhead.

    Every call runs on one worker thread, as the server's engine thread runs, so that the ratio to HTTP
    isolates the HTTP path. (On the 2-core host of 2026-11-30 under a load average of ~14, generate from
    the main thread was 10-80x slower than from a worker thread unless OMP_WAIT_POLICY=PASSIVE: the main
    thread's libgomp team spin-waits against the other processes. That cost is not HTTP's.)"""

    def __init__(self, args):
        self.args = args
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.infer = self.pool.submit(self._load).result()

    def _load(self):
        import atb
        from atb.checkpoints import load_model

        model, _ = load_model(dtype=_DTYPES[self.args.dtype])
        if self.args.threads:
            atb.set_num_threads(self.args.threads)
        infer = atb.TransformerInfer(model, max_seq_len=self.args.prompt + self.args.new, max_batch_size=1,
                                     quantize=self.args.quantize)
        # One decode step per engine step, as the server steps, so that the ratio is the HTTP path's alone
        # (generate's native multi-step decode would count its own gain against HTTP).
        infer.generate_decode_steps = 1
        return infer

    def tok_s(self, prompt: list[int]) -> float:
        """Output tok/s of one generate, prefill included (as an HTTP request's time includes it)."""
        def run():
            t0 = time.perf_counter()
            out = self.infer.generate([prompt], max_new_tokens=self.args.new, eos_token_id=[])[0]
            return len(out) / (time.perf_counter() - t0)
        return self.pool.submit(run).result()

    def close(self):
        self.pool.shutdown()


def http_overhead(port: int, args, prompt: list[int], rounds: int) -> dict:
    """HTTP at concurrency 1 against in-process generate, in turns: one request, then one generate, per
    round. The machine's speed drifts by tens of percent over minutes, so the two are measured side by
    side and the overhead is one minus the median of the per-round ratios."""
    local = InProcess(args)
    try:
        local.tok_s(prompt)  # warm-up: kernels, routing, the KV pool
        http, inproc = [], []
        for _ in range(rounds):
            http.append(asyncio.run(run_level(port, [prompt], 1, 1, args.new))["output_tok_s"])
            inproc.append(local.tok_s(prompt))
    finally:
        local.close()
    ratio = statistics.median(h / i for h, i in zip(http, inproc))
    return {"http_tok_s": statistics.median(http), "in_process_tok_s": statistics.median(inproc),
            "http_over_in_process_c1": ratio}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m atb.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--quantize", default=None,
                   help="the server's (and the in-process reference's) --quantize: w8a16 | w4a16[-gN] | native")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=128, help="output tokens per request")
    p.add_argument("--threads", type=int, default=0, help="atb threads in the server (default: torch's)")
    p.add_argument("--max-prefill-tokens", type=int, default=0,
                   help="the server's per-step prefill budget (default: the server's own)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the levels, in turns (medians)")
    p.add_argument("--overhead-rounds", type=int, default=3,
                   help="rounds of one HTTP request and one in-process generate, in turns (HTTP overhead)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if (min(args.concurrency) < 1 or args.requests_per_client < 1 or args.prompt < 1 or args.new < 2
            or args.overhead_rounds < 1 or args.rounds < 1):
        p.error("--concurrency values, --requests-per-client, --prompt, --rounds and --overhead-rounds must be "
                ">= 1, --new >= 2")

    port = _free_port()
    prompts = _prompts(max(args.concurrency) * args.requests_per_client, args.prompt, 49152, seed=0)
    server = start_server(args, port)
    runs = {c: [] for c in args.concurrency}
    try:
        # The levels take turns, round by round: the machine's speed drifts over minutes, so each level's
        # medians cover the same stretch of time and the ratios between levels hold.
        for _ in range(args.rounds):
            for c in args.concurrency:
                runs[c].append(asyncio.run(run_level(port, prompts, c, args.requests_per_client, args.new)))
        rows = [_median_level(runs[c]) for c in args.concurrency]
        for r in rows:
            print(f"concurrency {r['concurrency']:>3}: {r['requests_per_s']:6.2f} req/s {r['output_tok_s']:8.1f} "
                  f"out tok/s  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms p99 {r['ttft_p99_s'] * 1e3:7.1f} ms  "
                  f"ITL p50 {r['itl_p50_s'] * 1e3:6.1f} ms p99 {r['itl_p99_s'] * 1e3:6.1f} ms", flush=True)
        by_c = {r["concurrency"]: r for r in rows}
        overhead = http_overhead(port, args, prompts[0], args.overhead_rounds) if 1 in by_c else None
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    summary = {"dtype": args.dtype, "quantize": args.quantize, "prompt": args.prompt, "new": args.new, "cpu_count": os.cpu_count(),
               "levels": rows}
    if overhead:
        summary.update(overhead)
        ratio = overhead["http_over_in_process_c1"]
        print(f"HTTP at concurrency 1 against in-process generate (batch 1), {args.overhead_rounds} rounds in "
              f"turns: {overhead['http_tok_s']:.1f} against {overhead['in_process_tok_s']:.1f} tok/s; median "
              f"per-round ratio {ratio:.3f} (overhead {100 * (1 - ratio):.1f}%)")
    if 1 in runs and 16 in runs:
        scaling = statistics.median(a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[16], runs[1]))
        summary["scaling_c16_over_c1"] = scaling
        print(f"output tok/s at concurrency 16 / concurrency 1 (median of {args.rounds} rounds' ratios): "
              f"{scaling:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
