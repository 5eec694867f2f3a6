"""A tokenizer.json whose pre-tokenizer pattern backtracks without end (``^(a+)+$``): on some texts the
``tokenizers`` back end stops at Oniguruma's retry limit and raises a Rust panic, pyo3's PanicException, which is a
BaseException. It went past every ``except Exception``: a traceback from the command line, a 500 (or a dead
connection) from the server. It is now a TokenizerFailed (an InvalidText): one error line, a 400."""
import json

import pytest
from conftest import TINY_MODEL, random_model, run_cli
from serve.serve_helpers import InProcessServer

from minigpt.checkpoint.native import load_chat_template, load_tokenizer, save_pretrained
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, IM_END, IM_START, ChatTemplate, add_special_tokens
from minigpt.tokenizer.tokenizer import InvalidText, Tokenizer, TokenizerFailed, train_tokenizer

BACKTRACKING = {"type": "Split", "pattern": {"Regex": "^(a+)+$"}, "behavior": "Isolated", "invert": False}
HOSTILE_TEXT = "a" * 40 + "!"  # past the retry limit for this pattern; "a" * 10 + "!" is not


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = add_special_tokens(train_tokenizer(["the cat sat on a mat " * 5 + "aaaa!"] * 50, 300), (IM_START, IM_END))[0]
    path = save_pretrained(random_model(TINY_MODEL, vocab_size=tok.vocab_size), tmp_path_factory.mktemp("m") / "m",
                           tokenizer=tok, chat_template=CHATML_TEMPLATE)
    config = json.loads((path / "tokenizer.json").read_text())
    config["pre_tokenizer"] = BACKTRACKING
    (path / "tokenizer.json").write_text(json.dumps(config))
    (path / "manifest.json").unlink()  # as a hand-edited Hugging Face folder has none
    return path


def test_encode_and_encode_batch_raise_tokenizer_failed(model_dir):
    tok = load_tokenizer(model_dir)
    assert tok.encode("a" * 10 + "!") and tok.encode("the cat")  # the pattern works on most texts
    for call in (lambda: tok.encode(HOSTILE_TEXT), lambda: tok.encode(HOSTILE_TEXT, special=True),
                 lambda: tok.encode_batch(["the cat", HOSTILE_TEXT])):
        with pytest.raises(TokenizerFailed, match="the tokenizer cannot encode this text: .*retry-limit") as e:
            call()
        assert isinstance(e.value, InvalidText) and "\n" not in str(e.value)


def test_a_normalizer_pattern_fails_the_same_way(model_dir, tmp_path):
    config = json.loads((model_dir / "tokenizer.json").read_text())
    config.update(pre_tokenizer=None, normalizer={"type": "Replace", "pattern": {"Regex": "(a+)+$"}, "content": "b"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerFailed, match="cannot encode this text: .*retry-limit"):
        Tokenizer.from_file(tmp_path / "tokenizer.json").encode(HOSTILE_TEXT)


class PanicException(BaseException):
    """Stands for pyo3's, which only a real panic makes: recognised by its name, as the back end's is."""


def test_a_panic_while_decoding_is_tokenizer_failed_and_other_base_exceptions_pass(model_dir, monkeypatch):
    """Decoding runs in the server's stop checks, on its worker thread: a panic there ended the worker."""
    tok = load_tokenizer(model_dir)
    ids, real = tok.encode("the cat"), tok._hf

    def backend(decode):  # the real back end, but for decode
        return type("Backend", (), {"decode": staticmethod(decode), "__getattr__": lambda _, n: getattr(real, n)})()

    def panics(*args, **kwargs):
        raise PanicException("no entry found for key")

    monkeypatch.setattr(tok, "_hf", backend(panics))
    with pytest.raises(TokenizerFailed, match="cannot decode these tokens: no entry found for key"):
        tok.decode(ids)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tok, "_hf", backend(interrupted))
    with pytest.raises(KeyboardInterrupt):
        tok.decode(ids)


def test_a_chat_prompt_raises_tokenizer_failed(model_dir):
    chat = ChatTemplate.for_model(load_tokenizer(model_dir), load_chat_template(model_dir))
    with pytest.raises(TokenizerFailed):
        chat.prompt([{"role": "user", "content": HOSTILE_TEXT}])


def test_generate_ends_in_one_error_line_and_no_traceback(model_dir):
    proc = run_cli("generate", model_dir, "--prompt", HOSTILE_TEXT, "--max-new-tokens", 2)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "PanicException" not in proc.stderr
    # Rust's panic hook prints its own message (and a backtrace with RUST_BACKTRACE=1) before ours, unavoidably.
    assert proc.stderr.splitlines()[-1].startswith("error: the tokenizer cannot encode this text: "), proc.stderr


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": HOSTILE_TEXT, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HOSTILE_TEXT}], "max_tokens": 2}),
])
def test_server_answers_400_with_an_openai_error_and_keeps_serving(model_dir, path, body):
    srv = InProcessServer.for_model_dir(model_dir)
    try:
        answers = [srv.post(path, sent) for sent in (body, {**body, "prompt": "the cat"} if "prompt" in body else
                                                     {**body, "messages": [{"role": "user", "content": "the cat"}]})]
    finally:
        srv.stop()
    (status, answer), (after, _) = answers
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith("the tokenizer cannot encode this text")
    assert after == 200  # the next request is served
