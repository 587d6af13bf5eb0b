"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine, ParentRequest, PromptType
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class LLM:
    """Takes the engine options of `EngineConfig.create` (model, dtype, max_num_batched_tokens,
    max_num_seqs, block_size, kv_cache_memory, max_model_len, seed, device, scheduler_policy)."""

    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.create(model, **engine_options))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in the prompts' order. Every prompt
        is validated before any runs, so one bad prompt raises ValueError naming its index
        and leaves the engine as it was."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for "
                             f"{len(prompts)} prompts")
        return self._run(self._validate(prompts, params), use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the checkpoint's chat template to one conversation or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            ids = self.engine.apply_chat_template(conversation, add_generation_prompt,
                                                  f"messages[{i}]")
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _validate(self, prompts: list[PromptType], params: list[SamplingParams]
                  ) -> list[tuple[ParentRequest, SamplingParams, int]]:
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            parent, max_tokens = self.engine.prepare_request(prompt, p, field_name=f"prompts[{i}]")
            checked.append((parent, p, max_tokens))
        return checked

    def _run(self, checked: list[tuple[ParentRequest, SamplingParams, int]],
             use_tqdm: bool) -> list[RequestOutput]:
        for parent, p, max_tokens in checked:
            self.engine.add_validated(parent, p, max_tokens)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(checked), desc="generate", unit="req",
                  disable=not use_tqdm or len(checked) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[parent.request_id] for parent, _, _ in checked]
