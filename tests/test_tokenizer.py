"""Tokenizer wrapper: HF directories (tiny byte-level BPE built here, stories260K hf/) and llama2.c BPE."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvsplice.tokenizer import Tokenizer
from kvsplice.tokenizer_llama2c import find_llama2c_tokenizer, read_llama2c_tokenizer

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
needs_stories = pytest.mark.skipif(not (STORIES / "hf").is_dir(), reason="stories260K not present")
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if tools %}{{ 'TOOLS:' + (tools | map(attribute='name') | join(',')) + '\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_hf_tokenizer(model_dir: Path, generation_eos: list[str] | str) -> dict[str, int]:
    """A byte-level BPE (256 byte tokens, no merges) with 3 specials and a chat template; returns special ids.

    `generation_eos` names the token(s) written as generation_config.json eos_token_id (list or int).
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: number for number, char in enumerate(sorted(alphabet))}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(model_dir))
    special = {name: fast.convert_tokens_to_ids(name) for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    eos = special[generation_eos] if isinstance(generation_eos, str) else [special[n] for n in generation_eos]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return special


def test_hf_dir_tokenizer_encode_decode_chat_and_eos(tmp_path):
    special = write_tiny_hf_tokenizer(tmp_path, generation_eos=["<|im_end|>", "<|endoftext|>"])
    tokenizer = Tokenizer.from_dir(tmp_path)
    end_of_text, im_start, im_end = special["<|endoftext|>"], special["<|im_start|>"], special["<|im_end|>"]
    assert sorted(special.values()) == [256, 257, 258]
    assert tokenizer.vocab_size == 259 and tokenizer.bos_token_id == im_start
    assert tokenizer.eos_token_ids == (end_of_text, im_end)
    text = "héllo wörld \u2603"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8")) and tokenizer.decode(ids) == text
    assert tokenizer.token_str(ids[6]) == " "  # h, é (2 bytes), l, l, o, space
    assert tokenizer.token_str(im_end) == "<|im_end|>"
    assert tokenizer.has_chat_template
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat[0] == im_start and chat.count(im_end) == 1
    assert tokenizer.decode(chat) == "user\nhi\nassistant\n"
    tools = [{"name": "search"}, {"name": "open"}]
    rendered = tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=False)
    assert rendered.endswith("TOOLS:search,open\n")


def test_generation_config_eos_as_int_and_missing(tmp_path):
    special = write_tiny_hf_tokenizer(tmp_path, generation_eos="<|im_end|>")
    end_of_text, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (end_of_text, im_end)
    (tmp_path / "generation_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (end_of_text,)


def test_missing_tokenizer_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_dir(tmp_path)


@needs_stories
def test_stories_hf_tokenizer_has_no_chat_template():
    tokenizer = Tokenizer.from_dir(STORIES / "hf")
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tokenizer.eos_token_ids == (2,) and tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 512
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@needs_stories
def test_llama2c_backend():
    bpe = read_llama2c_tokenizer(find_llama2c_tokenizer(STORIES / "stories260K.bin"), 512)
    tokenizer = Tokenizer(bpe)
    ids = tokenizer.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    assert tokenizer.decode(ids) == "Once upon a time"
    assert tokenizer.token_str(407) == " upon"
    assert (tokenizer.eos_token_ids, tokenizer.bos_token_id, tokenizer.vocab_size) == ((2,), 1, 512)
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
