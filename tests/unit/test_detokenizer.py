"""Incremental detokenization and stop strings on the SmolLM2 tokenizer, token by token.

The oracle for the text is the tokenizer decoding the whole output at once; the stop-string
cases drive a request the way ``Scheduler.resolve`` does (append a token, check the stop
strings, hand out an output) and check the text, ``stop_reason`` and streamed pieces."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from hyloop import SamplingParams
from hyloop.features.stop_strings import check_stop_request, find_stop, held_back, stop_string_hit
from hyloop.framework.requests import Request, Status, request_output
from hyloop.models.tokenizer import IncrementalText, TextTokenizer


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    from hyloop.models.loader import load_tokenizer
    from hyloop.recipes.offline import default_checkpoint

    try:
        found = load_tokenizer(default_checkpoint())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert found is not None
    return found


@pytest.fixture(scope="module")
def pieces(tok: TextTokenizer) -> list[int]:
    """Token ids that hold only part of a multi-byte UTF-8 character."""
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]


def ids_of(tok: TextTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    tok: TextTokenizer, ids: list[int], stop_ids: frozenset[int] = frozenset(), **params: Any
) -> tuple[Request, list[str]]:
    """Feed ``ids`` to a request as the scheduler does; returns it and each output's text."""
    req = Request("r", [1], SamplingParams(**params), 0, len(ids), stop_ids)
    req.status, texts = Status.RUNNING, []
    req.text_hold = held_back(req.params)  # what the stop strings' attach sets
    for t in ids:
        req.output_ids.append(t)
        reason = "length" if len(req.output_ids) >= req.max_new else None
        if reason is None and t in stop_ids:
            reason = "stop"
        if reason != "stop" and (hit := stop_string_hit(req, tok)) is not None:
            req.stop_reason, reason = hit, "stop"
        if reason is not None:
            req.status, req.finish_reason = Status.FINISHED, reason
        texts.append(request_output(req, tok).outputs[0].text)
        if reason is not None:
            break
    return req, texts


# -- the text equals one whole decode ---------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_incremental_text_equals_the_whole_decode(
    tok: TextTokenizer, pieces: list[int], data: st.DataObject, skip: bool
) -> None:
    token = st.one_of(
        st.sampled_from(pieces), st.integers(0, 16), st.integers(0, tok.vocab_size - 1)
    )
    ids = data.draw(st.lists(token, min_size=1, max_size=40))
    params = SamplingParams(skip_special_tokens=skip)
    state = IncrementalText.start(tok, params)
    shown = ""
    for k in range(1, len(ids) + 1):
        state.take(tok, ids[:k])
        assert state.text.startswith(shown)  # text only grows while running
        assert not state.text.endswith("\ufffd")  # a split character waits
        assert tok.decode(ids[:k], skip_special_tokens=skip).startswith(state.text)
        shown = state.text
    state.finish(tok, ids)
    assert state.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", ["delta", "cumulative", "final_only"])
def test_streamed_text_joins_into_the_whole_decode(
    tok: TextTokenizer, pieces: list[int], kind: str
) -> None:
    ids = ids_of(tok, "naïve café → 日本語 😀 done") + pieces[:6] + ids_of(tok, " end")
    _, texts = stream(tok, ids, output_kind=kind, skip_special_tokens=False)
    whole = tok.decode(ids)
    if kind == "delta":
        assert "".join(texts) == whole
    else:
        assert texts[-1] == whole and all(whole.startswith(t) for t in texts)
    assert not any(t.endswith("\ufffd") for t in texts[:-1])


# -- stop strings --------------------------------------------------------------------------------
def test_find_stop_takes_the_first_stop_in_list_order() -> None:
    assert find_stop("xab", 2, ["b", "ab"], include=False) == ("b", 2)
    assert find_stop("xab", 2, ["ab", "b"], include=False) == ("ab", 1)
    assert find_stop("xab", 2, ["ab", "b"], include=True) == ("ab", -1)
    assert find_stop("xabcd", 3, ["ab"], include=True) == ("ab", 3)


def test_find_stop_searches_only_where_a_match_can_end_in_the_new_text() -> None:
    assert find_stop("stop here", 1, ["stop"], include=False) is None  # old text: seen before
    assert find_stop("xsto", 1, ["stop"], include=False) is None
    assert find_stop("xstop", 1, ["stop"], include=False) == ("stop", 1)  # spans old and new
    assert find_stop("abc", 0, ["c"], include=False) is None


def test_a_stop_string_spanning_tokens_cuts_the_text_not_the_ids(tok: TextTokenizer) -> None:
    ids = ids_of(tok, " Paris.\n\nThe answer is")
    req, texts = stream(tok, ids, stop="s.\n")
    sample = request_output(req, tok).outputs[0]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "s.\n")
    assert texts[-1] == " Pari"
    assert req.output_ids == ids[:3]  # " Paris", ".", "\n": the token that completed it stays


@pytest.mark.parametrize(("include", "text"), [(False, " "), (True, " Par")])
def test_include_stop_str_in_output_cuts_after_the_stop(
    tok: TextTokenizer, include: bool, text: str
) -> None:
    ids = ids_of(tok, " Paris is big")
    req, texts = stream(tok, ids, stop=["Par"], include_stop_str_in_output=include)
    assert texts[-1] == text and req.stop_reason == "Par" and len(req.output_ids) == 1


def test_several_stop_strings_the_first_listed_wins(tok: TextTokenizer) -> None:
    ids = ids_of(tok, " one two three")  # both strings complete on " two"
    req, texts = stream(tok, ids, stop=["wo", "two", "thr"])
    assert (req.stop_reason, texts[-1], len(req.output_ids)) == ("wo", " one t", 2)
    req, texts = stream(tok, ids, stop=["thr", "two", "wo"])
    assert (req.stop_reason, texts[-1], len(req.output_ids)) == ("two", " one ", 2)


@pytest.mark.parametrize("include", [False, True])
def test_delta_streaming_never_shows_a_partial_stop_string(
    tok: TextTokenizer, include: bool
) -> None:
    ids = ids_of(tok, " a b c d e f g h i j")
    stop = ["e f g", "x"]
    req, texts = stream(
        tok, ids, stop=stop, output_kind="delta", include_stop_str_in_output=include
    )
    final = " a b c d e f g" if include else " a b c d "
    assert "".join(texts) == final and req.stop_reason == "e f g"
    shown = ""
    for t in texts[:-1]:  # every running piece is part of the final text
        shown += t
        assert final.startswith(shown)
    assert held_back(req.params) == (0 if include else 4)


def test_cumulative_outputs_hold_back_the_longest_stop_less_one(tok: TextTokenizer) -> None:
    ids = ids_of(tok, " a b c d e f")
    _, texts = stream(tok, ids, stop=["zzzz", "q"])
    whole = tok.decode(ids)
    assert texts[-1] == whole  # no match: the finished output shows everything
    for k, t in enumerate(texts[:-1], 1):
        assert t == tok.decode(ids[:k])[:-3]


def test_no_stop_string_is_matched_within_min_tokens(tok: TextTokenizer) -> None:
    ids = ids_of(tok, " x y x y")
    req, texts = stream(tok, ids, stop="x", min_tokens=2)
    assert req.stop_reason == "x" and texts[-1] == " x y " and len(req.output_ids) == 3


def test_a_stop_token_hides_its_text_unless_included(tok: TextTokenizer) -> None:
    end = tok.token_to_id("<|im_end|>")
    assert end is not None
    ids = [*ids_of(tok, " Hi"), end, *ids_of(tok, " never")]
    for include, shown in ((False, " Hi"), (True, " Hi<|im_end|>")):
        req, texts = stream(
            tok,
            ids,
            frozenset({end}),
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        assert req.finish_reason == "stop" and texts[-1] == shown


# -- detokenizing options ------------------------------------------------------------------
def test_skip_special_tokens_false_shows_them(tok: TextTokenizer) -> None:
    ids = [1, *ids_of(tok, "user"), 2, *ids_of(tok, " ok")]
    assert stream(tok, ids)[1][-1] == "user ok"
    assert stream(tok, ids, skip_special_tokens=False)[1][-1] == "<|im_start|>user<|im_end|> ok"


def test_detokenize_false_gives_no_text_and_refuses_stop_strings(tok: TextTokenizer) -> None:
    assert stream(tok, ids_of(tok, " some text"), detokenize=False)[1] == ["", ""]
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False).validate()
    for bad in ("", ["a", ""], [3]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request 'r': stop="):  # no tokenizer, no text
        check_stop_request("request 'r'", SamplingParams(stop="x"), has_text=False)
    check_stop_request("request 'r'", SamplingParams(stop=[]), has_text=False)


def word_piece() -> TextTokenizer:
    """A word-piece tokenizer, whose decoder puts a space between tokens, specials included."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tk = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.decoder = decoders.WordPiece()
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("[CLS]", "[SEP]")])
    return TextTokenizer(tk, add_bos=False, bos_id=None, chat_template=None)


@pytest.mark.parametrize(
    ("skip", "spaces", "text"),
    [
        (False, True, "[CLS] [SEP] hello worlds [SEP]"),
        (False, False, "[CLS][SEP] hello worlds [SEP]"),  # only between two added tokens
        (True, False, "hello worlds"),
    ],
)
def test_spaces_between_special_tokens(skip: bool, spaces: bool, text: str) -> None:
    wp = word_piece()
    ids = [1, 2, 3, 4, 5, 2]
    assert wp.decode(ids) == "[CLS] [SEP] hello worlds [SEP]"
    for kind in ("delta", "final_only"):
        _, texts = stream(
            wp,
            ids,
            skip_special_tokens=skip,
            spaces_between_special_tokens=spaces,
            output_kind=kind,
        )
        assert ("".join(texts) if kind == "delta" else texts[-1]) == text


def test_spaces_between_special_tokens_changes_nothing_for_byte_level(tok: TextTokenizer) -> None:
    ids = [1, 2, *ids_of(tok, " a"), 2]
    for spaces in (True, False):
        text = stream(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert text[1][-1] == "<|im_start|><|im_end|> a<|im_end|>" == tok.decode(ids)
