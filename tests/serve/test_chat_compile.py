"""`minigpt chat --compile` answers through a Conversation over the fast path (no engine): greedy answers, stop
strings and the held-back text are those of the engine's chat; the compiled step's answers too (slow)."""
import io
import re

import pytest
from serve_helpers import chat_model

import minigpt.serve.chat as chat_module
from minigpt.infer.fastpath import load_for_inference

QUESTIONS = "tell me about the cat\nand why is the sky blue\n/reset\nplease answer briefly\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("chat"))


def transcript(ckpt, **kw) -> str:
    """The chat's output; with ``compile=True`` without its one line about compiling (checked here)."""
    out = io.StringIO()
    chat_module.run_chat(str(ckpt), max_tokens=16, temperature=0, system="answer briefly", device="cpu",
                         stdin=io.StringIO(QUESTIONS), stdout=out, **kw)
    lines = out.getvalue().split("\n")
    notes = [i for i, line in enumerate(lines) if line.startswith("(--compile: ")]
    assert notes == ([1] if kw.get("compile") else [])
    return "\n".join(line for i, line in enumerate(lines) if i not in notes)


def uncompiled_conversations(monkeypatch) -> list:
    """``compile=True`` builds a Conversation over the eager fast path (no compilation: the chat loop is under
    test); returns the list of Conversations built."""
    built = []

    def load(*a, compile=False, **k):
        return load_for_inference(*a, **k)

    class Spy(chat_module.Conversation):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

    monkeypatch.setattr(chat_module, "load_for_inference", load)
    monkeypatch.setattr(chat_module, "Conversation", Spy)
    return built


def test_the_conversation_path_answers_as_the_engine(ckpt, monkeypatch):
    engine = transcript(ckpt)
    built = uncompiled_conversations(monkeypatch)
    assert transcript(ckpt, compile=True) == engine
    assert len(built) == 1 and built[0].cached  # the one conversation kept its cache between turns
    assert engine.count("assistant> ") == 3 and "(conversation cleared)" in engine


def test_stop_strings_end_the_compiled_path_answer_too(ckpt, monkeypatch):
    plain = transcript(ckpt)
    answer = plain.split("assistant> ")[1].split("\n")[0]
    stop = answer.strip().split(" ")[1] if " " in answer.strip() else answer.strip()[1:3]
    real = chat_module.SamplingParams

    def with_stop(**k):  # the chat template's own stop strings plus one word of the first answer
        return real(**{**k, "stop": tuple(k.get("stop", ())) + (stop,)})

    monkeypatch.setattr(chat_module, "SamplingParams", with_stop)
    engine = transcript(ckpt)
    uncompiled_conversations(monkeypatch)
    assert transcript(ckpt, compile=True) == engine
    assert engine != plain and stop not in engine.split("assistant> ")[1].split("\n")[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["engine", "conversation"])
def test_stats_print_each_answers_first_token_decode_rate_and_compile_time(ckpt, monkeypatch, capsys, compiled):
    if compiled:
        uncompiled_conversations(monkeypatch)
    out = transcript(ckpt, compile=compiled, stats=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == out.count("assistant> ") == 3
    for line in lines:
        m = re.fullmatch(r"\[prompt (\d+) tokens \| time to first token (\d+\.\d\d) s \| decode (\d+\.\d\d) "
                         r"tokens/s \((\d+) tokens\) \| compile (\d+\.\d\d) s\]", line)
        assert m, line
        assert int(m[1]) > 0 and float(m[3]) > 0 and 1 < int(m[4]) <= 16 and float(m[5]) == 0.0


@pytest.mark.slow
def test_compiled_chat_answers_as_the_engine(ckpt):
    assert transcript(ckpt, compile=True) == transcript(ckpt)
