"""The FastAPI app: OpenAI's completions and chat completions over one engine loop.

    app = create_app(infer, tokenizer, model_name="SmolLM2-135M-Instruct")
    run(app, host="127.0.0.1", port=8000)      # uvicorn; SIGINT/SIGTERM shut down gracefully

Every request is validated in full (fields, prompt length against
``max_seq_len``, sampling values) before it reaches the engine; what is wrong
is answered with OpenAI's error JSON naming the field. A request that passes
is queued on the engine loop (429 when the waiting queue is full) and joins
the running batch at the next engine step.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atb.engine import SamplingParams, TokenLogprob
from atb.engine.sampling import request_seed
from atb.serve import protocol as P
from atb.serve.detokenize import IncrementalDetokenizer, StopStrings
from atb.serve.engine_loop import EngineError, EngineLoop, QueueFull, ShuttingDown
from atb.serve.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("atb.serve")

# The engine's finish reasons in OpenAI's words.
_FINISH = {"eos": "stop", "grammar": "stop", "length": "length", "max_seq_len": "length"}


class ServerState:
    """What the handlers share: the engine loop, the tokenizer, limits and metrics."""

    def __init__(self, engine, tokenizer, model_name: str, max_waiting: int, followers=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_len = engine.max_seq_len
        self.loop = EngineLoop(engine, max_waiting=max_waiting, followers=followers)
        self.metrics = Metrics()
        self.created = int(time.time())


class Piece(NamedTuple):
    """Text that became final, and the TokenLogprob of each token generated since the last piece (empty unless
    the request asked for logprobs). The tokens' logprobs run up to and including the token that finished the
    request, one that completed a stop string included, while text held back (an incomplete UTF-8 sequence,
    a possible stop string's start) comes in a later piece. An echoed prompt is a choice's first piece, its
    first token a bare id (it has no log-probability)."""
    text: str
    logprobs: list[TokenLogprob | int]


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def completion_logprobs(tokenizer, lps: list[TokenLogprob | int], offset: int) -> P.CompletionLogprobs:
    """The legacy endpoint's logprobs object for ``lps`` (a bare token id has no log-probability: null), text
    offsets counted from ``offset``."""
    tokens = [token_text(tokenizer, lp if isinstance(lp, int) else lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return P.CompletionLogprobs(
        tokens=tokens, token_logprobs=[None if isinstance(lp, int) else lp.logprob for lp in lps],
        text_offset=offsets,
        top_logprobs=[None if isinstance(lp, int) else {token_text(tokenizer, t): v for t, v in lp.top}
                      for lp in lps])


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> P.ChatLogprobs:
    def entry(token_id: int, logprob: float, cls=P.ChatTopLogprob, **extra):
        text = token_text(tokenizer, token_id)
        return cls(token=text, logprob=logprob, bytes=list(text.encode("utf-8")), **extra)

    return P.ChatLogprobs(content=[
        entry(lp.token_id, lp.logprob, P.ChatTokenLogprob, top_logprobs=[entry(t, v) for t, v in lp.top])
        for lp in lps])


class Generation:
    """One choice of a request, from validated fields to text pieces: tokens in, detokenized, stop strings
    cut, metrics. ``engine_id`` is its engine request; ``seed`` its own (a request's n choices draw apart);
    ``echo`` the prompt's text to start the choice's text with (None: not echoed)."""

    def __init__(self, state: ServerState, req: P._Request, prompt_ids: list[int], max_tokens: int | None,
                 engine_id: str, t_arrival: float, max_tokens_field: str = "max_tokens", seed: int | None = None,
                 echo: str | None = None):
        self.state = state
        self.id = engine_id
        self.prompt_ids = prompt_ids
        self.t0 = t_arrival
        self.created = int(time.time())
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.ttft: float | None = None
        self._released = False
        self._echo = echo
        room = state.max_seq_len - len(prompt_ids)
        if room < (max_tokens != 0):
            param = "messages" if isinstance(req, P.ChatCompletionRequest) else "prompt"
            raise P.APIError(400, f"{param}: the prompt has {len(prompt_ids)} tokens; this model's context is "
                                  f"{state.max_seq_len} tokens and at least one must be left for the output",
                             param=param)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise P.APIError(400, f"{max_tokens_field}: {max_tokens} plus the prompt's {len(prompt_ids)} tokens "
                                  f"exceeds this model's context of {state.max_seq_len} tokens (at most {room})",
                             param=max_tokens_field)
        if req.min_tokens > max_tokens:
            raise P.APIError(400, f"min_tokens: {req.min_tokens} is more than the {max_tokens} tokens this prompt "
                                  f"leaves room for", param="min_tokens")
        stops = req.stop_token_ids or []
        outside = [t for t in stops if not 0 <= t < state.engine.vocab_size]
        if outside:
            raise P.APIError(400, f"stop_token_ids: token id {outside[0]} is outside the vocabulary "
                                  f"[0, {state.engine.vocab_size})", param="stop_token_ids")
        # stop_token_ids end the output beside the model's EOS (and still do under ignore_eos, as in vLLM).
        eos = ([] if req.ignore_eos else list(state.engine.runner.default_eos)) + stops if stops else None
        temperature = 1.0 if req.temperature is None else req.temperature
        sample = temperature > 0  # OpenAI's temperature 0 is greedy
        try:
            self.params = SamplingParams(
                max_new_tokens=max_tokens, do_sample=sample, temperature=temperature if sample else 1.0,
                top_k=(req.top_k or 0) if sample else 0, top_p=1.0 if req.top_p is None or not sample else req.top_p,
                min_p=(req.min_p or 0.0) if sample else 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                logit_bias=req.logit_bias_pairs, seed=seed, ignore_eos=req.ignore_eos and not stops,
                eos_token_id=eos, min_tokens=req.min_tokens, regex=req.regex, grammar=req.guided_grammar,
                logprobs=req.top_logprobs_k, prompt_logprobs=req.prompt_logprobs_k if echo is not None else None,
                json_schema=req.json_schema)
        except (ValueError, TypeError) as e:
            raise P.APIError(400, str(e)) from None
        constraint = req.constraint_field
        try:
            state.engine.constraint(self.params, constraint)   # a schema or regex it cannot use is the client's
        except ValueError as e:
            raise P.APIError(400, str(e), param=constraint) from None
        except ImportError as e:   # the optional dependency is missing on this server
            raise P.APIError(501, str(e), param=constraint, type="server_error") from None
        outside = [t for t, _ in self.params.logit_bias if t >= state.engine.vocab_size]
        if outside:
            raise P.APIError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary "
                                  f"[0, {state.engine.vocab_size})", param="logit_bias")
        self._detok = IncrementalDetokenizer(state.tokenizer, prompt_ids)
        self._stops = StopStrings(req.stop)

    def start(self) -> None:
        """Queues the request on the engine loop (APIError 429/503 when it cannot be taken)."""
        try:
            self._queue = self.state.loop.submit(self.id, self.prompt_ids, self.params)
        except QueueFull as e:
            self.state.metrics.reject(429)
            raise P.APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ShuttingDown as e:
            self.state.metrics.reject(503)
            raise P.APIError(503, str(e), type="server_error", code="shutting_down") from None

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it becomes final, with its tokens' logprobs; ``finish_reason`` is set when the iteration
        ends."""
        metrics, t_prev = self.state.metrics, None
        if self._released:
            return
        try:
            while True:
                out = await self._queue.get()
                if isinstance(out, Exception):
                    raise out
                if self._echo is not None:
                    # The first output carries the prompt's logprobs (when asked for): they lead the echo.
                    plp = out.prompt_logprobs
                    yield Piece(self._echo, [] if plp is None else [self.prompt_ids[0]] + plp[1:])
                    self._echo = None
                now = time.perf_counter()
                new = out.new_token_ids
                if new:
                    if self.ttft is None:
                        self.ttft = now - self.t0
                        metrics.first_token(self.prompt_tokens, self.ttft)
                        metrics.tokens(len(new), None)
                    else:
                        metrics.tokens(len(new), (now - t_prev) / len(new))
                    t_prev = now
                    # Tokens before min_tokens may not end a stop string (vLLM's rule).
                    held = max(0, min(len(new), self.params.min_tokens - self.completion_tokens))
                    self.completion_tokens += len(new)
                    piece = self._stops.feed(self._detok.push(new[:held]), may_stop=False) if held else ""
                    if held < len(new):
                        piece += self._stops.feed(self._detok.push(new[held:]))
                else:
                    piece = ""
                if not self._stops.stopped and out.finished:
                    if out.finish_reason not in _FINISH:
                        raise EngineError(f"request ended by the engine ({out.finish_reason})")
                    piece += self._stops.feed(self._detok.flush())
                    if not self._stops.stopped:
                        piece += self._stops.flush()
                        self.finish_reason = _FINISH[out.finish_reason]
                if self._stops.stopped:
                    self.finish_reason = "stop"
                lps = out.new_logprobs or []
                if piece or lps:
                    yield Piece(piece, lps)
                if self.finish_reason is not None:
                    return
        finally:
            self.release()

    def discard(self) -> None:
        """A choice that was never queued: nothing to abort, count or log."""
        self._released = True

    def release(self) -> None:
        """However the request ended (done, stop string, client gone, error, never read): the engine forgets
        it, freeing its blocks unless it already finished there; one log line. Idempotent."""
        if self._released:
            return
        self._released = True
        self.state.loop.finished(self.id)
        total = time.perf_counter() - self.t0
        reason = self.finish_reason or "abort"
        self.state.metrics.finish(reason, total)
        ttft = f"{self.ttft * 1e3:.1f}ms" if self.ttft is not None else "-"
        log.info("%s prompt_tokens=%d output_tokens=%d ttft=%s total=%.1fms finish=%s", self.id,
                 self.prompt_tokens, self.completion_tokens, ttft, total * 1e3, reason)

    def usage(self) -> P.Usage:
        return P.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                       total_tokens=self.prompt_tokens + self.completion_tokens)


class Choices:
    """A request's choices, ``n`` per prompt: one engine request (`Generation`) each, under one response id;
    choice ``p * n + i`` is prompt p's i-th (OpenAI's order). With a ``seed`` a prompt's choice i samples from
    ``request_seed(seed, i)``, so the choices differ and each is reproducible (the only choice of a prompt
    uses the seed itself, as a request of its own would); each prompt is counted once in ``usage``.
    ``echoes``: each prompt's text when the choices start with it."""

    def __init__(self, state: ServerState, req: P._Request, prompts: list[list[int]], max_tokens: int | None,
                 prefix: str, t_arrival: float, max_tokens_field: str = "max_tokens",
                 echoes: list[str] | None = None):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = n = req.n
        seeds = [req.seed if n == 1 or req.seed is None else request_seed(req.seed, i) for i in range(n)]
        single = len(prompts) * n == 1
        self.gens = [Generation(state, req, ids, max_tokens, self.id if single else f"{self.id}-{p * n + i}",
                                t_arrival, max_tokens_field, seed, None if echoes is None else echoes[p])
                     for p, ids in enumerate(prompts) for i, seed in enumerate(seeds)]

    @property
    def wants_logprobs(self) -> bool:
        return self.gens[0].wants_logprobs

    def start(self) -> None:
        """Queues every choice, or none (APIError 429/503 when they cannot all be taken: those already queued
        are aborted, the rest never reach the engine or the metrics)."""
        for i, g in enumerate(self.gens):
            try:
                g.start()
            except P.APIError:
                for queued in self.gens[:i]:
                    queued.release()
                for never in self.gens[i:]:
                    never.discard()
                raise

    def release(self) -> None:
        for g in self.gens:
            g.release()

    def usage(self) -> P.Usage:
        done = sum(g.completion_tokens for g in self.gens)
        prompt = sum(g.prompt_tokens for g in self.gens[::self.n])
        return P.Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    async def pieces(self) -> AsyncIterator[tuple[int, Piece | None]]:
        """``(choice, piece)`` as each choice's text becomes final, ``(choice, None)`` when it ends (its
        ``finish_reason`` is set); each choice's pieces keep their order, the choices interleave as the engine
        steps them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, g: Generation):
            try:
                async for p in g.pieces():
                    await queue.put((i, p, None))
                await queue.put((i, None, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            ended = 0
            while ended < len(tasks):
                i, p, err = await queue.get()
                if err is not None:
                    raise err
                ended += p is None
                yield i, p
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t


def tool_call(req: P.ChatCompletionRequest, text: str) -> P.ToolCall | None:
    """The call a forced tool choice's output makes: a named function's arguments as generated, or
    "required"'s ``{"name", "arguments"}``; None if the text is not complete JSON (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(req.tool_choice, P.NamedToolChoice):
        name, arguments = req.tool_choice.function.name, text.strip()
    else:
        name, arguments = value["name"], json.dumps(value["arguments"])
    return P.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=P.FunctionCall(name=name, arguments=arguments))


class _EventStream(StreamingResponse):
    """A streaming response that closes its event iterator and releases its request however it ends (done,
    client gone, server stopping), even if the iterator never started."""

    def __init__(self, content: AsyncIterator[str], gen: Choices):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content = content
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
            self._gen.release()


def _sse(obj) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def _server_error(e: Exception) -> P.APIError:
    """A request that failed after it was accepted: shut down, failed by the engine, or a bug (logged)."""
    if isinstance(e, ShuttingDown):
        return P.APIError(503, str(e), type="server_error", code="shutting_down")
    if not isinstance(e, EngineError):
        log.exception("request failed")
    return P.APIError(500, f"the request failed: {e}", type="server_error")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: Choices, request: Request) -> list[Piece] | None:
    """All text (and logprobs) of each choice of a non-streaming request; None if the client went away first
    (the request is aborted)."""
    async def text():
        pieces = [[] for _ in gen.gens]
        async for i, p in gen.pieces():
            if p is not None:
                pieces[i].append(p)
        return [Piece("".join(p.text for p in ps), [lp for p in ps for lp in p.logprobs]) for ps in pieces]

    work = asyncio.ensure_future(text())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        gen.release()
    return None if work.cancelled() else work.result()


async def _complete(gen: Choices, request: Request, respond) -> Response:
    """A non-streaming answer: ``respond(pieces)`` (one per choice) once all text (and logprobs) is there, or
    the error."""
    try:
        whole = await _collect(gen, request)
    except Exception as e:  # noqa: BLE001 - fails this request only
        err = _server_error(e)
        return JSONResponse(err.body(), status_code=err.status)
    return Response(status_code=499) if whole is None else respond(whole)


async def _event_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE of ``events`` ending with ``data: [DONE]``; a failure mid-stream is sent as an error event."""
    try:
        async for e in events:
            yield e
    except Exception as e:  # noqa: BLE001 - fails this request only
        yield _sse(_server_error(e).body())
    yield "data: [DONE]\n\n"


class RequireApiKey:
    """ASGI middleware: ``/v1/*`` answers 401 with OpenAI's error JSON unless the request carries
    ``Authorization: Bearer <key>`` (compared in constant time). A plain ASGI class rather than Starlette's
    BaseHTTPMiddleware, which would stand between the handlers and ``receive`` (disconnect detection)."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                what = "no API key was sent" if not sent else "the API key is not valid"
                body = json.dumps(P.APIError(401, f"{what}: send 'Authorization: Bearer <key>'",
                                             code="invalid_api_key").body()).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def create_app(engine, tokenizer, *, model_name: str, max_waiting: int = 256, followers=None,
               api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (a ``TransformerInfer``); its engine thread runs with the app.

    With ``api_key`` every ``/v1/*`` request must carry it as a bearer token (`RequireApiKey`). Under tensor
    parallelism ``engine`` and ``followers`` are rank 0's ``atb.serve.tp.Leader``."""
    if api_key is not None and not api_key:
        raise ValueError("create_app: api_key must be a non-empty string or None")
    state = ServerState(engine, tokenizer, model_name, max_waiting, followers)
    if getattr(engine, "tokenizer", None) is None:
        engine.tokenizer = tokenizer   # structured output (response_format) builds its grammars over it

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if followers is None:
            # response_format's grammars compile over the tokenizer's vocabulary: once, here, off the event loop,
            # instead of stalling every stream inside the first request that asks for it.
            with contextlib.suppress(ImportError, ValueError):
                await asyncio.to_thread(engine.grammars)
        state.loop.start()
        try:
            yield
        finally:
            await state.loop.stop()

    app = FastAPI(title="atb", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.atb = state
    if api_key is not None:
        app.add_middleware(RequireApiKey, key=api_key)

    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        if e.status == 400:
            state.metrics.reject(400)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(P.APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    def check_model(req: P._Request) -> None:
        if req.model is not None and req.model != state.model_name:
            raise P.APIError(404, f"the model '{req.model}' does not exist; this server serves "
                                  f"'{state.model_name}'", param="model", type="not_found_error",
                             code="model_not_found")

    def chat_ids(messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                 tools: list[P.Tool] | None = None) -> list[int]:
        """The tokenizer's chat template over ``messages`` (and ``tools``, for templates that show them; APIError
        400 naming ``messages`` when it has none or rejects them)."""
        if not tokenizer.chat_template:
            raise P.APIError(400, "messages: this model's tokenizer has no chat template; use a text prompt",
                             param="messages")
        try:
            enc = tokenizer.apply_chat_template([m.template_dict() for m in messages],
                                                tools=[t.model_dump(exclude_none=True) for t in tools] if tools
                                                else None,
                                                add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation (roles, order) by raising
            raise P.APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def check_ids(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise P.APIError(400, f"{param}: the prompt is empty", param=param)
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise P.APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
                             param=param)
        return ids

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        req = P.parse_request(await request.body(), P.CompletionRequest)
        check_model(req)
        prompts = [check_ids(list(p) if isinstance(p, list) else tokenizer(p)["input_ids"], "prompt")
                   for p in req.prompt]
        echoes = None
        if req.echo:
            echoes = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False,
                                                                    clean_up_tokenization_spaces=False)
                      for p in req.prompt]
        gen = Choices(state, req, prompts, req.max_tokens, "cmpl", t0, echoes=echoes)
        gen.start()
        offsets = [0] * len(gen.gens)  # where each choice's next reported token's text starts in its text

        def choice(i: int, piece: Piece, finish: str | None) -> P.CompletionChoice:
            lp = None
            if gen.wants_logprobs and (piece.logprobs or finish is None or not req.stream):
                lp = completion_logprobs(tokenizer, piece.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in lp.tokens)
            return P.CompletionChoice(index=i, text=piece.text, logprobs=lp, finish_reason=finish)

        def response(choices: list[P.CompletionChoice], usage=None) -> P.CompletionResponse:
            return P.CompletionResponse(id=gen.id, created=gen.created, model=state.model_name, usage=usage,
                                        choices=choices)

        if not req.stream:
            return await _complete(gen, request, lambda pieces: response(
                [choice(i, p, g.finish_reason) for i, (p, g) in enumerate(zip(pieces, gen.gens))], gen.usage()))

        async def events():
            async for i, piece in gen.pieces():
                if piece is None:
                    yield _sse(response([choice(i, Piece("", []), gen.gens[i].finish_reason)]))
                else:
                    yield _sse(response([choice(i, piece, None)]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(P.CompletionResponse(id=gen.id, created=gen.created, model=state.model_name,
                                                choices=[], usage=gen.usage()))

        return _EventStream(_event_stream(events()), gen)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        req = P.parse_request(await request.body(), P.ChatCompletionRequest)
        check_model(req)
        ids = chat_ids(req.messages, tools=req.tools)
        limit_field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        gen = Choices(state, req, [check_ids(list(ids), "messages")], req.output_limit, "chatcmpl", t0, limit_field)
        gen.start()

        def logprobs(lps: list[TokenLogprob]) -> P.ChatLogprobs | None:
            return chat_logprobs(tokenizer, lps) if gen.wants_logprobs else None

        def chunk(i: int | None, delta: P.ChatDelta | None = None, finish: str | None = None, usage=None,
                  lps: list[TokenLogprob] | None = None) -> P.ChatCompletionChunk:
            return P.ChatCompletionChunk(
                id=gen.id, created=gen.created, model=state.model_name, usage=usage,
                choices=[] if i is None else [P.ChatChunkChoice(
                    index=i, delta=delta, logprobs=None if lps is None else logprobs(lps), finish_reason=finish)])

        calls = bool(req.forced_tools)

        def answer(text: str, finish: str | None) -> tuple[P.ChatResponseMessage, str | None]:
            """A choice's message and finish reason: its text, or the tool call the text makes (a forced call
            cut short by max_tokens stays text, with finish_reason "length")."""
            call = tool_call(req, text) if calls else None
            if call is None:
                return P.ChatResponseMessage(content=text), finish
            # OpenAI's reasons: a call the model had to make among several is "tool_calls", a named one "stop".
            return P.ChatResponseMessage(content=None, tool_calls=[call]), (
                "stop" if isinstance(req.tool_choice, P.NamedToolChoice) else "tool_calls")

        if not req.stream:
            def respond(pieces):
                choices = []
                for i, (p, g) in enumerate(zip(pieces, gen.gens)):
                    message, finish = answer(p.text, g.finish_reason)
                    choices.append(P.ChatChoice(index=i, message=message, logprobs=logprobs(p.logprobs),
                                                finish_reason=finish))
                return P.ChatCompletionResponse(id=gen.id, created=gen.created, model=state.model_name,
                                                usage=gen.usage(), choices=choices)
            return await _complete(gen, request, respond)

        async def events():
            for i in range(req.n):
                yield _sse(chunk(i, P.ChatDelta(role="assistant", content="")))
            held = [""] * req.n   # a forced tool call is sent whole once its arguments are complete
            async for i, piece in gen.pieces():
                if piece is None:
                    finish = gen.gens[i].finish_reason
                    if calls:
                        message, finish = answer(held[i], finish)
                        if message.tool_calls:
                            yield _sse(chunk(i, P.ChatDelta(tool_calls=[
                                {"index": 0, **message.tool_calls[0].model_dump()}])))
                        else:
                            yield _sse(chunk(i, P.ChatDelta(content=message.content)))
                    yield _sse(chunk(i, P.ChatDelta(), finish))
                elif calls:
                    held[i] += piece.text
                else:
                    yield _sse(chunk(i, P.ChatDelta(content=piece.text), lps=piece.logprobs))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(chunk(None, usage=gen.usage()))

        return _EventStream(_event_stream(events()), gen)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = P.parse_request(await request.body(), P.TokenizeRequest)
        check_model(req)
        if req.messages is not None:
            ids = chat_ids(req.messages, req.add_generation_prompt)
        else:
            ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return P.TokenizeResponse(count=len(ids), max_model_len=state.max_seq_len, tokens=list(ids))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = P.parse_request(await request.body(), P.DetokenizeRequest)
        check_model(req)
        ids = check_ids(req.tokens, "tokens") if req.tokens else []
        return P.DetokenizeResponse(prompt=tokenizer.decode(ids, skip_special_tokens=False,
                                                            clean_up_tokenization_spaces=False))

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=state.model_name, created=state.created,
                                             max_model_len=state.max_seq_len)])

    @app.get("/health")
    async def health():
        if not state.loop.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        # A plain function: FastAPI runs it on a worker thread, so waiting for the engine's lock (held
        # during a step) never stalls the event loop.
        stats = engine.stats()
        stats["waiting"] += state.loop.queued
        return PlainTextResponse(state.metrics.render(stats), media_type=CONTENT_TYPE)

    return app


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A uvicorn server for ``app`` whose SIGINT/SIGTERM handling stops accepting, aborts the requests in
    flight (their streams end with an error event) and returns normally, so the process exits with 0."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own version re-raises the signal after its graceful shutdown, so the process would
            # die of it; here a signal means "shut down cleanly and return".
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            app.state.atb.loop.begin_shutdown_threadsafe()

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10))

    def on_fatal():
        # From the engine thread; uvicorn checks the flag on its own loop and shuts down as for a signal.
        server.should_exit = True

    app.state.atb.loop.on_fatal = on_fatal
    return server


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serves ``app`` until SIGINT/SIGTERM, then shuts down gracefully and returns."""
    make_server(app, host, port, log_level).run()
