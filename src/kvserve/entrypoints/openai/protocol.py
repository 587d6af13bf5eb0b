"""OpenAI's request schemas (plus vLLM's sampling extras), as pydantic models.

Unknown fields are ignored, as OpenAI clients send some this server has no use for
(`store`, `metadata`...). `user` names the tenant that the fair scheduling policy shares the
token budget among. Field values are checked twice: types here, ranges in `SamplingParams`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvserve.sampling_params import SamplingParams, StructuredOutputParams

if TYPE_CHECKING:
    from kvserve.engine.input_processor import InputProcessor


def one_of(expected: str) -> WrapValidator:
    """Reports a value that fits no member of a union as `expected`: pydantic's own error
    names the first member's failure only ("prompt.str: Input should be a valid string")."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            got = repr(value)
            raise PydanticCustomError("union_type", "must be {expected}, got {got}", {
                "expected": expected, "got": got if len(got) <= 80 else got[:77] + "..."}
                ) from None

    return WrapValidator(check)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class RequestBody(BaseModel):
    """A route's JSON body: fields it does not know are left alone, and one sent as null is
    one left out (its default, or the generation config's), as OpenAI's API takes it."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {name: value for name, value in data.items() if value is not None}
        return data


class SamplingRequest(RequestBody):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Annotated[str | list[str] | None, one_of("a string or a list of strings")] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as JSON keys) -> bias
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0  # under --scheduling-policy priority, lower values go first
    user: str | None = Field(default=None, min_length=1)  # OpenAI's end-user id: the tenant
    response_format: ResponseFormat | None = None
    guided_json: Annotated[dict[str, Any] | str | None,
                           one_of("a JSON schema, as an object or as its text")] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # a Lark grammar
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens
    bad_words: list[str] | None = None
    # vLLM's extra this server cannot honor, refused by name rather than ignored.
    use_beam_search: bool = False
    # The LoRA adapter that `model` names, set by the server.
    _lora_name: str | None = PrivateAttr(default=None)

    @field_validator("stream_options")
    @classmethod
    def only_with_stream(cls, options: StreamOptions | None, info: ValidationInfo
                         ) -> StreamOptions | None:
        """As OpenAI's API: options of a stream that is not asked for are a mistake."""
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def engine_prompt(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A prompt for the engine, with this request's cache salt, priority, tenant and
        LoRA adapter."""
        options = {"cache_salt": self.cache_salt, "priority": self.priority,
                   "tenant": self.user, "lora_name": self._lora_name}
        return {**prompt, **{k: v for k, v in options.items() if v is not None}}

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_output: StructuredOutputParams | None = None
                        ) -> SamplingParams:
        """`defaults`: the served model's values for the fields this request leaves out
        (its generation_config.json's); `max_tokens` takes its default where it is None.
        `structured_output`: the output's format where the route sets it (a tool choice), in
        place of the request's own."""
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported by this server")
        chosen = {name: value for name, value in defaults.items()
                  if name != "max_tokens" and name not in self.model_fields_set}
        return SamplingParams(**{
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty, **chosen},
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_output=structured_output or self.structured_output(),
            logit_bias=self.token_biases(),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words)

    def token_biases(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got "
                             f"{sorted(self.logit_bias)}") from None

    def structured_output(self) -> StructuredOutputParams | None:
        """The output's constraint: `response_format` or one of vLLM's `guided_*` extras;
        an error names the field that holds the bad schema, regex, choice or grammar."""
        given: dict[str, Any] = {name: value for name, value in (
            ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar))
            if value is not None}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format
        if len(given) > 1:
            raise ValueError(f"response_format, guided_json, guided_regex, guided_choice and "
                             f"guided_grammar: at most one may be given, got {sorted(given)}")
        if not given:
            return None
        ((name, value),) = given.items()
        try:
            if name != "response_format":
                return StructuredOutputParams(**{name.removeprefix("guided_"): value})
            if value.type == "json_object":
                return StructuredOutputParams(json_object=True)
            if value.json_schema is None:
                raise ValueError("json_schema is required when type is json_schema")
            name = "response_format.json_schema.schema"
            return StructuredOutputParams(json=value.json_schema.schema_)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]] | None,
                      one_of("a string, a list of strings, a list of token ids or a list of "
                             "token-id lists")] = None
    # kvserve's extra, instead of `prompt` (CacheBlend): the prompt as reusable chunks (texts
    # or token ids) and then the rest; each chunk's KV is reused wherever it appears.
    segments: list[Annotated[str | list[int],
                             one_of("a string or a list of token ids")]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extra: each choice gets `prompt_logprobs`
    # OpenAI's fields this server cannot honor, refused by name rather than ignored.
    suffix: str | None = None
    best_of: int | None = None

    @property
    def echo_only(self) -> bool:
        """OpenAI's way to score a prompt: echo it, generate nothing."""
        return self.echo and self.max_tokens == 0


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    """A call an assistant message made (OpenAI's `tool_calls` entries)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None,
                       one_of('a string or a list of text parts ({"type": "text", "text": '
                              '"..."})')] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Names an image, audio or file part as what it is: pydantic's own error for the
        union would say that the content should be a string."""
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                raise ValueError('content parts are objects such as {"type": "text", "text": '
                                 f'"..."}}, got {part!r}')
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not "
                                 "supported: the models served here take text parts only")
        return content

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined into one string, and
        each call's arguments as an object (transformers' convention for templates)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type, "function": {
                    "name": call.function.name,
                    "arguments": _call_arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _call_arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"messages: tool_calls arguments must be a JSON object: {e}"
                         ) from None
    if not isinstance(value, dict):
        raise ValueError(f"messages: tool_calls arguments must be a JSON object, got {text!r}")
    return value


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(RequestBody):
    """How a request's messages go through the chat template: the same for the chat route
    and /tokenize, so /tokenize counts what the chat route would."""

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model goes on with the last message
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's form)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []] or None

    def prompt_token_ids(self, inputs: InputProcessor) -> list[int]:
        return inputs.apply_chat_template(
            [m.template_dict() for m in self.messages], self.add_generation_prompt,
            tools=self.template_tools(), template_kwargs=self.chat_template_kwargs,
            continue_final_message=self.continue_final_message)


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Default: "auto" with tools, "none" without (OpenAI's).
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                           one_of('"none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}')] = None
    parallel_tool_calls: bool = True


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize (vLLM's): a prompt, or messages through the chat template, as the
    completions and chat routes would tokenize them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # for `prompt`; the chat template places its own
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving adapter `lora_name`."""

    lora_name: str = Field(min_length=1)


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve a PEFT LoRA folder as model `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class MigrateRequest(BaseModel):
    """POST /replicas/migrate: move running requests from one replica to another."""

    source: int
    destination: int
    num_requests: int = Field(default=1, ge=1)
