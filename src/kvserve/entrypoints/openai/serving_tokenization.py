"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's routes): the model's
tokenizer, for clients that count or score tokens themselves (lm-evaluation-harness finds
the tokenizer here)."""

from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.entrypoints.openai.serving import Serving


class TokenizationServer(Serving):
    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        inputs = self.llm.inputs
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("prompt and messages: give exactly one")
        if request.messages is not None:
            ids = request.prompt_token_ids(inputs)
        else:
            ids = inputs.encode(request.prompt, "prompt", request.add_special_tokens)
        strs = inputs.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": inputs.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, str]:
        inputs = self.llm.inputs
        ids = inputs.check_token_ids(request.tokens, "tokens") if request.tokens else []
        return {"prompt": inputs.tokenizer.decode(ids)}

    def tokenizer_info(self) -> dict[str, Any]:
        tokenizer = self.llm.inputs.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__,
                "vocab_size": self.llm.inputs.limits.vocab_size,
                "model_max_length": self.llm.inputs.max_model_len,
                "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                "chat_template": tokenizer.chat_template}
