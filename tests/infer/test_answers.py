"""answer_batch gives, batch after batch, the answers one prompt at a time would (greedy), cut at the template's and
the caller's stop strings; a seed makes sampled answers repeat; prompts near the end of the context get what room
is left, and one with none is a clear error."""
import pytest
from conftest import TINY_MODEL, random_model

from minigpt.checkpoint.native import save_pretrained
from minigpt.errors import MiniGPTError
from minigpt.infer.answers import answer_batch, load_chat_model
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.tokenizer.chat_template import PLAIN_STOP
from minigpt.tokenizer.tokenizer import Tokenizer

WORDS = "the king is dead long live the queen and her horse rides to the sea at dawn".split()
CONVERSATIONS = [[{"role": "user", "content": " ".join(WORDS[i:i + 1 + i % 5])}] for i in range(7)]


def message(n_words):
    return [{"role": "user", "content": " ".join((WORDS * 4)[:n_words])}]


@pytest.fixture(scope="module")
def chat(tiny_data, tmp_path_factory):
    path = tmp_path_factory.mktemp("answers") / "model"
    tok = Tokenizer.from_dir(tiny_data)
    # Noise large enough that greedy answers differ from prompt to prompt; no chat template: the plain one.
    save_pretrained(random_model(dict(vocab_size=tok.vocab_size, **TINY_MODEL), seed=3, noise=0.5), path,
                    tokenizer=tok)
    return load_chat_model(path)


def one_at_a_time(chat, conversation, max_tokens, stops=()):
    ids = chat.template.prompt(conversation)
    budget = min(max_tokens, chat.model.config.max_seq_len - len(ids))
    tokens = generate_tokens(chat.model, ids, SamplingParams(max_tokens=budget, temperature=0.0),
                             stop_ids=chat.stop_ids)
    text = chat.tokenizer.decode(list(tokens))
    for stop in (*stops, *chat.template.stop):
        text = text.split(stop)[0]
    return text.strip()


def test_greedy_answers_equal_one_prompt_at_a_time(chat):
    assert chat.template.stop == (PLAIN_STOP,)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [one_at_a_time(chat, c, 24) for c in CONVERSATIONS]
    assert len(set(expected)) > 3  # the prompts get different answers: the order is checked too
    for batch_size in (1, 3, 7, 64):
        assert answer_batch(chat, CONVERSATIONS, greedy, batch_size=batch_size) == expected


def test_a_stop_string_of_the_caller_cuts_the_answer_too(chat):
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    free = answer_batch(chat, CONVERSATIONS, greedy)
    stop = next(a for a in free if len(a) > 12)[6:9]
    cut = answer_batch(chat, CONVERSATIONS, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))
    assert cut == [one_at_a_time(chat, c, 24, stops=(stop,)) for c in CONVERSATIONS]
    assert cut != free and all(stop not in a for a in cut)


def test_a_seed_repeats_the_sampled_answers(chat):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    first = answer_batch(chat, CONVERSATIONS * 2, params, batch_size=4)
    assert answer_batch(chat, CONVERSATIONS * 2, params, batch_size=4) == first
    assert answer_batch(chat, CONVERSATIONS * 2, SamplingParams(max_tokens=16, temperature=1.0, seed=6),
                        batch_size=4) != first


def test_a_prompt_answered_alone_draws_its_own_numbers(chat):
    """A prompt with less room than the budget is answered alone, with the seed of its own place: its sampled
    answer is the one it gets as the first of its own call with that seed (not the numbers of its batch's first
    row), and the rows answered together keep theirs."""
    max_seq_len = chat.model.config.max_seq_len
    # the shortest prompt with less room than the budget: as many sampled tokens as such a prompt can have
    k = min(k for k in range(1, 40) if len(chat.template.prompt(message(k))) + 24 > max_seq_len)
    short0, long1, short2 = CONVERSATIONS[0], message(k), CONVERSATIONS[2]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    got = answer_batch(chat, [short0, long1, short2], params)
    assert got[1] == answer_batch(chat, [long1], SamplingParams(max_tokens=24, temperature=1.0, seed=6))[0]
    assert got[1] != answer_batch(chat, [long1], params)[0]  # the batch's own seed draws other numbers
    assert [got[0], got[2]] == answer_batch(chat, [short0, short2], params)


def test_the_context_bounds_the_budget_and_a_full_prompt_is_an_error(chat):
    max_seq_len = chat.model.config.max_seq_len
    lengths = {k: len(chat.template.prompt(message(k))) for k in range(1, 40)}
    # The longest prompt that leaves room, then the first that leaves none.
    k = max(k for k, n in lengths.items() if n < max_seq_len)
    assert lengths[k] > max_seq_len - 24  # fewer than 24 tokens of room
    long, too_long = message(k), message(min(k for k, n in lengths.items() if n >= max_seq_len))
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    assert answer_batch(chat, [long] + CONVERSATIONS[:2], greedy) == [
        one_at_a_time(chat, c, 24) for c in [long] + CONVERSATIONS[:2]]
    with pytest.raises(MiniGPTError, match="no room"):
        answer_batch(chat, [too_long], greedy)
    with pytest.raises(MiniGPTError, match="batch_size"):
        answer_batch(chat, CONVERSATIONS, greedy, batch_size=0)
