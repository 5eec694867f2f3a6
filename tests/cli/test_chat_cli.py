"""Chat models end to end on the command line: `generate --chat`, special tokens in prompts (`--no-special`), BOS as
the model's tokenizer adds it, and `minigpt chat` with a model fresh out of `minigpt sft`."""
import json
import random

import pytest
import torch
from conftest import TINY_MODEL, assert_one_line_error, run_cli

from minigpt.checkpoint.atomic import atomic_dir
from minigpt.checkpoint.native import load_model, load_tokenizer, save_pretrained, write_model_files
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.posttrain.sft import SFTConfig, sft
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, IM_END, IM_START, ChatTemplate, add_special_tokens
from minigpt.tokenizer.tokenizer import train_tokenizer

WORDS = "what is the sky blue why do cats sit on mats tell me about tea please answer hello world".split()
ANSWER = "hello world"


def questions(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) + "?" for _ in range(n)]


def word_tokenizer(chat_tokens=True):
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)], 300)
    return add_special_tokens(tok)[0] if chat_tokens else tok


def write_model_dir(path, model, tok, tokenizer_config, generation_config):
    """A model directory with Hugging Face side files, as `minigpt import` writes them for a chat model."""
    with atomic_dir(path) as tmp:
        write_model_files(model, tmp, tok)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """A Qwen-style ChatML model: eos_token <|im_end|>, no BOS, generation_config's eos_token_id a list. Trained
    (a second) to answer every question with ANSWER and end its turn, after which it would go on with the next
    `<|im_start|>user` turn if nothing stopped it."""
    tok = word_tokenizer()
    chat = ChatTemplate(tok, CHATML_TEMPLATE)
    stream = []
    for q in questions(64, seed=1):
        stream += chat.encode([{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}])
    data = torch.tensor(stream)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **TINY_MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        starts = torch.randint(0, len(data) - 33, (16,), generator=gen)
        windows = torch.stack([data[s:s + 33] for s in starts])
        loss = model.loss(windows[:, :-1], windows[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    im_end, eot = tok.token_to_id(IM_END), tok.token_to_id("<|endoftext|>")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
              "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    return write_model_dir(tmp_path_factory.mktemp("chatml") / "qwen-like", model, tok, config,
                           {"eos_token_id": [im_end, eot]})


def test_generate_chat_answers_and_stops_at_the_end_of_turn(chatml_dir):
    tok = load_tokenizer(chatml_dir)
    assert tok.eos_id == tok.token_to_id(IM_END) and tok.bos_id is None
    proc = run_cli("generate", chatml_dir, "--chat", "why is the sky blue?", "--temperature", 0,
                   "--max-new-tokens", 20, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ANSWER + "\n"
    # Unstopped, the model goes on into a next turn: the template text that must not be printed.
    prompt = f"{IM_START}user\nwhy is the sky blue?{IM_END}\n{IM_START}assistant\n"
    unstopped = generate_tokens(load_model(chatml_dir), tok.encode(prompt, special=True),
                                SamplingParams(max_tokens=20, temperature=0))
    text = tok.decode(list(unstopped))
    assert text.startswith(ANSWER + IM_END) and len(text) > len(ANSWER + IM_END), text
    # A --prompt written in ChatML is tokenized as transformers does (<|im_start|> is one id) and stops the same.
    raw = run_cli("generate", chatml_dir, "--prompt", prompt, "--temperature", 0, "--max-new-tokens", 20,
                  "--device", "cpu")
    assert raw.returncode == 0 and raw.stdout == ANSWER + "\n"
    system = run_cli("generate", chatml_dir, "--chat", "tell me about tea", "--system", "be brief", "--temperature",
                     0, "--max-new-tokens", 20, "--device", "cpu")
    assert system.returncode == 0 and IM_START not in system.stdout and IM_END not in system.stdout


@pytest.mark.slow
def test_prompt_special_tokens_and_no_special(chatml_dir):
    """70 written <|im_start|> are 70 ids by default (over the 64-token context), the plain encoding with
    --no-special; the error names the prompt's length, which shows the encoding used."""
    tok = load_tokenizer(chatml_dir)
    text = IM_START * 70
    plain = len(tok.encode(text))
    assert plain > 70
    common = ("--max-new-tokens", 1, "--device", "cpu")
    assert_one_line_error(run_cli("generate", chatml_dir, "--prompt", text, *common), "the prompt of 70 tokens")
    assert_one_line_error(run_cli("generate", chatml_dir, "--prompt", text, "--no-special", *common),
                          f"the prompt of {plain} tokens")
    assert_one_line_error(run_cli("generate", chatml_dir, "--chat", "hi", "--no-special"), "--no-special")
    assert_one_line_error(run_cli("generate", chatml_dir, "--system", "hi"), "--system", "--chat")
    assert_one_line_error(run_cli("generate", chatml_dir, "--chat", "hi", "--prompt", "x"), "--chat")


@pytest.mark.slow
def test_bos_follows_the_model_tokenizer(tmp_path):
    """add_bos_token true in tokenizer_config.json: every prompt starts with BOS (once, even when written)."""
    tok = word_tokenizer(chat_tokens=False)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **TINY_MODEL)).eval()
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": True}
    adds = write_model_dir(tmp_path / "adds", model, tok, config, {"eos_token_id": 0})
    plain = save_pretrained(model, tmp_path / "plain", tok)
    text = "<|pad|>" * 70  # a special token of our BPE: one id each
    common = ("--max-new-tokens", 1, "--device", "cpu")
    assert_one_line_error(run_cli("generate", adds, "--prompt", text, *common), "the prompt of 71 tokens")
    assert_one_line_error(run_cli("generate", adds, "--prompt", "<|endoftext|>" + text, *common),
                          "the prompt of 71 tokens")
    assert_one_line_error(run_cli("generate", plain, "--prompt", text, *common), "the prompt of 70 tokens")
    assert_one_line_error(run_cli("generate", plain, "--prompt", text, "--bos", *common), "the prompt of 71 tokens")


def test_sft_output_answers_through_minigpt_chat(tmp_path):
    """A model fresh out of SFT (its tokenizer grew <|im_start|>/<|im_end|>, its template is ChatML) answers in the
    terminal chat with what it was taught and stops at <|im_end|>: no template text, no second turn."""
    tok = word_tokenizer(chat_tokens=False)
    torch.manual_seed(0)
    base = save_pretrained(Transformer(ModelConfig(vocab_size=tok.vocab_size, **{**TINY_MODEL, "max_seq_len": 128})
                                       ).eval(), tmp_path / "base", tok)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]}
            for q in questions(32, seed=2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft(SFTConfig(model=str(base), data=str(tmp_path / "train.jsonl"), out_dir=str(tmp_path / "sft"), max_steps=60,
                  lr=1e-2, batch_size=8, warmup_steps=2, log_interval=60, eval_interval=1000, device="cpu"))
    proc = run_cli("chat", tmp_path / "sft", "--temperature", 0, "--max-tokens", 30, "--threads", 1,
                   stdin="why do cats sit on mats?\ntell me about tea\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    answers = [part.split("\nyou> ")[0] for part in proc.stdout.split("assistant> ")[1:]]
    assert answers == [ANSWER, ANSWER], proc.stdout


@pytest.mark.parametrize("flag,value,fragment", [("--max-tokens", 0, "--max-tokens must be a positive integer"),
                                                 ("--temperature", "nan", "temperature must be a finite number"),
                                                 ("--top-p", 0, "top_p must be a number in (0, 1]")])
def test_chat_checks_its_sampling_flags_before_loading(tmp_path, flag, value, fragment):
    """They were refused only after the first message had been typed. The model does not exist here: the flag's
    error must come first."""
    assert_one_line_error(run_cli("chat", tmp_path / "no_model", flag, value, stdin="hi\n"), fragment)
