"""A Conversation answers each turn exactly as a generation from an empty cache would, prefills only the tokens
after those its cache holds, grows its cache in powers of two without losing the held columns, and never claims
columns a stopped or interrupted turn did not finish."""
import pytest
import torch
from conftest import random_model

from minigpt.errors import MiniGPTError
from minigpt.infer.conversation import Conversation
from minigpt.infer.fastpath import FastPath
from minigpt.infer.generate import generate_tokens
from minigpt.infer.kv_cache import FIRST_LENGTH
from minigpt.infer.sampling import InvalidRequest, SamplingParams

SHAPE = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=1024, multiple_of=16)
GREEDY = SamplingParams(max_tokens=20, temperature=0)


def prefilled_lengths(model, monkeypatch) -> list[int]:
    """Record the number of tokens of each multi-token forward of ``model`` (its prefills)."""
    seen, real = [], type(model).forward

    def spy(self, tokens, *a, **k):
        if tokens.shape[1] > 1:
            seen.append(tokens.shape[1])
        return real(self, tokens, *a, **k)

    monkeypatch.setattr(type(model), "forward", spy)
    return seen


@pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "transformer"])
def test_turns_answer_as_from_an_empty_cache_and_prefill_only_the_new_tokens(fast, monkeypatch):
    model = random_model(SHAPE, noise=0.5)
    model = FastPath(model) if fast else model
    conversation = Conversation(model)
    prompt, lengths = [1, 2, 3, 4, 5], []
    seen = prefilled_lengths(model, monkeypatch)
    for _ in range(5):
        answer = list(conversation.generate(prompt, GREEDY))
        lengths.append(conversation.cache.max_seq_len)
        fresh = list(generate_tokens(model, prompt, GREEDY))
        assert answer == fresh and len(answer) == GREEDY.max_tokens
        # The next turn: this conversation, its answer, and a new message of 100 tokens.
        prompt = prompt + answer + [(i * 7) % 61 for i in range(100)]
    # Conversation's prefills alternate with the fresh runs' (whole prompts): only the message and the answer's
    # last token (never run through the model) were new.
    assert seen[0::2] == [5] + [101] * 4
    assert seen[1::2] == [5 + 120 * t for t in range(5)]
    assert lengths == [FIRST_LENGTH, FIRST_LENGTH, 2 * FIRST_LENGTH, 2 * FIRST_LENGTH, 2 * FIRST_LENGTH]


def test_where_the_step_serves_every_length_a_turns_cache_holds_its_prompt_and_grows_with_the_answer(monkeypatch):
    """The eager fast path told that its step serves every length (as a compiled package's does): the same
    answers as from an empty cache, the held columns carried over, and lengths that follow the conversation (the
    prompt plus one, then 64 more at a time) rather than powers of two from FIRST_LENGTH."""
    model = FastPath(random_model(SHAPE, noise=0.5))
    monkeypatch.setattr(FastPath, "any_cache_length", property(lambda self: True))
    conversation = Conversation(model)
    prompt, lengths, seen = [1, 2, 3, 4, 5], [], prefilled_lengths(model, monkeypatch)
    for _ in range(3):
        answer = list(conversation.generate(prompt, SamplingParams(max_tokens=70, temperature=0)))
        lengths.append(conversation.cache.max_seq_len)
        monkeypatch.setattr(FastPath, "any_cache_length", property(lambda self: False))
        assert answer == list(generate_tokens(model, prompt, SamplingParams(max_tokens=70, temperature=0)))
        monkeypatch.setattr(FastPath, "any_cache_length", property(lambda self: True))
        prompt = prompt + answer + [(i * 7) % 61 for i in range(30)]
    assert seen[0::2] == [5, 31, 31]  # only each new message and the answer's last token were prefilled
    # Each turn: its prompt + 1 columns (5 + 1; 105 + 1, the 74 held ones copied; 205 + 1), 64 more, then the
    # prompt + 70 new tokens the turn may take (the eager path does not round lengths up)
    assert lengths == [75, 175, 275]


def test_a_stopped_answer_and_an_interrupted_turn_keep_only_finished_columns():
    model = FastPath(random_model(SHAPE, noise=0.5))
    conversation = Conversation(model)
    prompt = [1, 2, 3, 4, 5]
    tokens = conversation.generate(prompt, GREEDY)
    first = [next(tokens), next(tokens), next(tokens)]
    tokens.close()  # a stop string matched: the caller stops reading
    assert conversation.cached == prompt + first[:2]
    longer = prompt + first + [9, 9, 9]
    tokens = conversation.generate(longer, GREEDY)
    tokens.close()  # closed before its prefill ran: nothing new is claimed
    assert conversation.cached == prompt + first[:2]
    assert list(conversation.generate(longer, GREEDY)) == list(generate_tokens(model, longer, GREEDY))


def test_a_turn_past_the_context_is_refused_and_a_reset_forgets():
    model = FastPath(random_model(SHAPE, noise=0.5))
    with pytest.raises(MiniGPTError, match="exceeds the model's context of 1024 tokens"):
        Conversation(model, context=2048)
    with pytest.raises(MiniGPTError, match="at least 2 tokens"):
        Conversation(model, context=1)
    conversation = Conversation(model, context=100)
    with pytest.raises(InvalidRequest, match="context of 100"):
        list(conversation.generate(list(range(1, 60)), SamplingParams(max_tokens=50, temperature=0)))
    list(conversation.generate([1, 2, 3], GREEDY))
    assert conversation.cache.max_seq_len <= 128 and conversation.cached
    conversation.reset()
    assert conversation.cached == []
    torch.testing.assert_close(torch.tensor(list(conversation.generate([1, 2, 3], GREEDY))),
                               torch.tensor(list(generate_tokens(model, [1, 2, 3], GREEDY))))
