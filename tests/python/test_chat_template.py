"""lf::data::ChatTemplate (our Jinja subset) against jinja2 as transformers renders chat templates.

Real published chat templates (Llama-3 / 3.1 / 3.2 Instruct, Qwen2.5-Instruct, Qwen3, Mistral-7B-Instruct v0.1 and
v0.3) are test data below. For a battery of conversations each is rendered by
`transformers.utils.chat_template_utils.render_jinja_template` (jinja2 sandbox, trim_blocks, lstrip_blocks,
loopcontrols, transformers' tojson / raise_exception / strftime_now / namespace) and by the C++ renderer, driven
through the gtest hook `ChatTemplateOracle.RenderCases` (env LF_CHAT_TEMPLATE_CASES -> LF_CHAT_TEMPLATE_OUT), once
for all cases. A set of small templates checks the expression language against the same jinja2 environment, and the
built-ins "chatml" / "llama3" / "mistral" must match the real templates on simple conversations.
"""
import copy
import json
import pathlib
import tempfile

import pytest

from conftest import run_gtest_hook

ROOT = pathlib.Path(__file__).resolve().parents[2]
ctu = pytest.importorskip("transformers.utils.chat_template_utils")

# ------------------------------------------------------------------------------------------------ templates

LLAMA3 = r"""{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>

'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>

' }}{% endif %}"""

LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL01 = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

MISTRAL03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.1": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": (LLAMA32, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": (QWEN25, None, "<|im_end|>"),
    "qwen3": (QWEN3, None, "<|im_end|>"),
    "mistral0.1": (MISTRAL01, "<s>", "</s>"),
    "mistral0.3": (MISTRAL03, "<s>", "</s>"),
}

# ------------------------------------------------------------------------------------------------ conversations

def u(c):
    return {"role": "user", "content": c}


def a(c, **kw):
    return {"role": "assistant", "content": c, **kw}


def s(c):
    return {"role": "system", "content": c}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city, e.g. \"Paris\" or 'Zürich'.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 1}},
        "required": ["city"]},
    "return": {"type": "object"}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "number"}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius", "days": 3}}}
CALL2 = {"id": "call67890", "type": "function",
         "function": {"name": "search", "arguments": {"query": "weather \"today\"\n", "top_k": 0.1, "big": 1e20,
                                                      "tiny": 1e-7, "flag": True, "none": None, "list": [1, 2.5]}}}
UNICODE = "  Привет, 世界! 👨‍👩‍👧 naïve café — \"quotes\" 'apos' back\\slash\ttab  \n"

PLAIN = {
    "single": [u("Hello!")],
    "system": [s("You are a terse assistant."), u("Hi there")],
    "multi": [s("Be nice."), u("What is 2+2?"), a("4"), u("And 3+3?"), a("6"), u("Thanks")],
    "no_system_multi": [u("one"), a("two"), u("three")],
    "ends_assistant": [u("Tell me a joke"), a("Why did the chicken cross the road?")],
    "unicode": [s(" Système: réponds en français. "), u(UNICODE), a(UNICODE), u("ok\r\nbye ")],
    "empty_content": [u(""), a(""), u("x")],
}
TOOL_CONVS = {
    "tool_call": [s("You can call tools."), u("Weather in Zürich?"), a("", tool_calls=[CALL]),
                  {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"sunny\"}", "tool_call_id": "call12345"},
                  a("It is 21°C and sunny.")],
    "tool_pending": [u("Weather in Zürich?"), a("", tool_calls=[CALL]),
                     {"role": "tool", "content": "21 degrees", "tool_call_id": "call12345"}],
}
QWEN_EXTRA = {
    "two_calls": [s("sys"), u("Do two things"), a("Sure, calling.", tool_calls=[CALL, CALL2]),
                  {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}, a("Done.")],
    "think_inline": [u("Q1"), a("<think>\nreasoning one\n</think>\n\nAnswer one"), u("Q2"),
                     a("<think>\nreasoning two\n</think>\n\nAnswer two")],
    "think_field": [u("Q1"), a("Answer one", reasoning_content="hidden 1"), u("Q2"),
                    a("Answer two", reasoning_content="  thought two\n")],
    "multi_step": [s("sys"), u("Find it"), a("", tool_calls=[CALL2]),
                   {"role": "tool", "content": "found"}, a("<think>\nnow answer\n</think>\nHere it is"),
                   u("<tool_response>\nlate\n</tool_response>"), a("final")],
    "tool_first": [{"role": "tool", "content": "orphan"}, u("hi")],
}


def make_cases():
    cases = []  # (id, template source, kwargs for render_jinja_template, conversation, tools)
    for tname, (src, bos, eos) in TEMPLATES.items():
        convs = dict(PLAIN)
        if tname.startswith("llama3.") or tname.startswith("qwen") or tname == "mistral0.3":
            convs.update(TOOL_CONVS)
        if tname.startswith("qwen"):
            convs.update(QWEN_EXTRA)
        for cname, conv in convs.items():
            gens = [False, True] if not cname.startswith("tool") else [True]
            for gen in gens:
                tool_opts = [None]
                if cname.startswith("tool") or cname in ("system", "multi", "two_calls", "multi_step"):
                    if tname not in ("llama3", "mistral0.1"):
                        tool_opts.append(TOOLS)
                for tools in tool_opts:
                    kw = {"bos_token": bos, "eos_token": eos}
                    cases.append((f"{tname}-{cname}-gen{int(gen)}-tools{int(tools is not None)}", src,
                                  dict(kw, add_generation_prompt=gen), conv, tools))
        if tname == "qwen3":
            for conv in ("single", "multi", "think_inline"):
                for et in (False, True):
                    cases.append((f"qwen3-{conv}-enable_thinking{et}", src,
                                  dict(bos_token=None, eos_token=eos, add_generation_prompt=True, enable_thinking=et),
                                  PLAIN.get(conv) or QWEN_EXTRA[conv], None))
        if tname == "llama3.1":
            cases.append(("llama3.1-builtin_tools", src,
                          dict(bos_token=bos, eos_token=eos, add_generation_prompt=True,
                               builtin_tools=["brave_search", "wolfram_alpha", "code_interpreter"],
                               date_string="01 Jan 2025"),
                          [s("sys"), u("Search it"),
                           a("", tool_calls=[{"function": {"name": "brave_search", "arguments": {"query": "x"}}}]),
                           {"role": "ipython", "content": {"result": "y"}}], None))
            cases.append(("llama3.1-tools_in_system", src,
                          dict(bos_token=bos, eos_token=eos, add_generation_prompt=True, tools_in_user_message=False),
                          TOOL_CONVS["tool_call"], TOOLS))
            cases.append(("llama3.1-two_calls_error", src, dict(bos_token=bos, eos_token=eos),
                          [u("x"), a("", tool_calls=[CALL, CALL2])], None))
    # errors raised by the templates
    cases.append(("mistral0.1-alternation_error", MISTRAL01, dict(bos_token="<s>", eos_token="</s>"),
                  [u("a"), u("b")], None))
    cases.append(("mistral0.3-bad_role", MISTRAL03, dict(bos_token="<s>", eos_token="</s>"),
                  [u("a"), {"role": "critic", "content": "b"}], None))
    cases.append(("mistral0.3-bad_call_id", MISTRAL03, dict(bos_token="<s>", eos_token="</s>"),
                  [u("a"), a("", tool_calls=[{"id": "short", "function": {"name": "f", "arguments": {}}}])], None))
    cases.append(("mistral0.3-tool_content_dict", MISTRAL03, dict(bos_token="<s>", eos_token="</s>"),
                  [u("a"), a("", tool_calls=[CALL]),
                   {"role": "tool", "content": {"temp": 1.5, "ok": True, "name": "it's"}, "tool_call_id": "call12345"}],
                  None))
    return cases


# Small templates exercising the expression language in the transformers environment.
SNIPPETS = [
    ("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 7 // 2 }} {{ -7 // 2 }} "
                   "{{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 1 ~ (2 + 3) }} {{ 2 * 3 ~ 4 }} {{ 'a' ~ 1 ~ none ~ true }} "
                   "{{ -3|abs }} {{ 2 + -1 }} {{ 10 - 2 - 3 }} {{ 1.5 * 2 }} {{ 2 ** -1 }}", {}),
    ("concat_binds_tighter_than_plus", "{{ 1 ~ 2 + 3 }}", {}),
    ("logic", "{{ 1 and 2 }} {{ 0 or 'x' }} {{ not 1 == 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' in 'cat' }} "
              "{{ 2 not in [1, 2] }} {{ none or '' }}|{{ [] and 1 }}", {}),
    ("literals", "{{ 'a\\tb\\n\\u00e9\\x41' }}|{{ \"it's\" }}|{{ 'x' 'y' }}|{{ [1, 'a', none, true, 1.5] }}|"
                 "{{ {'k': [1, 2], 'b': {'c': none}} }}|{{ (1, 2) }}|{{ 1e3 }}|{{ 0.1 + 0.2 }}|{{ 1_000 }}", {}),
    ("strings", "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip(' \\n') }}|{{ s.split() }}|{{ s.split(',') }}|"
                "{{ s.split(',', 1) }}|{{ s.upper() }}|{{ s.lower() }}|{{ s.title() }}|{{ s.replace('o', '0') }}|"
                "{{ s.startswith(' he') }}|{{ s.endswith(('x', 'd\\n')) }}|{{ s[::-1] }}|{{ s[1:4] }}|{{ s[-3:] }}|"
                "{{ s[:-1] }}|{{ s[0] }}|{{ s|length }}|{{ 'héllo wörld'|title }}|{{ 'hello-world foo(bar'|title }}|"
                "{{ 'ÉCOLE'|lower }}|{{ '{} and {}'.format(1, 'b') }}|{{ 'x'.join(['a', 'b']) }}|{{ s.find('wor') }}",
     {"s": " hello, wörld\n"}),
    ("filters", "{{ l|join(', ') }}|{{ l|first }}|{{ l|last }}|{{ l|length }}|{{ l|reverse|list }}|{{ l|sort }}|"
                "{{ l|max }}|{{ l|min }}|{{ l|sum }}|{{ l|unique|list }}|{{ x|default('d') }}|{{ none|default('d') }}|"
                "{{ ''|default('d', true) }}|{{ '  t  '|trim }}|{{ 'xxtxx'|trim('x') }}|{{ 'a b'|upper }}|"
                "{{ 'hello world'|capitalize }}|{{ 3.7|int }}|{{ '42'|int }}|{{ 'z'|int(7) }}|{{ '2.5'|float }}|"
                "{{ -3|abs }}|{{ 2.567|round(2) }}|{{ 2.5|round }}|{{ 2.1|round(0, 'ceil') }}|{{ 5|string }}|"
                "{{ 'a-b-c'|replace('-', '+') }}|{{ 'a-b-c'|replace('-', '', 1) }}|{{ d|items|list }}|"
                "{{ d|dictsort }}|{{ 'abc'|list }}|{{ 'a<b'|e }}|{{ 'x'|safe }}|{{ 'one two  three'|wordcount }}|"
                "{{ 'l1\\nl2\\n\\nl3'|indent(2) }}|{{ 'l1\\nl2'|indent(2, true) }}|{{ l|map('string')|join }}",
     {"l": [3, 1, 2, 3], "d": {"b": 1, "a": 2}}),
    ("selectattr", "{{ m|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(',') }}|"
                   "{{ m|rejectattr('role', 'equalto', 'user')|list|length }}|{{ m|selectattr('extra')|list }}|"
                   "{{ m|selectattr('extra', 'defined')|map(attribute='role')|list }}|{{ [1, 0, 2]|select|list }}|"
                   "{{ [1, 2, 3, 4]|select('odd')|list }}|{{ ['a', 'b']|reject('equalto', 'a')|list }}|"
                   "{{ m|map(attribute='missing', default='-')|list }}|{{ m|map(attribute='role')|unique|list }}",
     {"m": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "extra": 1},
            {"role": "user", "content": "c"}]}),
    ("tests", "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ n is not none }}"
              "{{ 's' is string }}{{ 1 is string }}{{ d is mapping }}{{ l is mapping }}{{ l is iterable }}"
              "{{ 's' is iterable }}{{ 1 is iterable }}{{ l is sequence }}{{ 1 is number }}{{ 1.5 is number }}"
              "{{ true is number }}{{ false is false }}{{ 0 is false }}{{ true is true }}{{ 3 is odd }}{{ 4 is even }}"
              "{{ 9 is divisibleby 3 }}{{ 1 is integer }}{{ 1.0 is float }}{{ 2 is eq 2 }}{{ 'a' is in 'abc' }}"
              "{{ true is boolean }}{{ 'abc' is lower }}{{ x is gt 0 }}",
     {"x": 1, "n": None, "d": {}, "l": [1]}),
    ("loops", "{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
              "{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}"
              "{{ loop.cycle('a', 'b') }};{% endfor %}"
              "{% for x in l if x > 1 %}[{{ x }}{{ loop.index }}/{{ loop.length }}]{% endfor %}"
              "{% for x in [] %}no{% else %}empty{% endfor %}"
              "{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}{% for k in d %}{{ k }}{% endfor %}"
              "{% for x in l %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}"
              "{% endfor %}{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}"
              "{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(5, 0, -2) %}{{ i }}{% endfor %}"
              "{% for x in l %}{% for y in l %}{{ loop.index }}{% endfor %}|{{ loop.index }}{% endfor %}",
     {"l": [1, 2, 3, 4], "d": {"z": 1, "a": 2}}),
    ("scoping", "{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}"
                "{% set ns = namespace(x=1, y='a') %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}"
                "{% if true %}{% set z = 5 %}{% endif %}{{ z }}{% set a, b = 1, 2 %}{{ a }}{{ b }}"
                "{% set blk %}inner {{ x }}{% endset %}[{{ blk }}]"
                "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bo') }}"
                "{{ greet('Al', punct='?') }}{{ greet(name='Cy') }}{{ dict(a=1, b='x') }}{{ dict(a=1)|tojson }}", {}),
    ("access", "{{ d.a }}|{{ d['a'] }}|{{ d.missing }}|{{ d.get('a') }}|{{ d.get('zz', 'dflt') }}|{{ d.get('zz') }}|"
               "{{ d.keys()|list }}|{{ d.values()|list }}|{{ l[0] }}|{{ l[-1] }}|{{ l[10] }}|{{ l[1:] }}|{{ l[:-1] }}|"
               "{{ l[::2] }}|{{ l[::-1] }}|{{ l.0 }}|{{ n.x.y is defined }}|{{ 'k' in d }}|{{ d|length }}|"
               "{{ 'yes' if d.a else 'no' }}|{{ 'yes' if d.missing else 'no' }}|{{ 'x' if false }}|"
               "{{ l + [9] }}|{{ 'ab' * 2 }}",
     {"d": {"a": 1, "b": [2, 3]}, "l": [1, 2, 3], "n": {"x": {}}}),
    ("tojson", "{{ v|tojson }}|{{ v|tojson(indent=2) }}|{{ v|tojson(ensure_ascii=true) }}|"
               "{{ v|tojson(separators=(',', ':')) }}|{{ v|tojson(sort_keys=true) }}|{{ [v, []]|tojson(indent=0) }}|"
               "{{ 'x\"\\\\\\n\\u0001'|tojson }}|{{ {}|tojson(indent=2) }}",
     {"v": {"z": 1, "é": "ü😀", "n": None, "f": 1.5, "l": [1, {"a": True}], "big": 12345678901234, "e": 1e-5}}),
    ("str_values", "{{ none }}|{{ true }}|{{ 1.0 }}|{{ 1e16 }}|{{ 123456789.125 }}|{{ 1e-4 }}|{{ [none, true, 'it\\'s', "
                   "\"q\\\"\", 'ü\\n'] }}|{{ {'a': none} }}|{{ 3 / 4 }}|{{ 10 / 5 }}|{{ 2 ** -1 }}|{{ 1.5e300 * 1e10 }}", {}),
    ("whitespace", "a  \n  {% if true %}\n  b\n  {% endif %}\n  c {{- ' d ' -}} e\n{# comment #}\nf {%- if 1 %} g {% endif -%}\n h\n"
                   "    {%+ if true %}kept{% endif %}\n  {{ 'var' }}  \n{%- for i in [1, 2] %}\n  - {{ i }}\n{%- endfor %}\n"
                   "x {% if true %}\ny{% endif %}\n  {#- c #}  z\n", {}),
    ("ws_blocks", "{% for m in l %}\n    <{{ m }}>\n{% endfor %}\n{% if true -%}\n   trimmed\n{%- endif %}\nend\n\n", {"l": [1, 2]}),
    ("raise", "before{{ raise_exception('bad thing: ' ~ x) }}", {"x": 42}),
    ("strftime", "{{ strftime_now('%Y-%m-%d') }}", {}),
    ("undefined_attr_error", "{{ missing.attr }}", {}),
    ("none_iter_error", "{% for x in n %}{% endfor %}", {"n": None}),
    ("add_error", "{{ 'a' + 1 }}", {}),
]


def run_cpp(items):
    """items: list of {"template"|"builtin", "context"}; returns list of {"ok": str} | {"error": str}."""
    with tempfile.TemporaryDirectory() as tmp:
        cases, out = pathlib.Path(tmp) / "cases.json", pathlib.Path(tmp) / "out.json"
        cases.write_text(json.dumps(items, ensure_ascii=False), encoding="utf-8")
        proc = run_gtest_hook("ChatTemplateOracle.RenderCases",
                              {"LF_CHAT_TEMPLATE_CASES": str(cases), "LF_CHAT_TEMPLATE_OUT": str(out)})
        assert out.exists(), "the gtest hook wrote no output (was it skipped?)\n" + proc.stdout
        res = json.loads(out.read_text(encoding="utf-8"))
    assert len(res) == len(items)
    return res


def reference(src, conv, tools, kw):
    """transformers' rendering, and the context the template saw (for the C++ side)."""
    try:
        rendered, _ = ctu.render_jinja_template(conversations=[copy.deepcopy(conv)], tools=copy.deepcopy(tools),
                                                chat_template=src, **kw)
        ref = {"ok": rendered[0]}
    except Exception as e:  # noqa: BLE001 - template errors are part of what is compared
        ref = {"error": f"{type(e).__name__}: {e}"}
    msgs = copy.deepcopy(conv)
    if hasattr(ctu, "_alias_reasoning_fields"):
        msgs = ctu._alias_reasoning_fields(msgs)
    kw = dict(kw)
    ctx = {"messages": msgs, "tools": tools, "documents": None,
           "add_generation_prompt": kw.pop("add_generation_prompt", False), **kw}
    return ref, ctx


def snippet_reference(src, ctx):
    try:
        return {"ok": ctu._compile_jinja_template(src).render(**ctx)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


BUILTIN_PAIRS = [  # (builtin, real template, bos, eos, conversations it must match on)
    ("chatml", QWEN25, None, "<|im_end|>", ["system", "multi", "unicode"]),
    ("chatml", QWEN3, None, "<|im_end|>", ["single", "system", "no_system_multi"]),
    ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>", list(PLAIN)),
    ("mistral", MISTRAL03, "<s>", "</s>", list(PLAIN)),
]


@pytest.fixture(scope="session")
def results():
    items, refs, ids = [], [], []
    for cid, src, kw, conv, tools in make_cases():
        ref, ctx = reference(src, conv, tools, kw)
        items.append({"template": src, "context": ctx})
        refs.append(ref)
        ids.append(cid)
    for name, src, ctx in SNIPPETS:
        items.append({"template": src, "context": ctx})
        refs.append(snippet_reference(src, ctx))
        ids.append("snippet-" + name)
    for bname, src, bos, eos, convs in BUILTIN_PAIRS:
        for cname in convs:
            for gen in (False, True):
                ref, ctx = reference(src, PLAIN[cname], None, {"bos_token": bos, "eos_token": eos,
                                                               "add_generation_prompt": gen})
                items.append({"builtin": bname, "context": ctx})
                refs.append(ref)
                ids.append(f"builtin-{bname}-{cname}-gen{int(gen)}")
    got = run_cpp(items)
    return dict(zip(ids, zip(refs, got)))


CASE_IDS = [c[0] for c in make_cases()]
SNIPPET_IDS = ["snippet-" + n for n, _, _ in SNIPPETS]
BUILTIN_IDS = [f"builtin-{b}-{c}-gen{g}" for b, _, _, _, cs in BUILTIN_PAIRS for c in cs for g in (0, 1)]


def check(ref, got, cid):
    if "error" in ref:
        assert "error" in got, f"{cid}: jinja2 raised {ref['error']!r} but we rendered {got.get('ok')!r}"
        assert got["error"].startswith("chat_template:"), got["error"]
        assert "\n" not in got["error"]
        if "TemplateError" in ref["error"]:  # raise_exception: the same message
            assert ref["error"].split(": ", 1)[1] in got["error"]
    else:
        assert "ok" in got, f"{cid}: {got.get('error')}"
        assert got["ok"] == ref["ok"]


@pytest.mark.parametrize("cid", CASE_IDS)
def test_real_templates(results, cid):
    check(*results[cid], cid)


@pytest.mark.parametrize("cid", SNIPPET_IDS)
def test_expression_language(results, cid):
    check(*results[cid], cid)


@pytest.mark.parametrize("cid", BUILTIN_IDS)
def test_builtins_match_real_templates(results, cid):
    check(*results[cid], cid)


def test_case_battery_is_large():
    assert len(CASE_IDS) > 120
    assert any("tools1" in c for c in CASE_IDS) and any("enable_thinking" in c for c in CASE_IDS)
