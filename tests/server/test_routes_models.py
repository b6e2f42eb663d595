"""Served model names: the name derived from --model, --served-model-name aliases, GET /v1/models and
GET /v1/models/{id}."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from kvsplice.cli import main
from kvsplice.server.model_names import default_model_name, served_names


def test_default_model_and_its_gguf_are_reported_as_smollm2(tmp_path):
    assert default_model_name(None, "SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert default_model_name("SmolLM2-135M-Instruct", "x") == "SmolLM2-135M-Instruct"
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"")
    assert default_model_name(str(gguf), gguf.stem) == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("relative, expected", [
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct"),
    ("Mistral-7B-v0.3.IQ2_XXS.gguf", "Mistral-7B-v0.3"),
    ("stories260K.bin", "stories260K"),
    ("tinyllamas/model.bin", "tinyllamas"),
])
def test_file_names_lose_their_quantization_tag(tmp_path, relative, expected):
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    assert default_model_name(str(path), path.stem) == expected


def test_generic_folder_names_give_way_to_a_telling_parent(tmp_path):
    hf = tmp_path / "stories260K" / "hf"
    hf.mkdir(parents=True)
    assert default_model_name(str(hf), "hf") == "stories260K"
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-360M" / "snapshots" / ("ab12" * 10)
    snapshot.mkdir(parents=True)
    assert default_model_name(str(snapshot), snapshot.name) == "HuggingFaceTB/SmolLM2-360M"
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert default_model_name(str(plain), "my-model") == "my-model"
    assert default_model_name("org/name", "org/name") == "org/name"  # a hub id, not a path here


def test_explicit_names_are_the_only_ones_accepted():
    names = served_names(("alias-a", "alias-b", "alias-a"), "/models/hf", "hf")
    assert names.reported == ("alias-a", "alias-b") and names.primary == "alias-a"
    assert names.accepts("alias-b") and not names.accepts("hf") and not names.accepts("/models/hf")
    derived = served_names((), "/models/stories260K/hf", "hf")
    assert derived.reported == ("stories260K",)
    assert all(derived.accepts(n) for n in ("stories260K", "hf", "/models/stories260K/hf"))


@pytest.mark.parametrize("argv", [["--served-model-name"], ["--served-model-name", ""],
                                  ["--served-model-name", " padded "]])
def test_bad_served_model_names_exit_2_before_loading(argv, capsys):
    assert main(["serve", *argv]) == 2
    assert "--served-model-name" in capsys.readouterr().err


def test_models_route_lists_and_retrieves(server):
    listing = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    [card] = listing["data"]
    assert card["id"] == server.state.model_name and card["object"] == "model"
    assert card["max_model_len"] == server.state.context_limit
    one = httpx.get(f"{server.url}/v1/models/{card['id']}", timeout=10)
    assert one.status_code == 200 and one.json() == card


def test_unknown_model_is_a_404_with_openai_body(server):
    response = httpx.get(f"{server.url}/v1/models/no-such-model", timeout=10)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "no-such-model" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def aliased_app(tiny_model_dir):
    """An app serving the tiny model as 'agent-model' and 'backup-name' (engine running)."""
    from kvsplice.config import EngineConfig
    from kvsplice.engine.llm import build_engine
    from kvsplice.server.api import ServerSettings, create_app
    from kvsplice.server.request_log import RequestLog
    from tests.server.conftest import LineSink

    engine = build_engine(EngineConfig(model=str(tiny_model_dir), num_slots=512, max_batch_tokens=128))
    settings = ServerSettings(model_path=str(tiny_model_dir), served_model_names=("agent-model", "backup-name"))
    with TestClient(create_app(engine, settings, RequestLog(LineSink()))) as client:
        yield client


def test_aliases_are_listed_accepted_and_the_first_is_reported(aliased_app, tiny_model_dir):
    cards = aliased_app.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["agent-model", "backup-name"]
    # root is the served name (SGLang's clients compare it with the name they serve), not the model's own
    assert [c["root"] for c in cards] == ["agent-model", "agent-model"]
    assert aliased_app.get("/v1/models/backup-name").json()["id"] == "backup-name"
    reply = aliased_app.post("/v1/completions", json={"model": "backup-name", "prompt": "Once", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "agent-model"
    refused = aliased_app.post("/v1/completions", json={"model": str(tiny_model_dir), "prompt": "x", "max_tokens": 1})
    assert refused.status_code == 404 and "'agent-model', 'backup-name'" in refused.json()["error"]["message"]
    assert 'model_name="agent-model"' in aliased_app.get("/metrics").text
    assert aliased_app.get("/get_server_info").json()["served_model_name"] == "agent-model"
