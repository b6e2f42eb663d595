"""The OpenAI Agents SDK (`openai-agents`) on its default model, the Responses API, against a kvsplice
server over HTTP on the tiny random model: an agent with a function tool runs its loop (a forced call,
the SDK runs the tool and sends its output back, the model answers) and every model call is a
/v1/responses request the server answered. Streamed too. Tracing is off: it would post to OpenAI."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install -e '.[test]')")

from openai import AsyncOpenAI  # noqa: E402

from kvsplice.server.auth import ApiKeys  # noqa: E402
from tests.server.conftest import assert_idle_without_leak, start_server  # noqa: E402

KEY = "sk-agents-sdk-0123456789"


class Forecast(BaseModel):
    """The agent's final output: a structured answer (text.format json_schema), which the grammar ends
    within the budget where the random model's free text would not."""

    sky: Literal["sunny", "rainy"]


@pytest.fixture(scope="module")
def sdk_server(tiny_model_dir):
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys((KEY,))}, num_slots=8192,
                           max_batch_tokens=512)
    yield running
    running.thread.stop()


def weather_agent(served: str, calls: list[str]) -> agents.Agent:
    """An agent whose first model call must call get_weather (the SDK resets tool_choice after it) and
    whose answer is a Forecast."""
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:   # an enum: the random model's call ends
        """The weather of a city."""
        calls.append(city)
        return '{"temp_c": 21}'

    settings = agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=1.0,
                                    parallel_tool_calls=False)
    return agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                        model=served, model_settings=settings, output_type=Forecast)


def run_config(server) -> agents.RunConfig:
    """The SDK's default provider (Responses API) on a client of `server`; no tracing."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    return agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client), tracing_disabled=True)


def served_name(server) -> str:
    import httpx

    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    return models["data"][0]["id"]


def kinds(result) -> list[str]:
    return [item.type for item in result.new_items]


def test_the_default_responses_model_completes_a_tool_loop(sdk_server):
    calls: list[str] = []
    config = run_config(sdk_server)
    assert isinstance(config.model_provider.get_model(None), agents.OpenAIResponsesModel)  # the SDK's default
    result = agents.Runner.run_sync(weather_agent(served_name(sdk_server), calls), "Weather in Paris?",
                                    run_config=config, max_turns=4)
    assert len(calls) == 1
    assert kinds(result)[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds(result)[-1] == "message_output_item" and isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2   # two /v1/responses requests: the call, then the answer
    assert all(response.usage.input_tokens > 0 for response in result.raw_responses)


def test_the_streamed_run_completes_the_same_loop(sdk_server):
    calls: list[str] = []

    async def streamed() -> list[str]:
        result = agents.Runner.run_streamed(weather_agent(served_name(sdk_server), calls), "Weather in Rome?",
                                            run_config=run_config(sdk_server), max_turns=4)
        events = [event.type async for event in result.stream_events()]
        assert kinds(result)[:2] == ["tool_call_item", "tool_call_output_item"]
        assert isinstance(result.final_output, Forecast)
        return events

    events = asyncio.run(streamed())
    assert len(calls) == 1 and "raw_response_event" in events and "run_item_stream_event" in events
    assert_idle_without_leak(sdk_server)
