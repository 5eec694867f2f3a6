"""A completion keeps the space at the start of its first token: it is decoded after its prompt's last tokens
(minigpt.infer.stops.decode_context), not on its own, which for sentencepiece drops the first piece's leading
"▁" ("Once" + "upon a time"). Checked on stories260K (sentencepiece ``tokenizer.model``), on the same vocabulary as
a Llama-style ``tokenizer.json`` (Metaspace pieces, a Strip decoder) and on a GPT-2 style byte-level BPE, whose
"Ġ" pieces decode with their space anyway (nothing may double it); through `minigpt generate` and the server."""
import http.client
import json
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli import main
from minigpt.infer.stops import StopChecker, decode_context, leading_text
from minigpt.tokenizer.tokenizer import Tokenizer, train_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from serve_helpers import InProcessServer  # noqa: E402

GREEDY = ["--temperature", "0", "--max-new-tokens", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def stories(shared_data) -> Path:
    folder = shared_data / "models" / "stories260K" / "hf"
    if not (folder / "tokenizer.model").is_file():
        pytest.skip(f"stories260K is not in {folder.parent}")
    return folder


@pytest.fixture(scope="module")
def sp(stories) -> Tokenizer:
    return Tokenizer.from_dir(stories)


@pytest.fixture(scope="module")
def llama_json(sp, tmp_path_factory) -> Tokenizer:
    """stories260K's vocabulary as a Llama-style tokenizer.json: "▁" pieces, byte fallback, and the decoder of
    Llama's converted tokenizers, whose Strip drops the first space of a decoded text."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    vocab = [(sp.id_to_token(i), 0.0) for i in range(sp.vocab_size)]
    hf = HFTokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    path = tmp_path_factory.mktemp("llama_json") / "tokenizer.json"
    hf.save(str(path))
    return Tokenizer.from_file(path)


def post(srv, path: str, body: dict) -> tuple[int, object]:
    """(status, parsed JSON or, for a stream, the text) of one POST to ``srv``."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text if body.get("stream") else json.loads(text)


def stream(tokenizer, prompt, ids, stop=()) -> tuple[list[str], StopChecker]:
    """The deltas of a StopChecker fed ``ids`` after ``prompt`` (then finished, unless stopped)."""
    checker = StopChecker(tokenizer, stop=stop, context=prompt)
    deltas = []
    for token in ids:
        deltas.append(checker.push(token))
        if checker.stopped:
            break
    else:
        deltas.append(checker.finish())
    return deltas, checker


def test_cli_echo_is_prompt_plus_completion_with_its_space(stories, capsys):
    assert main(["generate", str(stories), "--prompt", "Once", "--echo", *GREEDY]) == 0
    assert capsys.readouterr().out == "Once upon a time,\n"
    assert main(["generate", str(stories), "--prompt", "Once", *GREEDY]) == 0
    assert capsys.readouterr().out == " upon a time,\n"
    # A batch (decoded row by row in generate_batch) prints the same, and its JSON lines too.
    assert main(["generate", str(stories), "--prompt", "Once", "--prompt", "Lily", "--echo", *GREEDY]) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == "Once upon a time,"
    assert main(["generate", str(stories), "--prompt", "Once", "--prompt", "Lily", "--jsonl", *GREEDY]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["completion"] == " upon a time,"
    assert all(line["completion"].startswith(" ") for line in lines)


def test_cli_stop_string_is_cut_in_the_text_with_its_space(stories, capsys):
    assert main(["generate", str(stories), "--prompt", "Once", "--echo", "--stop", "a t", *GREEDY]) == 0
    assert capsys.readouterr().out == "Once upon \n"
    assert main(["generate", str(stories), "--prompt", "Once", "--prompt", "Lily", "--jsonl", "--stop", "a t",
                 *GREEDY]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["completion"] == " upon "


@pytest.mark.parametrize("backend", ["sentencepiece", "tokenizer.json"])
def test_streamed_deltas_join_to_the_text_decoded_after_the_prompt(backend, sp, llama_json):
    tok = sp if backend == "sentencepiece" else llama_json
    prompt, ids = sp.encode("Once", bos=True), sp.encode(" upon a time, there was a girl")
    deltas, checker = stream(tok, prompt, ids)
    assert deltas[0] == " upon" and "".join(deltas) == checker.text == " upon a time, there was a girl"
    assert checker.text == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert leading_text(tok, prompt, ids) == " "
    # After BOS alone (an empty prompt) or with no prompt there is no text before: nothing to keep a space for.
    for bare in ([sp.bos_id], []):
        assert decode_context(tok, bare) == []
        assert stream(tok, bare, ids)[1].text == "upon a time, there was a girl"
        assert leading_text(tok, bare, ids) == ""


@pytest.mark.parametrize("backend", ["sentencepiece", "tokenizer.json"])
def test_stop_strings_are_cut_as_before_with_the_space_kept(backend, sp, llama_json):
    tok = sp if backend == "sentencepiece" else llama_json
    prompt, ids = sp.encode("Once", bos=True), sp.encode(" upon a time, there was a girl")
    deltas, checker = stream(tok, prompt, ids, stop=("a t", "never"))
    assert checker.stopped and checker.text == "".join(deltas) == " upon "
    deltas, checker = stream(tok, prompt, ids, stop=(", th",))  # ", " is held back until "there" resolves it
    assert checker.stopped and deltas[:4] == [" upon", " a", " time", ""] and checker.text == " upon a time"


@pytest.mark.parametrize("backend", ["sentencepiece", "tokenizer.json"])
def test_byte_fallback_characters_never_show_half_made(backend, sp, llama_json):
    tok = sp if backend == "sentencepiece" else llama_json
    prompt, text = sp.encode("Once", bos=True), " a caf\u00e9 \U0001f600 and \u4e2d"
    ids = sp.encode(text)
    assert any(sp.id_to_token(i).startswith("<0x") for i in ids)  # the test needs byte-fallback pieces
    deltas, checker = stream(tok, prompt, ids)
    assert not any("\ufffd" in d for d in deltas) and "".join(deltas) == checker.text == text
    # A prompt ending inside a character: its bytes stay the prompt's; the completion is decoded after "Once "
    # (pieces "▁Once", "▁": a lone "▁" starting a window would decode to nothing and take the next space along).
    cut = sp.encode("Once \U0001f600")[:-2]
    assert decode_context(tok, cut) == cut[:2] and tok.decode(cut[:2]) == "Once "
    assert stream(tok, cut, ids)[1].text == text == tok.decode(cut[:2] + ids)[len("Once "):]


def test_byte_level_bpe_keeps_its_single_space():
    tok = train_tokenizer(["Once upon a time there was a little girl. Once upon a time, a cat."] * 20, 300)
    prompt, ids = tok.encode("Once"), tok.encode(" upon a time")
    assert tok.decode(ids) == " upon a time"  # "Ġupon": the space is in the token itself
    deltas, checker = stream(tok, prompt, ids)
    assert deltas[0].startswith(" ") and not deltas[0].startswith("  ")
    assert "".join(deltas) == checker.text == " upon a time"
    assert leading_text(tok, prompt, ids) == ""


def test_server_completion_text_keeps_the_space_and_chat_does_not_invent_one(stories, sp):
    from minigpt.checkpoint.native import load_model
    from minigpt.infer.engine import Engine
    from minigpt.serve.app import ServerState

    torch.set_num_threads(1)
    srv = InProcessServer(ServerState(Engine(load_model(stories), sp, max_batch_size=2), sp, "stories",
                                      add_bos=True))
    try:
        body = {"prompt": "Once", "max_tokens": 2, "echo": True, "logprobs": 2, "temperature": 0}
        status, answer = post(srv, "/v1/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["text"] == "Once upon a" and choice["logprobs"]["tokens"][-2:] == [" upon", " a"]
        body = {"prompt": "Once", "max_tokens": 4, "temperature": 0}
        assert post(srv, "/v1/completions", body)[1]["choices"][0]["text"] == " upon a time,"
        status, text = post(srv, "/v1/completions", {**body, "stream": True, "echo": True})
        chunks = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Once upon a time,"
        assert post(srv, "/v1/completions", {**body, "stop": ["a t"]})[1]["choices"][0]["text"] == " upon "
        assert post(srv, "/v1/completions", {**body, "prompt": ""})[1]["choices"][0]["text"] == "Once upon a time"
        # Chat: the first generated piece is "▁" (the template's "Assistant:" then a space): content starts after.
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        content = post(srv, "/v1/chat/completions", chat)[1]["choices"][0]["message"]["content"]
        assert content and not content.startswith(" ")
    finally:
        srv.stop()
