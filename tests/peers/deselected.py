"""Every peer test that is not run against kvsplice, with the reason: one place for the whole list.

A key names a file under tests/peers/files/, a class in it or one test (parametrized ids included).
Only these kinds of reasons are allowed: the test asserts the peer's own model or tokenizer outputs,
uses the peer's LoRA adapters, its version string, or a non-OpenAI endpoint of the peer, or it tests
the peer's own Python code rather than its HTTP API. Everything else a test asserts is kvsplice's
to pass.
"""

VLLM = "vllm/tests/entrypoints/openai"
SERVE = "vllm/tests/entrypoints/serve/instrumentator"
SGLANG = "sglang/test/srt/openai_server"

MODEL_OUTPUT = "asserts the peer's own model's output"
LORA = "uses the peer's LoRA adapter (zephyr-lora)"
PEER_CODE = "tests the peer's own Python classes in-process, not its HTTP API"

DESELECTED: dict[str, str] = {
    # vLLM: basic (serve/instrumentator)
    f"{SERVE}/test_basic.py::test_show_version": "asserts vLLM's version string from GET /version",
    f"{SERVE}/test_basic.py::test_request_cancellation":
        "needs a 10,100-token context (vLLM starts its model with --max-model-len 10100); the default model's is 8,192",
    f"{SERVE}/test_basic.py::test_server_load": "vLLM's non-OpenAI endpoint GET /load",
    f"{SERVE}/test_basic.py::test_health_check_engine_dead_error": PEER_CODE,
    # vLLM: chat
    f"{VLLM}/chat_completion/test_chat.py::test_no_logprobs_chat[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_zero_logprobs_chat[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_some_logprobs_chat[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_too_many_chat_logprobs[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_single_chat_session[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_streaming[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_stream_options[zephyr-lora]": LORA,
    f"{VLLM}/chat_completion/test_chat.py::test_single_chat_session[test-model]":
        "asserts zephyr-7b-beta's prompt token count (37) for its chat template",
    f"{VLLM}/chat_completion/test_chat.py::test_more_than_one_prompt_logprobs_chat[test-model]":
        MODEL_OUTPUT + " (the prompt's 4th token is zephyr's most likely one there, so top-1 holds one entry)",
    f"{VLLM}/chat_completion/test_chat.py::test_response_format_json_object": MODEL_OUTPUT + " (1+1 answered as {\"result\": 2})",
    f"{VLLM}/chat_completion/test_chat.py::test_response_format_json_schema": MODEL_OUTPUT + " (1+1 answered as {\"result\": 2})",
    f"{VLLM}/chat_completion/test_chat.py::test_complex_message_content": MODEL_OUTPUT + " (1+1 answered as \"2\")",
    f"{VLLM}/chat_completion/test_chat.py::test_invocations": "vLLM's non-OpenAI endpoint POST /invocations (SageMaker)",
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_to_sampling_params": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_default": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_various_values": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_exceeds_default_limit": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_at_limit": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_custom_limit": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_n_parameter_massive_value": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_accepts_model_specific_reasoning_effort":
        PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_chat_completion_request_rejects_unknown_reasoning_effort": PEER_CODE,
    f"{VLLM}/chat_completion/test_chat.py::test_null_top_logprobs_is_same_as_omitted": PEER_CODE,
    # vLLM: completion
    f"{VLLM}/completion/test_completion.py::test_single_completion":
        "asserts opt-125m's prompt token count (6 for \"Hello, my name is\")",
    f"{VLLM}/completion/test_completion.py::test_completion_request_bad_words_to_sampling_params": PEER_CODE,
    f"{VLLM}/completion/test_completion.py::test_completion_request_bad_words_default_empty": PEER_CODE,
    f"{VLLM}/completion/test_completion.py::test_completion_request_forwards_routed_experts_prompt_start": PEER_CODE,
    # SGLang: basic
    f"{SGLANG}/basic/test_openai_server.py::TestOpenAIServer::test_response_prefill":
        MODEL_OUTPUT + " (Llama-3.1-8B extracting \"SmartHome Mini\"), sent under that model's name",
    f"{SGLANG}/basic/test_openai_server.py::TestOpenAIServerv1Responses::test_response_prefill":
        MODEL_OUTPUT + " (Llama-3.1-8B extracting \"SmartHome Mini\"), sent under that model's name",
    f"{SGLANG}/basic/test_openai_server.py::TestOpenAIV1Rerank": "SGLang's non-OpenAI endpoint POST /v1/rerank",
    f"{SGLANG}/basic/test_openai_server.py::TestOpenAIV1Score": "SGLang's non-OpenAI endpoint POST /v1/score",
    f"{SGLANG}/basic/test_openai_server.py::TestOpenAIServerCustomLogitProcessor":
        PEER_CODE + " (a pickled SGLang CustomLogitProcessor; the class is not even imported by the file)",
    # SGLang: validation
    f"{SGLANG}/validation/test_matched_stop.py::TestMatchedStop::test_finish_stop_eos":
        "asserts Llama 3's EOS id (128009) as matched_stop",
    f"{SGLANG}/validation/test_matched_stop.py::TestRegexPatternMaxLength": PEER_CODE,
}
