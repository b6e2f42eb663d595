"""Build tiny, self-contained HF model directories for tests (no hub, no shared files).

`make_tiny_model_dir(path)` writes config.json + model.safetensors (a randomly initialised
transformers model, fixed seed) + tokenizer.json (a byte-level BPE trained on a few sentences)
+ tokenizer_config.json with a ChatML chat template, so the whole stack (loader, tokenizer,
chat template, engine, server) runs on it in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "Once upon a time there was a little robot who liked to read documentation.",
    "The quick brown fox jumps over the lazy dog. Tool results are long; notes are short.",
    "def main():\n    print('hello world')\n\nThe function returns None when nothing is found.",
    "Agents edit their own context: they delete tool results and rewrite notes in place.",
    "héllo wörld 日本語 🎉 numbers 0123456789 and punctuation !?.,;:()[]{}",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer_files(path: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE on CORPUS and save tokenizer.json + tokenizer_config.json.
    Returns the actual vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "chat_template": CHATML_TEMPLATE, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }))
    return tok.get_vocab_size()


def tiny_llama_config(vocab_size: int, **overrides) -> dict:
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab_size,
               hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
               dtype="float32")
    cfg.update(overrides)
    return cfg


def make_tiny_model_dir(path: Path, seed: int = 0, **config_overrides) -> Path:
    """Write a complete tiny llama model directory at `path` (created) and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer_files(path)
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    cfg_dict = tiny_llama_config(vocab, eos_token_id=eos_id, **config_overrides)
    config = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_gguf_like_model_dir(path: Path, seed: int = 0, **config_overrides) -> Path:
    """`make_tiny_model_dir`, with the weights a GGUF Q4_1 file holds once converted: projections
    that are int4 data in bf16 (so `--weight-format auto` packs them) and an lm_head that is exactly
    Q8_0 blocks (int8 times an fp16 scale per 32 inputs) in fp32."""
    from safetensors.torch import load_file, save_file

    from kvsplice.layers.quant_linear import round_to_format

    make_tiny_model_dir(path, seed, **config_overrides)
    weights = load_file(str(path / "model.safetensors"))
    for name, weight in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = round_to_format(weight.bfloat16(), "int4").float()
    head = weights["lm_head.weight"].reshape(weights["lm_head.weight"].shape[0], -1, 32)
    scales = (head.abs().amax(-1, keepdim=True) / 127).half().float()
    weights["lm_head.weight"] = ((head / scales).round().clamp(-127, 127) * scales).reshape(weights["lm_head.weight"].shape)
    save_file(weights, str(path / "model.safetensors"))
    return path
