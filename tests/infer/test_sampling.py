"""Sampling settings (validated once), the context-length check, sampling filters, and stop handling (stop ids,
stop strings never returned, held-back text released at the end)."""
from types import SimpleNamespace

import pytest
import torch

from minigpt.errors import MiniGPTError
from minigpt.infer.sampling import InvalidRequest, SamplingParams, check_length, sample, sampling_probs
from minigpt.infer.stops import StopChecker, default_stop_ids, held_back


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", "hot"), ("top_k", -1), ("top_k", 1.5), ("top_p", 0.0),
    ("top_p", 1.5), ("stop", ("ok", "")), ("stop", (3,)), ("seed", 1.0),
])
def test_sampling_params_refuse_out_of_range_values(field, value):
    with pytest.raises(InvalidRequest, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert isinstance(e.value, ValueError) and isinstance(e.value, MiniGPTError)


def test_sampling_params_normalise_stop_and_replace_validates_again():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop="a").stop == ("a",)
    p = SamplingParams(max_tokens=0, temperature=0, top_k=0, top_p=1.0)  # all at their "off" / placeholder values
    assert p.greedy and p.replace(max_tokens=5).max_tokens == 5
    with pytest.raises(InvalidRequest):
        p.replace(temperature=-1)


def test_check_length():
    assert check_length(10, 5, 64) == (0, 5)
    assert check_length(10, None, 64) == (0, 54)  # None: the rest of the context
    assert check_length(62, 5, 64, truncate=True) == (3, 5)  # drop the 3 oldest prompt tokens
    cases = [((0, 5, 64), "prompt", "empty"), ((10, 0, 64), "max_tokens", "at least 1"),
             ((10, 64, 64), "max_tokens", "below the model's context of 64"),
             ((60, 5, 64), "max_tokens", "60 tokens \\+ max_tokens 5 exceeds the model's context of 64"),
             ((64, 5, 64), "prompt", "exceeds"), ((64, None, 64), "prompt", "at least one generated token")]
    for args, param, message in cases:
        with pytest.raises(InvalidRequest, match=message) as e:
            check_length(*args)
        assert e.value.param == param
    with pytest.raises(InvalidRequest, match="max_new_tokens 5 exceeds .*; lower it"):
        check_length(60, 5, 64, name="max_new_tokens", hint="lower it")


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert sample(logits, SamplingParams(temperature=0)).tolist() == [0]
    top2 = sampling_probs(logits, SamplingParams(top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2.sum(), torch.tensor(1.0))
    # top_p below the most likely token's mass keeps that token alone.
    assert sampling_probs(logits, SamplingParams(top_p=0.1))[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(sampling_probs(logits, SamplingParams(top_k=0, top_p=1.0)), full)
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(top_k=2), g)) for _ in range(50)}
    assert draws == {0, 1}


def test_default_stop_ids():
    assert default_stop_ids(SimpleNamespace(eos_id=2, bos_id=1)) == [2, 1]
    assert default_stop_ids(SimpleNamespace(eos_id=2, bos_id=2)) == [2]
    assert default_stop_ids(SimpleNamespace(eos_id=None, bos_id=None)) == []
    assert default_stop_ids(None) == []


class Chars:
    """A tokenizer whose token ids are Unicode code points."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def stream(checker, text):
    """Push ``text`` one character-token at a time; returns what was shown, stopping when the checker does."""
    shown = []
    for c in text:
        shown.append(checker.push(ord(c)))
        if checker.stopped:
            break
    else:
        shown.append(checker.finish())
    return shown


def test_stop_string_is_cut_and_its_beginning_never_shown():
    checker = StopChecker(Chars(), stop=("never", "lo w"))
    shown = stream(checker, "hello world")
    assert "".join(shown) == checker.text == "hel"
    assert checker.stopped and checker.kept  # the token completing a stop string stays in the completion
    # An "l" might begin "lo w": held back until the next character says; "lo " is dropped with the stop string.
    assert shown == ["h", "e", "", "l", "", "", ""]


def test_held_back_text_is_released_when_the_stop_string_does_not_come():
    checker = StopChecker(Chars(), stop=("world!",))
    shown = stream(checker, "hello world")
    assert "".join(shown) == checker.text == "hello world"
    assert not checker.stopped and shown[-1] == "world"  # held back to the end, released by finish()
    assert held_back("hello wor", ("world!", "or")) == 3


def test_stop_id_ends_without_being_part_of_the_text():
    checker = StopChecker(Chars(), stop_ids=[ord("!")])
    assert "".join(stream(checker, "hi! there")) == checker.text == "hi"
    assert checker.stopped and not checker.kept
    assert checker.finish() == ""
    no_text = StopChecker(None, stop_ids=[7], stop=("x",))  # without a tokenizer only stop ids apply
    assert no_text.push(ord("x")) == "" and not no_text.stopped
    no_text.push(7)
    assert no_text.stopped
