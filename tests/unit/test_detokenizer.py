import pickle

from kvserve.engine.detokenizer import IncrementalDetokenizer, decodes_as_stream
from kvserve.models.loader import load_tokenizer


class ByteTokenizer:
    """Each token id is one byte of UTF-8."""

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(token_ids).decode("utf-8", errors="replace")


def test_multibyte_character_is_held_until_complete():
    detok = IncrementalDetokenizer(ByteTokenizer(), True, [], 0)
    emitted = []
    for byte in "añ€😀b".encode():
        detok.update([byte])
        emitted.append(detok.text)
    assert "\ufffd" not in "".join(emitted)
    assert detok.text == "añ€😀b"
    assert emitted[:3] == ["a", "a", "añ"]


def test_stop_string_across_tokens_is_cut():
    detok = IncrementalDetokenizer(ByteTokenizer(), True, ["END", "zz"], 0)
    hit = None
    for byte in b"helloEN":
        hit = detok.update([byte])
        assert hit is None
    assert detok.update([ord("D")]) == "END"
    assert detok.text == "hello"


def test_a_kept_stop_string_ends_the_text():
    detok = IncrementalDetokenizer(ByteTokenizer(), True, ["END"], 0, keep_stop=True)
    assert detok.update(list(b"helloENDmore")) == "END"
    assert detok.text == "helloEND"


def test_stop_strings_wait_for_min_tokens():
    detok = IncrementalDetokenizer(ByteTokenizer(), True, ["a"], 2)
    assert detok.update([ord("a")]) is None
    assert detok.update([ord("b")]) is None
    assert detok.update([ord("a")]) == "a"
    assert detok.text == "ab"  # the "a" inside the first min_tokens tokens is kept


def test_a_fast_tokenizer_streams_the_text_decode_gives(llama_dir):
    """Token by token through `tokenizers.DecodeStream`: the text of decoding all tokens at
    once, with multi-byte characters held until whole, and the same after a move to another
    engine (pickled, then attached to that engine's tokenizer) at every point."""
    tokenizer = load_tokenizer(str(llama_dir))
    assert decodes_as_stream(tokenizer) and not decodes_as_stream(ByteTokenizer())
    ids = tokenizer.encode("Añ €5, 😀 naïve 東京 def f(x):\n    return x", add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for cut in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer, True, [], 0)
        assert detok.stream is not None
        for token_id in ids[:cut]:
            detok.update([token_id])
            assert "\ufffd" not in detok.text
        moved = pickle.loads(pickle.dumps(detok))
        moved.attach(tokenizer)
        moved.update(ids[cut:])
        assert moved.text == whole
