"""Prompts in, validated `ParentRequest`s out: tokenization, chat templates and the limits a
request must fit. It needs a tokenizer and `RequestLimits`, not the model, so a cluster's
front end validates and tokenizes once, before any replica is chosen."""

from __future__ import annotations

import inspect
import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams, is_integer

PromptType = str | dict[str, Any]
# apply_chat_template's own arguments and the template's conversation: not template variables
_RENDER_ARGUMENTS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}


def _check_unicode(text: str, field_name: str) -> None:
    """JSON's escapes can spell a lone surrogate (\\ud800), which Python keeps in a str but
    no tokenizer takes: it is refused by name, not by the tokenizer's TypeError."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{field_name} is not valid Unicode: it holds a lone surrogate "
                         f"(U+{ord(text[e.start]):04X})") from None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request is checked against; the same on every replica of one model."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    window_blocks: int = 0  # a stream's sink plus window blocks; 0 without a window
    blending: bool = False  # whether prompts may come as segments (CacheBlend)

    def max_blocks_per_request(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` ever holds at once."""
        needed = -(-num_tokens // self.block_size)
        return min(needed, self.window_blocks) if self.window_blocks else needed


@dataclass
class CompletionState:
    """One of a request's n completions."""

    request: Request
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class ParentRequest:
    """A caller's request: one prompt, `n` completions, each its own engine Request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None
    lora_name: str | None = None
    segment_lens: tuple[int, ...] = ()  # a prompt given as segments: theirs, in turn
    sequences: list[CompletionState] = field(default_factory=list)
    first_token_time: float | None = None
    # One entry per prompt token (None for the first, which nothing predicts), when asked for.
    prompt_logprobs: PromptLogprobs | None = None
    # Its caller takes only the finished output (offline `LLM.generate`, like vLLM's
    # FINAL_ONLY): no RequestOutput is built for it before then.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.sequences)

    def to_output(self) -> RequestOutput:
        outputs = [s.output for s in self.sequences]
        scheduled = [s.request.scheduled_time for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished=self.finished,
                             prompt_logprobs=self.prompt_logprobs,
                             first_scheduled_time=min((t for t in scheduled if t is not None),
                                                      default=None),
                             first_token_time=self.first_token_time)


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, limits: RequestLimits,
                 sampling_defaults: dict[str, Any] | None = None) -> None:
        """`sampling_defaults`: what a request that leaves a sampling field out gets
        (`EngineConfig.sampling_defaults`)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.sampling_defaults = dict(sampling_defaults or {})
        self._ids = itertools.count()

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: PromptType, field_name: str = "prompt"
                 ) -> tuple[str | None, list[int]]:
        """The prompt's text (if given as text) and its validated token ids."""
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"{field_name}.prompt must be a string")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field_name} must not be empty")
            return prompt, self.encode(prompt, field_name)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = self.check_token_ids(prompt["prompt_token_ids"],
                                        f"{field_name}.prompt_token_ids")
            return prompt.get("prompt"), ids
        raise ValueError(f"{field_name} must be a string or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def encode(self, text: str, field_name: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids."""
        _check_unicode(text, field_name)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def tokenize_segments(self, segments: Any, field_name: str = "prompt.segments"
                          ) -> tuple[str | None, list[int], tuple[int, ...]]:
        """A prompt given as segments (CacheBlend): each a string or a list of token ids,
        tokenized on its own (special tokens only at the start). Returns the joined text (when
        all are strings), the token ids and each segment's length."""
        if not self.limits.blending:
            raise ValueError(f"{field_name} needs prefix caching on (the chunk store is its "
                             "cache)")
        if not isinstance(segments, list | tuple) or len(segments) < 2:
            raise ValueError(f"{field_name} must be a list of at least 2 segments: the "
                             "reusable chunks, then the rest of the prompt")
        ids: list[int] = []
        lens = []
        for i, segment in enumerate(segments):
            if isinstance(segment, str) and segment:
                tokens = self.encode(segment, f"{field_name}[{i}]", add_special_tokens=i == 0)
            elif isinstance(segment, list | tuple):
                tokens = self.check_token_ids(segment, f"{field_name}[{i}]")
            else:
                raise ValueError(f"{field_name}[{i}] must be a non-empty string or list of "
                                 "token ids")
            if not tokens:
                raise ValueError(f"{field_name}[{i}] has no tokens")
            ids += tokens
            lens.append(len(tokens))
        text = "".join(segments) if all(isinstance(s, str) for s in segments) else None
        return text, ids, tuple(lens)

    def check_token_ids(self, ids: Any, field_name: str) -> list[int]:
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError(f"{field_name} must be a non-empty list")
        vocab = self.limits.vocab_size
        for t in ids:
            if not is_integer(t):
                raise ValueError(f"{field_name}: token ids must be integers, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"{field_name}: token id {t!r} is out of the vocabulary "
                                 f"[0, {vocab})")
        return [int(t) for t in ids]

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            field_name: str = "messages",
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False,
                            chat_template: str | None = None) -> list[int]:
        """The token ids of a conversation rendered by the checkpoint's chat template (or
        `chat_template`), with the function `tools` (OpenAI's form) it may call and the
        template's own variables `template_kwargs` (vLLM's chat_template_kwargs, e.g. Qwen3's
        enable_thinking). A template that leaves the tools out of what it renders is refused:
        the model would never see them. `continue_final_message`: the last (assistant)
        message is left open, for the model to go on with it."""
        if not conversation:
            raise ValueError(f"{field_name} must not be empty")
        if not (chat_template or self.tokenizer.chat_template):
            raise ValueError(f"{field_name}: the model has no chat template (give one with "
                             "chat_template, --chat-template on the command line)")
        if continue_final_message and (add_generation_prompt
                                       or conversation[-1]["role"] != "assistant"):
            raise ValueError("continue_final_message: needs add_generation_prompt false and "
                             "an assistant message last, to continue")
        template_kwargs = template_kwargs or {}
        reserved = sorted(set(template_kwargs) & _RENDER_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved} are set by the request, not "
                             f"by template variables")
        options = {"add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, **template_kwargs}
        if chat_template:
            options["chat_template"] = chat_template
        ids = self._render(conversation, field_name, tools, options)
        if tools and ids == self._render(conversation, field_name, None, options):
            raise ValueError("tools: the model's chat template does not show tools to the "
                             "model")
        return ids

    def _render(self, conversation: list[dict[str, Any]], field_name: str,
                tools: list[dict[str, Any]] | None, options: dict[str, Any]) -> list[int]:
        try:
            return list(self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=True, return_dict=False, **options))
        except Exception as e:  # noqa: BLE001 (template errors surface as the caller's error)
            # A lone surrogate anywhere is named as such, not as the tokenizer's TypeError.
            _check_unicode(json.dumps([conversation, tools], ensure_ascii=False, default=str),
                           field_name)
            raise ValueError(f"{field_name}: the chat template rejected it: {e}") from None

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      field_name: str = "prompt", segment_lens: tuple[int, ...] = ()) -> int:
        """Validates the request against the context and the KV pool; returns max_tokens.
        With a streaming window the cache, not the sequence, is bounded: any length goes.
        A blended prompt also holds its chunks' blocks while it is blended."""
        num_prompt = len(prompt_token_ids)
        if not num_prompt:
            raise ValueError(f"{field_name} must not be empty")
        if params.structured_output is not None and not getattr(self.tokenizer, "is_fast", False):
            raise ValueError("structured_output needs a fast tokenizer (tokenizer.json), and "
                             "this model's is a slow one")
        limits = self.limits
        if params.stop_token_ids:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        if params.allowed_token_ids:
            self.check_token_ids(params.allowed_token_ids, "allowed_token_ids")
        for sequence in params.bad_words_token_ids or ():
            self.check_token_ids(sequence, "bad_words_token_ids")
        if limits.window_blocks:
            max_tokens = sys.maxsize if params.max_tokens is None else params.max_tokens
        else:
            room = limits.max_model_len - num_prompt
            if room < 1:
                raise ValueError(f"{field_name} has {num_prompt} tokens; the context limit "
                                 f"(max_model_len) is {limits.max_model_len}, leaving no room "
                                 "to generate")
            max_tokens = room if params.max_tokens is None else params.max_tokens
            if max_tokens > room:
                raise ValueError(f"max_tokens ({max_tokens}) plus the prompt ({num_prompt} "
                                 f"tokens) exceeds the context limit (max_model_len) of "
                                 f"{limits.max_model_len}")
        if segment_lens and params.prompt_logprobs is not None:
            raise ValueError(f"{field_name}.segments: prompt_logprobs needs every prompt "
                             "token computed in context; a blended prompt recomputes a few")
        needed = limits.max_blocks_per_request(num_prompt + max_tokens) + sum(
            limits.max_blocks_per_request(n) for n in segment_lens[:-1])
        if needed > limits.num_kv_blocks:
            raise ValueError(f"{field_name} with max_tokens needs {needed} KV blocks but the pool "
                             f"(kv_cache_memory) holds {limits.num_kv_blocks}")
        return max_tokens

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as written and after a space (as it comes mid-text), so that it
        is banned at the output's start and after another word (vLLM's way)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def truncate(self, text: str | None, ids: list[int], params: SamplingParams
                 ) -> tuple[str | None, list[int]]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation); -1
        keeps as many as the context holds beside max_tokens (or one token to generate)."""
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = max(1, self.limits.max_model_len - (params.max_tokens or 1))
        if len(ids) <= keep:
            return text, ids
        return None, ids[-keep:]  # the text is decoded from the ids where it is needed

    def prepare_request(self, prompt: PromptType, params: SamplingParams,
                        request_id: str | None = None, field_name: str = "prompt"
                        ) -> tuple[ParentRequest, int]:
        """Tokenizes and validates a prompt; returns it with its max_tokens, ready for
        `LLMEngine.add_validated`. Raises ValueError naming `field_name` and the broken
        limit."""
        options = prompt if isinstance(prompt, dict) else {}
        lens: tuple[int, ...] = ()
        if "segments" in options:
            text, ids, lens = self.tokenize_segments(options["segments"],
                                                     f"{field_name}.segments")
            if options.get("lora_name") is not None:
                raise ValueError(f"{field_name}.segments: blended prompts run the base model, "
                                 "not a lora_name")
            if params.truncate_prompt_tokens is not None:
                raise ValueError(f"{field_name}.segments: truncate_prompt_tokens would cut "
                                 "the reused chunks; give a plain prompt")
        else:
            text, ids = self.tokenize(prompt, field_name)
            if params.truncate_prompt_tokens is not None:
                text, ids = self.truncate(text, ids, params)
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        max_tokens = self.check_request(ids, params, field_name, lens)
        for name in ("cache_salt", "tenant", "lora_name"):
            value = options.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{field_name}.{name} must be a non-empty string")
        priority = options.get("priority", 0)
        if not is_integer(priority):
            raise ValueError(f"{field_name}.priority must be an integer, got {priority!r}")
        return ParentRequest(request_id or self.new_request_id(), text, ids,
                             options.get("cache_salt"), int(priority),
                             options.get("tenant"), options.get("lora_name"),
                             lens), max_tokens

    def prepare_requests(self, prompts: list[PromptType], params: SamplingParams
                         ) -> list[tuple[ParentRequest, int]]:
        """`prepare_request` for every prompt, naming `prompt[i]` in errors when there are
        several; raises on the first bad one, so nothing is queued unless all are good."""
        many = len(prompts) > 1
        return [self.prepare_request(p, params, field_name=f"prompt[{i}]" if many else "prompt")
                for i, p in enumerate(prompts)]
