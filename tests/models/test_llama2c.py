"""llama2.c v0 checkpoint + tokenizer.bin reading, checked against the HF copy of stories260K."""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsplice.models.llama2c import load_llama2c
from kvsplice.tokenizer_llama2c import Llama2cBPE, find_llama2c_tokenizer, read_llama2c_tokenizer

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"
needs_stories = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"{STORIES} is absent")


@needs_stories
def test_stories260k_logits_match_hf_copy():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config, state_dict = load_llama2c(STORIES / "stories260K.bin")
    assert (hf_config["hidden_size"], hf_config["num_hidden_layers"], hf_config["num_key_value_heads"]) == (64, 5, 4)
    assert hf_config["tie_word_embeddings"] is True and hf_config["vocab_size"] == 512
    ours = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
    ours.load_state_dict(state_dict, strict=True)
    reference = LlamaForCausalLM.from_pretrained(str(STORIES / "hf")).eval()
    ids = torch.tensor([[1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 30, 100, 7]])
    with torch.no_grad():
        diff = (ours(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4


@needs_stories
def test_run_c_tokenizer_matches_hf_tokenizer_on_ordinary_text():
    from transformers import AutoTokenizer

    bpe = read_llama2c_tokenizer(find_llama2c_tokenizer(STORIES / "stories260K.bin"), 512)
    reference = AutoTokenizer.from_pretrained(str(STORIES / "hf"))
    for text in ["Once upon a time", "Lily saw a big, red ball. She said: \"Hi!\"", "Tom ate 3 apples."]:
        assert bpe.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert bpe.decode(bpe.encode(text, add_bos=True)) == text
    assert bpe.encode("Once upon a time", add_bos=True, add_eos=True)[0::5] == [1, 2]
    # A character outside the 512 pieces falls back to its UTF-8 bytes (<0xE2> = id 3 + 0xE2).
    assert 3 + 0xE2 in bpe.encode("a \u2603")
    assert bpe.decode(bpe.encode("snow \u2603 man")) == "snow \u2603 man"


def write_v0_checkpoint(path: Path, shared: bool, seed: int = 0) -> dict:
    """A random llama2.c v0 file (dim 16, 2 heads, 1 kv head); returns its raw llama2.c tensors."""
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = 16, 24, 2, 2, 1, 300, 8
    head_dim = dim // heads
    rng = np.random.default_rng(seed)
    shapes = [
        ("embed", (vocab, dim)), ("attn_norm", (layers, dim)), ("wq", (layers, dim, dim)),
        ("wk", (layers, kv_heads * head_dim, dim)), ("wv", (layers, kv_heads * head_dim, dim)),
        ("wo", (layers, dim, dim)), ("ffn_norm", (layers, dim)), ("w1", (layers, hidden, dim)),
        ("w2", (layers, dim, hidden)), ("w3", (layers, hidden, dim)), ("final_norm", (dim,)),
        ("rope", (seq_len * head_dim,)),
    ] + ([] if shared else [("classifier", (vocab, dim))])
    tensors = {name: rng.standard_normal(shape).astype("<f4") for name, shape in shapes}
    header = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if shared else -vocab, seq_len)
    path.write_bytes(header + b"".join(tensor.tobytes() for tensor in tensors.values()))
    return tensors


@pytest.mark.parametrize("shared", [True, False])
def test_random_checkpoint_layout_and_rope_permutation(tmp_path, shared):
    raw = write_v0_checkpoint(tmp_path / "model.bin", shared)
    config, state = load_llama2c(tmp_path / "model.bin")
    assert config["tie_word_embeddings"] is shared and config["vocab_size"] == 300
    expected_head = raw["embed"] if shared else raw["classifier"]
    assert np.array_equal(state["lm_head.weight"].numpy(), expected_head)
    assert np.array_equal(state["model.layers.1.mlp.down_proj.weight"].numpy(), raw["w2"][1])
    # Head 0 of wq, rows (x0,y0,x1,y1,...) -> (x0,x1,...,y0,y1,...).
    q_rows = state["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.array_equal(q_rows[:4], raw["wq"][0][0:8:2]) and np.array_equal(q_rows[4:8], raw["wq"][0][1:8:2])
    k_rows = state["model.layers.1.self_attn.k_proj.weight"].numpy()
    assert np.array_equal(k_rows[:4], raw["wk"][1][0:8:2])


def test_bad_checkpoints_raise_value_error(tmp_path):
    write_v0_checkpoint(tmp_path / "model.bin", shared=True)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes((tmp_path / "model.bin").read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated"):
        load_llama2c(truncated)
    versioned = tmp_path / "v1.bin"
    versioned.write_bytes(struct.pack("<Ii", 0x616B3432, 1) + bytes(300))
    with pytest.raises(ValueError, match="versioned"):
        load_llama2c(versioned)
    with pytest.raises(ValueError):
        load_llama2c(tmp_path / "missing.bin")


def test_bpe_merges_by_best_score_with_dummy_prefix():
    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    pieces += [b" ", b"a", b"b", b"ab", b" a", b" ab"]
    scores = [0.0] * 259 + [0.0, 0.0, 0.0, -1.0, -2.0, -3.0]
    bpe = Llama2cBPE(pieces, scores)
    ids = {piece: number for number, piece in enumerate(pieces)}
    # " " "a" "b": best pair is "ab" (-1) before " a" (-2); then " " + "ab" -> " ab".
    assert bpe.encode("ab") == [ids[b" ab"]]
    assert bpe.encode("ba") == [ids[b" "], ids[b"b"], ids[b"a"]]
    assert bpe.encode("") == []
    assert bpe.decode(bpe.encode("abba!")) == "abba!"
    assert bpe.token_str(ids[b" ab"]) == " ab"
    with pytest.raises(ValueError):
        bpe.decode([9999])
