"""`minigpt chat` keeps its conversation's keys and values between turns: the second turn reuses the first turn's
prompt and answer from the prefix cache and answers exactly what a run recomputing everything answers."""
import io

import pytest
from serve_helpers import CHAT_WORDS, chat_model

import minigpt.serve.chat as chat_module
from minigpt.infer.engine import Engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("chat"))


def chat(ckpt, monkeypatch, **kw):
    engines = []

    class Spy(Engine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.prompts = []
            engines.append(self)

        def submit(self, prompt, *a, **k):
            self.prompts.append(list(prompt))
            return super().submit(prompt, *a, **k)

    monkeypatch.setattr(chat_module, "Engine", Spy)
    out = io.StringIO()
    system = " ".join(CHAT_WORDS * 4)  # a long system prompt: most of the first turn's prompt
    stdin = io.StringIO("tell me about the cat\nand why is the sky blue\n")
    chat_module.run_chat(str(ckpt), max_tokens=12, temperature=0, system=system, device="cpu", stdin=stdin,
                         stdout=out, **kw)
    return out.getvalue(), engines[0]


def test_second_turn_reuses_the_conversation_and_answers_as_a_fresh_run(ckpt, monkeypatch):
    cached, engine = chat(ckpt, monkeypatch)
    fresh, off = chat(ckpt, monkeypatch, prefix_cache=False)
    assert cached == fresh
    answers = [line for line in cached.splitlines() if line.startswith("assistant> ")]
    assert len(answers) == 2 and all(len(a) > len("assistant> ") for a in answers)
    first, second = engine.prompts
    assert second[:len(first)] == first
    # The second turn's prompt starts with the first one: all its full blocks came from the cache (and the answer's
    # too, as far as its text re-encodes to the tokens generated).
    assert engine.metrics.prefix_cache_hit_tokens.value() >= len(first) // engine.block_size * engine.block_size > 0
    assert off.metrics.prefix_cache_hit_tokens.value() == 0
