from kvserve.engine.detokenizer import IncrementalDetokenizer


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


def test_stop_strings_wait_for_min_tokens():
    detok = IncrementalDetokenizer(ByteTokenizer(), True, ["a"], 2)
    assert detok.update([ord("a")]) is None
    assert detok.update([ord("b")]) is None
    assert detok.update([ord("a")]) == "a"
    assert detok.text == "ab"  # the "a" inside the first min_tokens tokens is kept
