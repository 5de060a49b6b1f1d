from __future__ import annotations

from slotserve.engine.detokenizer import IncrementalDetokenizer


def _bytes(token_id: int) -> bytes:
    return bytes([token_id])


def _feed(detok: IncrementalDetokenizer, data: bytes) -> list[str]:
    deltas = []
    for byte in data:
        detok.add_token(byte)
        deltas.append(detok.take_delta())
        if detok.matched_stop:
            break
    deltas.append(detok.take_delta(final=True))
    return deltas


def test_stop_string_is_found_across_tokens_and_cut() -> None:
    detok = IncrementalDetokenizer(_bytes, ["</end>"])
    deltas = _feed(detok, b"answer: 42</end> trailing")
    assert "".join(deltas) == "answer: 42"
    assert detok.matched_stop == "</end>"


def test_earliest_of_several_stop_strings_wins() -> None:
    detok = IncrementalDetokenizer(_bytes, ["world", "lo w"])
    assert "".join(_feed(detok, b"hello world")) == "hel"
    assert detok.matched_stop == "lo w"


def test_incomplete_utf8_is_held_until_complete() -> None:
    detok = IncrementalDetokenizer(_bytes)
    deltas = _feed(detok, "€".encode())
    assert deltas == ["", "", "€", ""]


def test_final_flush_replaces_a_truncated_code_point() -> None:
    detok = IncrementalDetokenizer(_bytes)
    detok.add_token(0xE2)
    assert detok.take_delta() == ""
    assert detok.take_delta(final=True) == "\ufffd"
