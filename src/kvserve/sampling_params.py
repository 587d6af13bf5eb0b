"""Per-request generation settings, validated where they enter the engine."""

from __future__ import annotations

import difflib
import functools
import json
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.vllm_flags import VLLM_SAMPLING_FIELDS

MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +100 all but forces a token, -100 all but bans it
GREEDY_BELOW_TEMPERATURE = 1e-5
# Scaling factors (temperature, repetition_penalty) stay within these, so that scaled logits
# stay finite in float32 and a masked (-inf) logit stays masked: beyond them, one scaled to
# inf or 0 turns -inf into NaN, and sampling then has no distribution to draw from.
MAX_SCALE = 1e6
MIN_REPETITION_PENALTY = 1 / MAX_SCALE


@dataclass
class StructuredOutputParams:
    """Keeps the output inside a grammar (vLLM's `guided_*` extras, OpenAI's
    `response_format`): exactly one of a JSON schema, any JSON object, a regular expression,
    a choice among strings or a Lark grammar (llguidance's dialect). JSON is compact (no free
    whitespace), so a schema whose values are bounded also bounds the output."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("json_object", self.json_object),
                                          ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar))
                 if value not in (None, False)]
        _check(len(given) == 1, "structured_output",
               "takes exactly one of json, json_object, regex, choice and grammar", given)
        if self.choice is not None:
            _check(isinstance(self.choice, list) and bool(self.choice)
                   and all(isinstance(c, str) and c for c in self.choice), "choice",
                   "must be a non-empty list of non-empty strings", self.choice)
        self.compiled  # noqa: B018 (compiles it: a bad schema or regex fails here, by name)

    @functools.cached_property
    def compiled(self) -> str:
        """The constraint as an llguidance grammar."""
        from llguidance import LLMatcher

        compact = {"whitespace_flexible": False}
        if self.json is not None:
            field_name = "json"
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=compact)
            except ValueError as e:
                raise ValueError(f"json must be a JSON schema object: {e}") from None
        elif self.json_object:
            field_name = "json_object"
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        elif self.regex is not None:
            field_name, grammar = "regex", LLMatcher.grammar_from_regex(self.regex)
        elif self.grammar is not None:
            field_name, grammar = "grammar", LLMatcher.grammar_from_lark(self.grammar)
        else:
            field_name = "choice"
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice or []))
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"{field_name} is not a valid constraint: {error.strip()}")
        return grammar


def _named_fields_only(cls: type) -> type:
    """Wraps a dataclass's __init__ so that a keyword it lacks is named with the nearest
    field, or with what kvserve has for one of vLLM's, rather than Python's bare
    "unexpected keyword argument"."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]
    known = frozenset(names)

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in known:
                raise TypeError(_unknown_field(cls.__name__, name, names))
        init(self, *args, **kwargs)

    cls.__init__ = checked_init  # type: ignore[method-assign]
    return cls


def _unknown_field(owner: str, name: str, names: list[str]) -> str:
    if name in VLLM_SAMPLING_FIELDS:
        return f"{owner} has no field {name!r} (vLLM's): {VLLM_SAMPLING_FIELDS[name]}"
    near = difflib.get_close_matches(name, names, n=1)
    return f"{owner} has no field {name!r}" + (f" (did you mean {near[0]}?)" if near else "")


@_named_fields_only
@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; names and meanings follow vLLM and OpenAI."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-k's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    structured_output: StructuredOutputParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)
    allowed_token_ids: list[int] | None = None  # vLLM's: sample among these tokens only
    # vLLM's: keep only the prompt's last k tokens; -1: as many as the context holds beside
    # max_tokens
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never generated; each, as written and after a space, has its last token
    # banned wherever the output ends with the tokens before it
    bad_words: list[str] | None = None
    # bad_words as token-id sequences, which the engine fills in with the model's tokenizer;
    # given alone, sequences banned as they are
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        _normalize_scalars(self)
        _check(self.structured_output is None
               or isinstance(self.structured_output, StructuredOutputParams),
               "structured_output", "must be a StructuredOutputParams", self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        _check(isinstance(self.stop, list | tuple), "stop",
               "must be a string or a list of strings", self.stop)
        self.stop = list(self.stop)
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, list | tuple), name,
                   "must be a list of token ids", value)
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]", self.n)
        _check(0.0 <= self.temperature <= MAX_SCALE, "temperature",
               f"must be in [0, {MAX_SCALE:g}]", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k in (-1, 0) or self.top_k >= 1, "top_k",
               "must be -1 or 0 (off) or >= 1", self.top_k)
        if self.top_k == 0:  # vLLM's and Hugging Face's spelling of off
            self.top_k = -1
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_SCALE,
               "repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_SCALE:g}]",
               self.repetition_penalty)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               "must be in [-2, 2]", self.frequency_penalty)
        _check(self.seed is None or -2**63 <= self.seed < 2**63, "seed",
               f"must be in [{-2**63}, {2**63 - 1}] (64-bit)", self.seed)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1",
               self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
               "truncate_prompt_tokens", "must be -1 (the context's room) or >= 1",
               self.truncate_prompt_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings", self.stop)
        _check(_are_token_ids(self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers", self.stop_token_ids)
        self.stop_token_ids = _as_ints(self.stop_token_ids)
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
               "must be a dict of token id -> bias", self.logit_bias)
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.logit_bias is not None:
            _check(_are_token_ids(self.logit_bias), "logit_bias",
                   "keys must be token ids (non-negative integers)", list(self.logit_bias))
            self.logit_bias = dict(zip(_as_ints(self.logit_bias), self.logit_bias.values(),
                                       strict=True))
            _check(all(isinstance(b, int | float) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                       for b in self.logit_bias.values()), "logit_bias",
                   f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                   list(self.logit_bias.values()))
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids) and _are_token_ids(self.allowed_token_ids),
                   "allowed_token_ids",
                   "must be a non-empty list of token ids", self.allowed_token_ids)
            self.allowed_token_ids = _as_ints(self.allowed_token_ids)
            # Either could ban every allowed token, leaving nothing to sample.
            _check(not self.min_tokens, "allowed_token_ids",
                   "cannot be set with min_tokens", self.allowed_token_ids)
            _check(self.structured_output is None, "allowed_token_ids",
                   "cannot be set with structured_output", self.allowed_token_ids)
        self._check_bad_words()
        _check(not (self.structured_output and self.ignore_eos), "ignore_eos",
               "cannot be set with structured_output (the grammar ends the output with EOS)",
               self.ignore_eos)
        _check(not (self.structured_output and self.min_tokens), "min_tokens",
               "cannot be set with structured_output (the grammar decides where the output "
               "ends; banning EOS there would leave no token to pick)", self.min_tokens)

    def _check_bad_words(self) -> None:
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list | tuple)
                   and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words", "must be a list of non-empty strings", self.bad_words)
            self.bad_words = list(self.bad_words) or None
        if self.bad_words_token_ids is not None:
            _check(isinstance(self.bad_words_token_ids, list | tuple) and all(
                isinstance(s, list | tuple) and s and _are_token_ids(s)
                for s in self.bad_words_token_ids), "bad_words_token_ids",
                "must be a list of non-empty token-id lists", self.bad_words_token_ids)
            self.bad_words_token_ids = [_as_ints(s) for s in self.bad_words_token_ids] or None
        if self.bad_words or self.bad_words_token_ids:
            # Either could leave no token the bans allow.
            for name in ("allowed_token_ids", "structured_output"):
                _check(getattr(self, name) is None, "bad_words", f"cannot be set with {name}",
                       self.bad_words or self.bad_words_token_ids)

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 (vLLM's threshold) pick the argmax: dividing float32
        logits by one overflows them, or divides by zero once it rounds to float32."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def allows_drafts(self) -> bool:
        """Whether speculative drafts can be verified for the request: its next token
        depends on the raw logits alone (no penalties, bias, allowed set, bad words, grammar
        or logprobs; min_tokens aside)."""
        return (self.structured_output is None and self.logprobs is None
                and self.logit_bias is None and self.allowed_token_ids is None
                and not self.bad_words_token_ids
                and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty)


def is_integer(value: Any) -> bool:
    """An int, or a numpy or torch integer scalar (as `list(array)` gives), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _are_token_ids(values: Any) -> bool:
    """Whether every value is a non-negative integer; the vocabulary is checked where the
    model is known."""
    return all(is_integer(t) and t >= 0 for t in values)


def _as_ints(values: Any) -> list[int]:
    return [int(v) for v in values]


# What a scalar field's annotation accepts, how its error says so, and the Python type its
# value becomes (a numpy scalar's included).
_SCALAR_KINDS = {"int": (is_integer, "an integer", int),
                 "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
                           "a number", float),
                 "bool": (lambda v: isinstance(v, bool), "true or false", bool)}


@functools.cache
def _scalar_fields() -> list[tuple[str, str, bool]]:
    """(name, kind, optional) of SamplingParams' int, float and bool fields."""
    scalars = []
    for f in fields(SamplingParams):
        kind, _, rest = str(f.type).partition(" | ")
        if kind in _SCALAR_KINDS:
            scalars.append((f.name, kind, rest == "None"))
    return scalars


def _normalize_scalars(params: SamplingParams) -> None:
    """Names a scalar field given a value of another type, before its range is checked,
    where comparing a string with a number would raise a TypeError that names nothing; and
    turns numpy scalars into Python's."""
    for name, kind, optional in _scalar_fields():
        value = getattr(params, name)
        if optional and value is None:
            continue
        accepts, expected, python_type = _SCALAR_KINDS[kind]
        _check(accepts(value), name, f"must be {expected}{' or None' if optional else ''}",
               value)
        setattr(params, name, python_type(value))


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
