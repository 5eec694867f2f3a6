"""The scorer: shared-context KV reuse changes no number, windows and tokenization follow lm-eval."""
import pytest
import torch
from eval_helpers import DATA_DIR, random_gqa_model

from minigpt.checkpoint.native import load_model, load_tokenizer
from minigpt.eval.prompts import FewshotSampler, build_requests
from minigpt.eval.scoring import Scorer, rolling_windows
from minigpt.eval.tasks import TASKS, load_items
from minigpt.infer.fastpath import FastPath


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    native, _ = random_gqa_model(tmp_path_factory.mktemp("random"), max_seq_len=160)
    return native


def task_requests(name: str, shots: int) -> list[list[tuple[str, str]]]:
    task = TASKS[name]
    items = load_items(task, DATA_DIR / task.eval_file)
    pool = load_items(task, DATA_DIR / (task.fewshot_file or task.eval_file)) if shots else []
    sampler = FewshotSampler(task, pool)
    return [build_requests(task, item, sampler.sample(shots, item)) for item in items]


@pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "transformer"])
def test_shared_context_reuse_gives_the_same_loglikelihoods(random_model, fast):
    """Choices sharing a context (HellaSwag, ARC), contexts sharing a prefix (WinoGrande), 2-shot prompts that
    overflow the 160-token window (left truncation: no shared prefix then), batches of 1, 3 and 32 rows (groups
    mixed in one batch, each with its own prefix length) all score as every request run whole."""
    model = load_model(random_model)
    model = FastPath(model) if fast else model
    tokenizer = load_tokenizer(random_model)
    groups = [g for name, shots in [("hellaswag", 0), ("arc_easy", 0), ("winogrande", 2), ("hellaswag", 2),
                                    ("piqa", 0), ("lambada_openai", 1)] for g in task_requests(name, shots)]
    reference = Scorer(model, tokenizer, batch_size=8, reuse_prefix=False).loglikelihood(groups)
    reusing = Scorer(model, tokenizer, batch_size=3)
    encoded = [[reusing.encode_pair(c, x) for c, x in g] for g in groups]
    prefixes = [reusing._prepare(g)[2] for g in encoded]
    assert sum(p > 0 for p in prefixes) > len(groups) / 2 and 0 in prefixes  # reuse happens, and not always
    for batch_size in (1, 3, 32):
        reusing.batch_size = batch_size
        for ours, ref in zip(reusing.loglikelihood(groups), reference):
            for a, b in zip(ours, ref):
                assert a.loglikelihood == pytest.approx(b.loglikelihood, abs=1e-5)
                assert (a.is_greedy, a.n_tokens) == (b.is_greedy, b.n_tokens)


def test_loglikelihood_is_the_sum_of_next_token_log_probabilities(random_model):
    """An independent reading of one request: the model over context + continuation, log-softmax, the
    continuation's tokens picked."""
    model, tokenizer = load_model(random_model), load_tokenizer(random_model)
    scorer = Scorer(model, tokenizer)
    context, continuation = "Question: Which gas do we breathe?\nAnswer:", " oxygen"
    ctx_ids, cont_ids = scorer.encode_pair(context, continuation)
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0, :-1].float(), -1)
    expected = sum(logp[len(ctx_ids) - 1 + i, t].item() for i, t in enumerate(cont_ids))
    (score,), = scorer.loglikelihood([[(context, continuation)]])
    assert score.loglikelihood == pytest.approx(expected, abs=1e-5) and score.n_tokens == len(cont_ids)


def test_trailing_context_whitespace_moves_into_the_continuation(random_model):
    scorer = Scorer(load_model(random_model), load_tokenizer(random_model))
    assert scorer.encode_pair("Answer: ", "yes") == scorer.encode_pair("Answer:", " yes")
    whole = scorer.encode("Answer: yes")
    ctx, cont = scorer.encode_pair("Answer:", " yes")
    assert ctx + cont == whole  # the continuation's tokens are those of the whole string after the context's


def test_rolling_windows_match_lm_eval():
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is a test-only dependency")
    for n in range(0, 23):
        for max_len in (1, 4, 7):
            tokens = list(range(100, 100 + n))
            expected = [utils.make_disjoint_window(w) for w in
                        utils.get_rolling_token_windows(tokens, prefix_token=0, max_seq_len=max_len, context_len=1)]
            assert rolling_windows(tokens, 0, max_len) == [tuple(w) for w in expected], (n, max_len)


def test_batch_size_must_be_positive(random_model):
    from minigpt.errors import MiniGPTError

    with pytest.raises(MiniGPTError, match="batch-size"):
        Scorer(load_model(random_model), load_tokenizer(random_model), batch_size=0)


def test_gguf_and_llama2c_sources_evaluate_like_their_originals(random_model, shared_data, tmp_path):
    """A GGUF export of a MiniGPT model scores as the checkpoint it came from (its metadata says no BOS, as our
    tokenizer); stories260K's llama2.c .bin (BOS, as run.c encodes) scores as its HF directory."""
    from minigpt.checkpoint.convert import export_gguf
    from minigpt.eval.runner import evaluate_source

    def lls(source):
        out = evaluate_source(source, ["arc_easy", "winogrande"], device="cpu", data_dir=DATA_DIR, samples=True)
        return out["config"]["bos"], [ll for task in out["samples"].values() for s in task
                                      for ll in s["loglikelihoods"]]

    gguf = export_gguf(random_model, tmp_path / "model.gguf")
    (bos, ours), (bos_ref, reference) = lls(gguf), lls(random_model)
    assert bos is bos_ref is False and ours == pytest.approx(reference, abs=1e-5)
    stories = shared_data / "models" / "stories260K"
    (bos, ours), (bos_ref, reference) = lls(stories / "stories260K.bin"), lls(stories / "hf")
    assert bos is bos_ref is True and ours == pytest.approx(reference, abs=1e-5)


def test_a_tokenizer_with_more_ids_than_the_model_has_rows_is_refused(random_model):
    from minigpt.errors import MiniGPTError
    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer

    tokenizer = load_tokenizer(random_model)
    small = Transformer(ModelConfig(vocab_size=tokenizer.vocab_size - 1, dim=32, n_layers=1, n_heads=2,
                                    max_seq_len=64))
    with pytest.raises(MiniGPTError, match=f"tokenizer has {tokenizer.vocab_size} ids but the model only "
                                           f"{tokenizer.vocab_size - 1} embedding rows"):
        Scorer(small, tokenizer)
