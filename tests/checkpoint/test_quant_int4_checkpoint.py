"""int4 quantized checkpoints: bit-exact save/load round trip, the config entry, one-line errors for a bad group
size, a wrong tensor dtype or shape, and the tokenizer side files (roles, stop ids, chat template) that a quantized
directory keeps."""
import json
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer
from minigpt.checkpoint.quantized import save_quantized, tokenizer_files
from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath
from minigpt.model.quant import METHOD_INT4, Int4Linear, Int8Linear, quantize_model

# hidden_dim 80 (multiple_of 16): w2's rows do not divide into groups of 32, so it stays int8 (mixed model).
SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, multiple_of=16,
             hidden_dim=80)
_model = partial(random_model, SHAPE)


@pytest.mark.parametrize("tied", [True, False])
def test_int4_checkpoint_round_trip_is_bit_exact(tmp_path, tied, float32_prefill):
    model = quantize_model(_model(tie_embeddings=tied, attention_bias=True), METHOD_INT4)
    assert isinstance(model.layers[0].attention.wq, Int4Linear)
    assert isinstance(model.layers[0].feed_forward.w2, Int8Linear) and isinstance(model.output, Int8Linear)
    tokens = torch.randint(0, 61, (2, 20))
    with torch.inference_mode():
        ref = model(tokens)
    path = save_quantized(model, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["method"] == "int4_weight_only"
    assert config["quantization"]["group_size"] == 32 and config["quantization"]["layout"] == "q4_0"
    loaded = load_model(path)
    sd, ref_sd = loaded.state_dict(), model.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in sd:
        assert sd[k].dtype == ref_sd[k].dtype and torch.equal(sd[k], ref_sd[k]), k
    assert sd["layers.0.attention.wq.weight"].dtype == torch.uint8
    assert sd["layers.0.attention.wq.weight_scale"].dtype == torch.float16
    assert sd["layers.0.feed_forward.w2.weight"].dtype == torch.int8
    with torch.inference_mode():
        torch.testing.assert_close(loaded(tokens), ref, atol=0, rtol=0)
        torch.testing.assert_close(FastPath(loaded, woq_kernel="words")(tokens), ref, atol=1e-5, rtol=0)
        # By default int8 products round their activations to 8 bits per row (test_fastpath_w8a8's 2 % bound).
        fast = FastPath(loaded)(tokens)
        assert ((fast - ref).norm() / ref.norm()).item() < 0.02
    # Saved again after the fast path fused it (row views of shared storage): the same bytes.
    save_quantized(loaded, tmp_path / "q2")
    assert (tmp_path / "q2" / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    (path / "manifest.json").unlink(missing_ok=True)  # edited on purpose: the manifest would flag it as corrupt


def test_int4_checkpoint_errors_are_one_line(tmp_path):
    path = save_quantized(quantize_model(_model(), METHOD_INT4), tmp_path / "q")
    _edit_config(path, lambda c: c["quantization"].update(group_size=12))
    with pytest.raises(MiniGPTError, match="group size must be a positive multiple of 8, got 12") as e:
        load_model(path)
    assert "\n" not in str(e.value)
    # Groups of 16 describe other shapes than the stored ones: named tensor and both shapes.
    _edit_config(path, lambda c: c["quantization"].update(group_size=16))
    with pytest.raises(MiniGPTError, match=r"tensor layers\.0\.\S+\.weight_scale has shape \(64,?.*\) but the config "
                                           r"implies \(64, \d\)"):
        load_model(path)

    path = save_quantized(quantize_model(_model(), METHOD_INT4), tmp_path / "r")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["layers.0.attention.wq.weight"] = tensors["layers.0.attention.wq.weight"].to(torch.int8)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "manifest.json").unlink()
    with pytest.raises(MiniGPTError, match="should be uint8 in an int4_weight_only checkpoint, found int8"):
        load_model(path)
    tensors["layers.0.attention.wq.weight"] = tensors["layers.0.attention.wq.weight"].to(torch.uint8)
    tensors["layers.0.attention.wq.weight_scale"] = tensors["layers.0.attention.wq.weight_scale"].float()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(MiniGPTError, match="weight_scale should be float16"):
        load_model(path)


def test_quantized_directory_keeps_roles_stop_ids_and_chat_template(tmp_path):
    """A Qwen-style chat model (eos <|im_end|>, no BOS, generation_config's eos_token_id a list, a ChatML template)
    quantized: the tokenizer, its roles, every stop id and the chat template are the float model's, so it chats with
    the same prompt and stops at the same ids."""
    from minigpt.checkpoint.atomic import atomic_dir
    from minigpt.checkpoint.native import write_model_files
    from minigpt.infer.stops import default_stop_ids
    from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, IM_END, ChatTemplate, add_special_tokens
    from minigpt.tokenizer.tokenizer import train_tokenizer

    tok = add_special_tokens(train_tokenizer(["what is the sky hello world tea cats " * 30], 300))[0]
    model = random_model(dict(SHAPE, vocab_size=tok.vocab_size))
    with atomic_dir(tmp_path / "float") as tmp:
        write_model_files(model, tmp, tok)
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": IM_END, "bos_token": None, "pad_token": "<|pad|>", "add_bos_token": False,
             "chat_template": CHATML_TEMPLATE}))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id("<|endoftext|>")]}))
    src = tmp_path / "float"
    float_tok = load_tokenizer(src)
    path = save_quantized(quantize_model(load_model(src), METHOD_INT4), tmp_path / "q", float_tok,
                          load_chat_template(src))
    assert load_chat_template(path) == CHATML_TEMPLATE
    back = load_tokenizer(path)
    for role in ("bos_id", "eos_id", "pad_id", "unk_id", "add_bos", "stop_ids"):
        assert getattr(back, role) == getattr(float_tok, role), role
    assert back.eos_id == tok.token_to_id(IM_END) and back.bos_id is None
    chats = [ChatTemplate.for_model(t, load_chat_template(d)) for t, d in ((float_tok, src), (back, path))]
    messages = [{"role": "user", "content": "what is the sky"}]
    assert chats[0].prompt(messages) == chats[1].prompt(messages)
    assert default_stop_ids(back, chats[1]) == default_stop_ids(float_tok, chats[0])
    assert tokenizer_files(None, None) == {}
