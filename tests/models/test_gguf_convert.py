"""GGUF -> HF conversion on tiny random llama / qwen2 / qwen3 GGUF files written in the test."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvsplice.models.gguf_convert import convert_gguf, half_to_interleaved_rows, interleaved_to_half_rows
from kvsplice.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Every type the brief requires; q/k get near-lossless types so the un-permute check is strict.
BLOCK_TYPES = {
    "attn_q": (Q.F32, Q.Q8_0),
    "attn_k": (Q.F16, Q.BF16),
    "attn_v": (Q.Q4_0, Q.Q4_1),
    "attn_output": (Q.Q4_1, Q.Q8_0),
    "ffn_gate": (Q.Q8_0, Q.Q4_0),
    "ffn_up": (Q.BF16, Q.F16),
    "ffn_down": (Q.Q4_0, Q.F32),
}


def byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode table, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a byte-level BPE with 3 control tokens (ids 0..2)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworl", "Ġworld"]
    tokens = specials + byte_level_alphabet() + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, merges, types


def write_tensor(writer, name: str, values: np.ndarray, qtype) -> np.ndarray:
    """Store `values` as `qtype`; returns the dequantized values a reader will see."""
    if qtype == Q.F32:
        stored = values.astype(np.float32)
    elif qtype == Q.F16:
        stored = values.astype(np.float16)
    else:
        stored = gguf.quants.quantize(values, qtype)
    writer.add_tensor(name, stored, raw_dtype=qtype)
    return gguf.quants.dequantize(stored, qtype).reshape(values.shape)


def write_tiny_gguf(path, arch: str, tied: bool, seed: int = 0):
    """Write a tiny random GGUF; returns (hf_weights, dequantized_written) in HF names and HF layout."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_vocab()
    vocab = len(tokens) + 3  # padded embedding, like real checkpoints
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if arch == "qwen3":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    hf_weights, expected = {}, {}

    def put(gguf_name, hf_name, shape, qtype, heads=None):
        values = rng.standard_normal(shape).astype(np.float32)
        hf_weights[hf_name] = torch.from_numpy(values)
        on_disk = values
        if heads is not None and arch == "llama":
            on_disk = half_to_interleaved_rows(torch.from_numpy(values), heads).numpy()
        read_back = torch.from_numpy(np.ascontiguousarray(write_tensor(writer, gguf_name, on_disk, qtype)))
        if heads is not None and arch == "llama":
            read_back = interleaved_to_half_rows(read_back, heads)
        expected[hf_name] = read_back

    put("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), Q.Q8_0)
    put("output_norm.weight", "model.norm.weight", (HIDDEN,), Q.F32)
    if not tied:
        put("output.weight", "lm_head.weight", (vocab, HIDDEN), Q.Q4_1)
    shapes = {
        "attn_q": ((HEADS * HEAD_DIM, HIDDEN), "self_attn.q_proj", HEADS),
        "attn_k": ((KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj", KV_HEADS),
        "attn_v": ((KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.v_proj", None),
        "attn_output": ((HIDDEN, HEADS * HEAD_DIM), "self_attn.o_proj", None),
        "ffn_gate": ((FFN, HIDDEN), "mlp.gate_proj", None),
        "ffn_up": ((FFN, HIDDEN), "mlp.up_proj", None),
        "ffn_down": ((HIDDEN, FFN), "mlp.down_proj", None),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        put(f"blk.{layer}.attn_norm.weight", prefix + "input_layernorm.weight", (HIDDEN,), Q.F32)
        put(f"blk.{layer}.ffn_norm.weight", prefix + "post_attention_layernorm.weight", (HIDDEN,), Q.F32)
        for part, (shape, hf_part, heads) in shapes.items():
            put(f"blk.{layer}.{part}.weight", f"{prefix}{hf_part}.weight", shape, BLOCK_TYPES[part][layer], heads)
        if arch == "qwen2":
            for part, rows in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
                hf_part = shapes[part][1]
                put(f"blk.{layer}.{part}.bias", f"{prefix}{hf_part}.bias", (rows * HEAD_DIM,), Q.F32)
        if arch == "qwen3":
            put(f"blk.{layer}.attn_q_norm.weight", prefix + "self_attn.q_norm.weight", (HEAD_DIM,), Q.F32)
            put(f"blk.{layer}.attn_k_norm.weight", prefix + "self_attn.k_norm.weight", (HEAD_DIM,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_weights, expected


def test_permutation_helpers_are_inverse_and_match_rotate_half_layout():
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    assert torch.equal(interleaved_to_half_rows(half_to_interleaved_rows(weight, 2), 2), weight)
    # One head of 8 rows: interleaved (x0 y0 x1 y1 ...) -> half (x0 x1 x2 x3 y0 y1 y2 y3).
    rows = interleaved_to_half_rows(torch.arange(8.0).reshape(8, 1), 1).flatten().tolist()
    assert rows == [0, 2, 4, 6, 1, 3, 5, 7]
    with pytest.raises(ValueError):
        interleaved_to_half_rows(torch.zeros(6, 2), 2)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_convert_round_trips_weights_config_and_tokenizer(tmp_path, arch, tied):
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    hf_weights, expected = write_tiny_gguf(gguf_path, arch, tied)
    out_dir = convert_gguf(gguf_path, tmp_path / "converted", progress=False)
    assert not list(tmp_path.glob(".converted.partial-*"))
    state = load_file(str(out_dir / "model.safetensors"))
    assert set(state) == set(expected)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
    # Un-permute check: q/k are F32/F16/BF16/Q8_0, so they must be close to the HF-layout originals.
    for name in [n for n in state if "q_proj.weight" in n or "k_proj.weight" in n]:
        assert (state[name] - hf_weights[name]).abs().max() < 0.05 * hf_weights[name].abs().max(), name

    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == arch
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, 16)
    assert config["rope_theta"] == 50000.0 and config["rms_norm_eps"] == pytest.approx(1e-6)
    assert config["max_position_embeddings"] == 256 and config["tie_word_embeddings"] is tied
    assert config["vocab_size"] == state["model.embed_tokens.weight"].shape[0]
    assert config["attention_bias"] is (arch == "qwen2")
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    tokenizer = Tokenizer.from_dir(out_dir)
    assert tokenizer.encode("hello world", add_special_tokens=False) == [262, 267]
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert tokenizer.eos_token_ids == (2,)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[0] == 1 and tokenizer.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert json.loads((out_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_converted_llama_matches_transformers_gguf_loader(tmp_path):
    """transformers' own GGUF dequantize + reverse permute (its from_pretrained path needs accelerate)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "llama", tied=False, seed=3)
    out_dir = convert_gguf(gguf_path, tmp_path / "converted", progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(out_dir))
    theirs = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    ours = model.state_dict()
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name].float()), name


def test_existing_output_dir_is_kept(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "llama", tied=True)
    out_dir = tmp_path / "done"
    out_dir.mkdir()
    (out_dir / "marker").write_text("x")
    assert convert_gguf(gguf_path, out_dir, progress=False) == out_dir
    assert [p.name for p in out_dir.iterdir()] == ["marker"]


def test_bad_gguf_raises_value_error(tmp_path):
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ValueError):
        convert_gguf(not_gguf, tmp_path / "out", progress=False)
    with pytest.raises(ValueError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
