"""Chat templates of the model families kvsplice parses tool calls for, written out for tests (no hub
downloads). Each reproduces its family's tool sections: how tools are offered, how an assistant turn
with tool calls is rendered (the text the model learned to write), and how tool results come back.

SMOLLM2 is the default model's own template (it has no tool syntax).
"""

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen 2.5 (Hermes-style <tool_call>), ChatML turns; tool results come back as a user turn.
QWEN25 = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Llama 3.1 (JSON tool calls, tools in the first user turn, results as ipython turns, one call per turn).
LLAMA31 = r"""
{{- bos_token }}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content | trim }}{%- set messages = messages[1:] %}{%- endif %}
{{- '<|eot_id|>' }}
{%- if tools %}
    {%- set first_user = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
    {{- first_user + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' }}{{- call.arguments | tojson }}{{- '}<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}{{- {'output': message.content} | tojson }}{{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral v0.3 ([AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] JSON list, 9-character ids).
MISTRAL_V03 = r"""
{{- bos_token }}
{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and message == user_messages[-1] %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}
            {{- '][/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'system' %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.id is not defined or tool_call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
            {{- '{"name": "' + tool_call.function.name + '", "arguments": ' }}{{- tool_call.function.arguments | tojson }}{{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' }}{{- message.content | tojson }}{{- ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""
