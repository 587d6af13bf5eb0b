"""A real byte-level BPE tokenizer, trained locally on the Python standard library's sources."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvserve.tools.corpus import read_texts, stdlib_files

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with function tools shown and called as Qwen2.5's and Hermes' templates do: the tools'
# signatures in the system turn, calls as <tool_call> blocks, results as <tool_response>; and
# Qwen3's enable_thinking: false opens the answer with an empty <think> block.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_FORMAT.replace("\n", "\\n") + "<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message.tool_calls is defined "
    "and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{% for call in message.tool_calls %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """Trains a byte-level BPE with exactly `vocab_size` entries (ids 0-2 are the specials);
    returns it serialized as `tokenizer.json` text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # About 300 bytes of text per merge gives the trainer enough pairs to reach vocab_size.
    text = read_texts(list(stdlib_files()), max(200_000, vocab_size * 300))
    tokenizer.train_from_iterator(text, trainer)
    return tokenizer.to_str()


def tokenizer_config(max_length: int) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
