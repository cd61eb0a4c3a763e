"""OpenAI's wire format for the completions and chat completions endpoints.

Requests are validated strictly (``"5"`` is not an int, ``true`` is not a
number) and, as OpenAI does, an unrecognised field is an error rather than
something silently ignored. Every validation failure becomes an
:class:`APIError` naming the field, which the app turns into OpenAI's error
JSON with status 400. Responses and stream chunks are plain pydantic models
serialised field for field as OpenAI sends them.
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from atb.engine import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY

# OpenAI's documented ranges.
MAX_STOP_STRINGS = 4
MAX_TEMPERATURE = 2.0
# Choices per request: each is an engine request of its own.
MAX_CHOICES = 16
# Prompts per completions request (OpenAI's batch form): each prompt's n choices are engine requests.
MAX_PROMPTS = 64


class APIError(Exception):
    """An error answered with OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")   # {} allows any JSON value
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that a schema accepts."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def output_schema(self) -> dict | None:
        """The JSON schema the output must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_
        return None


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """``text`` as a regular expression matching it literally (llguidance's Rust syntax)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class _Request(BaseModel):
    # json.loads accepts NaN and Infinity; no sampling value may be either.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Not in OpenAI's API; vLLM's extensions of the same names.
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Token ids (as JSON object keys) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions: EOS (and stop_token_ids) held off for min_tokens; more token ids that end the output;
    # output constrained to a JSON schema, a regular expression or one of several strings.
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None:
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
            if any(s == "" for s in v):
                raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        return v

    def validate_semantics(self) -> None:
        rf = self.response_format
        if rf is not None and (rf.type == "json_schema") != (rf.json_schema is not None):
            raise APIError(400, "response_format: json_schema is required with type 'json_schema' and only then",
                           param="response_format")
        given = [name for name, v in (("response_format", rf is not None and rf.type != "text"),
                                      ("guided_json", self.guided_json is not None),
                                      ("guided_regex", self.guided_regex is not None),
                                      ("guided_grammar", self.guided_grammar is not None),
                                      ("guided_choice", self.guided_choice is not None)) if v]
        if len(given) > 1:
            raise APIError(400, f"{given[1]}: only one output constraint per request, {given[0]} is given too",
                           param=given[1])
        if isinstance(self.guided_json, str):
            try:
                schema = json.loads(self.guided_json)
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                raise APIError(400, "guided_json: must be a JSON schema (an object, or its JSON text)",
                               param="guided_json")
        if self.guided_choice is not None and any(c == "" for c in self.guided_choice):
            raise APIError(400, "guided_choice: the choices must not be empty strings", param="guided_choice")
        limit = self.output_limit
        if limit is not None and self.min_tokens > limit:
            raise APIError(400, f"min_tokens: {self.min_tokens} is more than the {limit} tokens allowed",
                           param="min_tokens")

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def json_schema(self) -> dict | str | None:
        """The JSON schema the output must follow (``response_format`` or ``guided_json``), or None."""
        if self.guided_json is not None:
            return self.guided_json
        return None if self.response_format is None else self.response_format.output_schema()

    @property
    def constraint_field(self) -> str:
        """The field that constrains the output (named in errors about it)."""
        for name in ("guided_json", "guided_regex", "guided_grammar", "guided_choice"):
            if getattr(self, name) is not None:
                return name
        return "response_format"

    @property
    def regex(self) -> str | None:
        """The regular expression the output must match (``guided_regex``, or ``guided_choice`` as one), or
        None."""
        if self.guided_choice is not None:
            return "(" + "|".join(_regex_literal(c) for c in self.guided_choice) + ")"
        return self.guided_regex

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())


class CompletionRequest(_Request):
    # Prompts: one (text, or token ids) or a list of them (OpenAI's batch form); validated into a list of
    # prompts, each a string or a list of token ids.
    prompt: Any
    # OpenAI's default for the legacy endpoint; 0 only with echo (the prompt scored, nothing generated).
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        def ids(p):
            return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if isinstance(v, str) or (ids(v) and v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
            return v
        if v == []:
            raise ValueError("the prompt is empty")
        raise ValueError("must be a string, a list of token ids, or a list of either")

    def validate_semantics(self) -> None:
        super().validate_semantics()
        if self.suffix is not None:
            raise APIError(400, "suffix: not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, f"best_of: only equal to n ({self.n}) is supported", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo (to score the prompt)", param="max_tokens")

    @property
    def top_logprobs_k(self) -> int | None:
        """Alternatives per generated token to report (None: no logprobs)."""
        return self.logprobs

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token to report: echoed prompts carry logprobs too."""
        return self.logprobs if self.echo else None


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None            # the call a tool message answers

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        # A string, or OpenAI's list of content parts of which only text parts are supported here; None only
        # where a message may have no content (checked per role in ChatCompletionRequest).
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError("must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")

    def template_dict(self) -> dict:
        """The message as chat templates take it (HF's convention: a tool call's arguments as a dict; no content
        is "", which templates that know nothing of tool calls can still concatenate)."""
        m = {"role": self.role, "content": "" if self.content is None else self.content}
        if self.tool_calls is not None:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            m["name"] = self.name
        return m


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Function calling: a call is generated when tool_choice forces one ("required" or a named function), its
    # arguments constrained to the function's parameter schema (what vLLM does without a tool-call parser).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def validate_semantics(self) -> None:
        super().validate_semantics()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise APIError(400, f"messages.{i}.content: required (only an assistant message with tool_calls "
                                    f"may leave it out)", param="messages")
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                               param="messages")
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages.{i}.tool_call_id: required in a tool message", param="messages")
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be distinct", param="tools")
        if choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        if choice == "auto" or (choice is None and self.tools):
            raise APIError(400, "tool_choice: 'auto' (the default when tools are given) needs a tool-call parser "
                                "for this model, which this server does not have; send 'required', a named "
                                "function, or 'none'", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice: no tool named {choice.function.name!r} (tools: {', '.join(names)})",
                           param="tool_choice")
        other = super().constraint_field != "response_format" or (
            self.response_format is not None and self.response_format.type != "text")
        if self.forced_tools and other:
            raise APIError(400, "tool_choice: a forced tool call and another output constraint cannot be combined",
                           param="tool_choice")

    @property
    def constraint_field(self) -> str:
        return "tools" if self.forced_tools else super().constraint_field

    @property
    def forced_tools(self) -> list[FunctionDef]:
        """The functions one of which the answer must call (empty: a plain answer)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return [t.function for t in self.tools if t.function.name == choice.function.name]
        return [t.function for t in self.tools] if choice == "required" else []

    @property
    def json_schema(self) -> dict | str | None:
        """A named call's arguments follow its parameter schema; "required": one object naming a function and
        holding its arguments. Otherwise response_format / guided_json."""
        forced = self.forced_tools
        if isinstance(self.tool_choice, NamedToolChoice):
            return forced[0].parameters
        if forced:
            return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                               "properties": {"name": {"const": f.name}, "arguments": f.parameters}}
                              for f in forced]}
        return super().json_schema

    @property
    def top_logprobs_k(self) -> int | None:
        """Alternatives per generated token to report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_logprobs_k(self) -> None:
        """Chat does not echo its prompt."""
        return None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a text ``prompt`` or chat ``messages`` (through the chat template)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True       # the tokenizer's own (BOS, ...) around a text prompt
    add_generation_prompt: bool = True    # the chat template's assistant header after the messages

    def validate_semantics(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "prompt: exactly one of prompt and messages is required", param="prompt")


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text (special tokens kept)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]

    def validate_semantics(self) -> None:
        pass


def parse_request(raw: bytes, cls: type[_Request]) -> _Request:
    """The request body as ``cls``; malformed JSON or any invalid field raises APIError(400) naming it."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "extra_forbidden":
            msg = "unrecognized request argument"
        raise APIError(400, f"{where}: {msg}", param=param) from None
    req.validate_semantics()
    return req


# ---------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy endpoint's logprobs: per token (an echoed prompt's, then the generated ones) its text,
    log-probability, the most likely alternatives (text -> log-probability) and where its text starts in the
    choice's text. The first prompt token has none (null): nothing predicts it."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class _Choice(BaseModel):
    """What every choice carries beside its text, message or delta (which serialises last)."""
    index: int = 0
    logprobs: CompletionLogprobs | ChatLogprobs | None = None
    finish_reason: str | None


class _Response(BaseModel):
    """The envelope every response and stream chunk shares; each fixes ``object`` and its choice type."""
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Choice):
    message: ChatResponseMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None   # [{"index", "id", "type", "function": {"name", "arguments"}}]

    @model_serializer
    def _present_only(self) -> dict:
        # OpenAI's deltas carry only what changed: {"role": ..., "content": ""}, {"content": ...}, {}.
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
                if v is not None}


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "atb"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
