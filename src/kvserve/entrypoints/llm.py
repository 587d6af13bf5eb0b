"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig, resolve_chat_template
from kvserve.engine.input_processor import ParentRequest, PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.prefix_sharing import sharing_order
from kvserve.lora.request import LoRARequest
from kvserve.outputs import EngineStats, RequestOutput
from kvserve.sampling_params import SamplingParams

PREFIX_SHARING = ("auto", "off")


class LLM:
    """Takes the engine options of `EngineConfig.create` (model, dtype, max_num_batched_tokens,
    max_num_seqs, block_size, kv_cache_memory, gpu_memory_utilization, max_model_len, seed,
    device, scheduler_policy, enable_prefix_caching, enforce_eager, scheduling_policy,
    preemption_mode, swap_space).

    `prefix_sharing="auto"` admits a batch's prompts grouped by shared heads (BatchLLM) when
    prefix caching is on; "off" admits them in the caller's order. Outputs always come back
    in the caller's order.
    """

    def __init__(self, model: str, prefix_sharing: str = "auto", **engine_options: Any) -> None:
        if prefix_sharing not in PREFIX_SHARING:
            raise ValueError(f"prefix_sharing must be one of {', '.join(PREFIX_SHARING)}, "
                             f"got {prefix_sharing!r}")
        self.prefix_sharing = prefix_sharing
        self.engine = LLMEngine(EngineConfig.from_options(model, engine_options))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json defaults (see the `generation_config` option), else
        SamplingParams()."""
        return self.engine.inputs.default_sampling_params()

    def get_stats(self) -> EngineStats:
        """Queues, KV blocks (in use and peak) and prefix-cache counters since start."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached KV block, so that the next prompts are computed afresh."""
        self.engine.core.kv_cache.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in the prompts' order. Every prompt
        is validated before any runs, so one bad prompt raises ValueError naming its index
        and leaves the engine as it was. `priority` (one per prompt, lower first) matters
        under `scheduling_policy="priority"`; a prompt dict may also carry `priority`,
        `tenant` (for `"fair"`), `cache_salt` and `lora_name`. `lora_request` (one, or one
        per prompt) runs prompts with a LoRA adapter as vLLM's does, loading it on first use.
        A prompt `{"segments": [...]}` (texts or token-id lists) is blended (CacheBlend):
        every segment but the last is a chunk whose KV is reused wherever it appears."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        elif not isinstance(prompts, Iterable) or isinstance(prompts, bytes | bytearray):
            raise ValueError("prompts must be a prompt (a string or a dict) or a list of "
                             f"prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} entries for "
                                 f"{len(prompts)} prompts")
            prompts = [{**_as_dict(p), "priority": level}
                       for p, level in zip(prompts, priority, strict=True)]
        if lora_request is not None:
            prompts = self._with_adapters(prompts, lora_request)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, list | tuple):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got "
                                 f"{type(p).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for "
                             f"{len(prompts)} prompts")
        return self._run(self._validate(prompts, params), use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             continue_final_message: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the checkpoint's chat template (or `chat_template`: a Jinja template or the
        file that holds one) to one conversation or a list of them, with the function `tools`
        (OpenAI's form) the model may call and the template's own variables
        (`chat_template_kwargs`, e.g. Qwen3's enable_thinking); `continue_final_message`
        leaves the last (assistant) message open to go on with."""
        if not isinstance(messages, list):
            raise ValueError("messages must be a list of message dicts, or a list of such "
                             f"lists, got {type(messages).__name__}")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = resolve_chat_template(chat_template)
        prompts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            ids = self.engine.inputs.apply_chat_template(conversation, add_generation_prompt,
                                                         f"messages[{i}]", tools,
                                                         chat_template_kwargs,
                                                         continue_final_message, template)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _with_adapters(self, prompts: list[PromptType],
                       lora_request: LoRARequest | Sequence[LoRARequest | None]
                       ) -> list[PromptType]:
        """Each prompt with its LoRARequest's adapter (None: the base model's), loading the
        adapters not loaded yet."""
        requests = ([lora_request] * len(prompts) if isinstance(lora_request, LoRARequest)
                    else list(lora_request))
        if len(requests) != len(prompts):
            raise ValueError(f"lora_request has {len(requests)} entries for {len(prompts)} "
                             "prompts")
        for i, request in enumerate(requests):
            if request is not None and not isinstance(request, LoRARequest):
                raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, got "
                                 f"{type(request).__name__}")
        for request in dict.fromkeys(r for r in requests if r is not None):
            if request.lora_name not in self.engine.lora_names:
                self.engine.add_lora(request.lora_name, request.lora_path)
        return [prompt if request is None else {**_as_dict(prompt),
                                                "lora_name": request.lora_name}
                for prompt, request in zip(prompts, requests, strict=True)]

    def _validate(self, prompts: list[PromptType], params: list[SamplingParams]
                  ) -> list[tuple[ParentRequest, SamplingParams, int]]:
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            parent, max_tokens = self.engine.inputs.prepare_request(
                prompt, p, field_name=f"prompts[{i}]")
            parent.final_only = True
            checked.append((parent, p, max_tokens))
        return checked

    def _admission_order(self, checked: list[tuple[ParentRequest, SamplingParams, int]]
                         ) -> list[int]:
        config = self.engine.config
        if (self.prefix_sharing == "off" or not config.cache.enable_prefix_caching
                or len(checked) < 2):
            return list(range(len(checked)))
        return sharing_order([parent.prompt_token_ids for parent, _, _ in checked],
                             [max_tokens for _, _, max_tokens in checked],
                             config.cache.block_size,
                             [parent.cache_salt for parent, _, _ in checked])

    def _run(self, checked: list[tuple[ParentRequest, SamplingParams, int]],
             use_tqdm: bool) -> list[RequestOutput]:
        for index in self._admission_order(checked):
            self.engine.add_validated(*checked[index])
        results: dict[str, RequestOutput] = {}
        prompt_tokens = output_tokens = 0
        with tqdm(total=len(checked), desc="generate", unit="req",
                  disable=not use_tqdm or len(checked) < 2) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            prompt_tokens += len(out.prompt_token_ids)
                            output_tokens += sum(len(c.token_ids) for c in out.outputs)
                            elapsed = max(bar.format_dict["elapsed"], 1e-9)
                            # As vLLM's bar: the finished requests' tokens per second so far.
                            bar.set_postfix_str(f"in {prompt_tokens / elapsed:.0f} tok/s, "
                                                f"out {output_tokens / elapsed:.0f} tok/s",
                                                refresh=False)
                            bar.update(1)
            except BaseException:
                # Ctrl-C or a failed step: end this call's requests, so their KV blocks
                # go back to the pool and the next call does not run them again.
                for parent, _, _ in checked:
                    self.engine.abort_request(parent.request_id)
                raise
        return [results[parent.request_id] for parent, _, _ in checked]


def _as_dict(prompt: PromptType) -> dict[str, Any]:
    return prompt if isinstance(prompt, dict) else {"prompt": prompt}

