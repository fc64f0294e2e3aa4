"""Golden renderings of every family chat template, and exactly which tokens each one trains."""
from __future__ import annotations

import copy
import functools
import itertools
import logging

import jinja2
import pytest
from tiny_models import CHATML_TEMPLATE, make_tiny_tokenizer

from twinkle_core.data import (
    ChatTemplateError, chat_template_names, encode_chat, encode_prompt, ensure_chat_template, get_chat_template,
    render_chat,
)
from twinkle_core.data.messages import normalise_messages
from twinkle_core.data.templates import PrefixRenderer

QWEN_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEEPSEEK = dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>", pad_token="<｜end▁of▁sentence｜>")
DEEPSEEK_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
DEEPSEEK_TOOL_TOKENS = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]
LLAMA3 = dict(extra_special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
              bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")
# Each family's special tokens, BOS, EOS and padding, as its instruct/chat tokenizer declares them.
FAMILY_TOKENIZERS = {
    "chatml": dict(extra_special_tokens=QWEN_TOKENS),
    "qwen2_5": dict(extra_special_tokens=QWEN_TOKENS),
    "qwen3": dict(extra_special_tokens=QWEN_TOKENS),
    "qwen3_5": dict(extra_special_tokens=QWEN_TOKENS),
    "yi": dict(bos_token="<|startoftext|>", eos_token="<|im_end|>", pad_token="<unk>"),
    "deepseek_r1": dict(extra_special_tokens=DEEPSEEK_TOKENS + DEEPSEEK_TOOL_TOKENS, **DEEPSEEK),
    "deepseek_v4": dict(extra_special_tokens=DEEPSEEK_TOKENS, **DEEPSEEK),
    "llama3": LLAMA3,
    "mistral": dict(extra_special_tokens=["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                    bos_token="<s>", eos_token="</s>", pad_token="<unk>"),
    "glm4": dict(extra_special_tokens=["<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
                 bos_token="[gMASK]", eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
    "internlm2": dict(extra_special_tokens=["<|action_start|>", "<|action_end|>", "<|interpreter|>", "<|plugin|>"],
                      bos_token="<s>", eos_token="</s>", pad_token="</s>"),
}


@functools.cache
def family_tokenizer(name: str):
    return make_tiny_tokenizer(chat_template=get_chat_template(name), **FAMILY_TOKENIZERS[name])


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "system", "content": "You are Twinkle."}, {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Twinkle."}]
MULTI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
# History reasoning from reasoning_content, the last reply's written inline.
THINKING = [
    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."},
    {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6."},
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
]
CASES = {
    "chat": (CHAT, {}),
    "prompt": (CHAT[:2], {"add_generation_prompt": True}),
    "multi": (MULTI, {}),
    "thinking": (THINKING, {}),
    "no_thinking": (THINKING, {"enable_thinking": False}),
    "prompt_no_thinking": (CHAT[:2], {"add_generation_prompt": True, "enable_thinking": False}),
    "tools": (TOOL_CHAT, {"tools": TOOLS}),
    "tool_calls": (TOOL_CHAT, {}),  # R1 renders calls and results but has no prompt for a tools list
}
# Each checked by hand against the family's published format (see the header of its .jinja file).
GOLDEN = {
    ("chatml", "chat"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Twinkle.<|im_end|>\n"
    ),
    ("chatml", "prompt"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("chatml", "multi"): (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "Capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
    ),
    ("chatml", "tools"): (
        "<|im_start|>system\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call>"
        "</tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "Sunny.<|im_end|>\n"
    ),
    ("qwen2_5", "chat"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Twinkle.<|im_end|>\n"
    ),
    ("qwen2_5", "prompt"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("qwen2_5", "multi"): (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "Capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
    ),
    ("qwen2_5", "tools"): (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call>"
        "</tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "Sunny.<|im_end|>\n"
    ),
    ("qwen3", "chat"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nI am Twinkle.<|im_end|>\n"
    ),
    ("qwen3", "prompt"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("qwen3", "multi"): (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "Capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nParis.<|im_end|>\n"
    ),
    ("qwen3", "thinking"): (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\n"
        "3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6.<|im_end|>\n"
    ),
    ("qwen3", "no_thinking"): (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\n"
        "3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n6.<|im_end|>\n"
    ),
    ("qwen3", "prompt_no_thinking"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ),
    ("qwen3", "tools"): (
        "<|im_start|>system\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call>"
        "</tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\nSunny.<|im_end|>\n"
    ),
    ("qwen3_5", "chat"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nI am Twinkle.<|im_end|>\n"
    ),
    ("qwen3_5", "prompt"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    ),
    ("qwen3_5", "multi"): (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "Capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nParis.<|im_end|>\n"
    ),
    ("qwen3_5", "thinking"): (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\n"
        "3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6.<|im_end|>\n"
    ),
    ("qwen3_5", "no_thinking"): (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\n"
        "3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n6.<|im_end|>\n"
    ),
    ("qwen3_5", "prompt_no_thinking"): (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ),
    ("qwen3_5", "tools"): (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
        "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
        "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
        "Reminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
        "nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE the function "
        "call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your current knowledge "
        "and do not tell the user about function calls\n</IMPORTANT><|im_end|>\n<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nSunny.<|im_end|>\n"
    ),
    ("yi", "chat"): (
        "You are Twinkle.<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n"
        "I am Twinkle.<|im_end|>\n"
    ),
    ("yi", "prompt"): (
        "You are Twinkle.<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n"
    ),
    ("yi", "multi"): (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "Capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
    ),
    ("deepseek_r1", "chat"): (
        "<｜begin▁of▁sentence｜>You are Twinkle.<｜User｜>Who are you?<｜Assistant｜><think>\n\n</think>\n\n"
        "I am Twinkle.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_r1", "prompt"): (
        "<｜begin▁of▁sentence｜>You are Twinkle.<｜User｜>Who are you?<｜Assistant｜><think>\n"
    ),
    ("deepseek_r1", "multi"): (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜><｜User｜>Capital of "
        "France?<｜Assistant｜><think>\n\n</think>\n\nParis.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_r1", "thinking"): (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4.<｜end▁of▁sentence｜><｜User｜>3+3?<｜Assistant｜><think>\n"
        "Add again.\n</think>\n\n6.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_r1", "no_thinking"): (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4.<｜end▁of▁sentence｜><｜User｜>3+3?<｜Assistant｜><think>\n"
        "\n</think>\n\n6.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_r1", "tool_calls"): (
        "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜><think>\n\n</think>\n\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n'
        "```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
        "sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Sunny.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_v4", "chat"): (
        "<｜begin▁of▁sentence｜>You are Twinkle.<｜User｜>Who are you?<｜Assistant｜><think></think>I am "
        "Twinkle.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_v4", "prompt"): (
        "<｜begin▁of▁sentence｜>You are Twinkle.<｜User｜>Who are you?<｜Assistant｜><think>"
    ),
    ("deepseek_v4", "multi"): (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜><｜User｜>Capital of "
        "France?<｜Assistant｜><think></think>Paris.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_v4", "thinking"): (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>4.<｜end▁of▁sentence｜><｜User｜>3+3?<｜Assistant｜>"
        "<think>Add again.</think>6.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_v4", "no_thinking"): (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>4.<｜end▁of▁sentence｜><｜User｜>3+3?<｜Assistant｜>"
        "</think>6.<｜end▁of▁sentence｜>"
    ),
    ("deepseek_v4", "prompt_no_thinking"): (
        "<｜begin▁of▁sentence｜>You are Twinkle.<｜User｜>Who are you?<｜Assistant｜></think>"
    ),
    ("deepseek_v4", "tools"): (
        "<｜begin▁of▁sentence｜>\n\n## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        '"<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n'
        '<｜DSML｜invoke name="$TOOL_NAME">\n'
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
        '...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        '{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}}}\n\n'
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        "<｜User｜>Weather in Paris?<｜Assistant｜><think></think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>"
        "</think>Sunny.<｜end▁of▁sentence｜>"
    ),
    ("llama3", "chat"): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are Twinkle.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Who are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am Twinkle.<|eot_id|>"
    ),
    ("llama3", "prompt"): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are Twinkle.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Who are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    ("llama3", "multi"): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "Hello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>"
    ),
    ("llama3", "tools"): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its proper arguments "
        "that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        'value}.Do not use variables.\n\n{\n    "type": "function",\n    "function": {\n'
        '        "name": "get_weather",\n        "description": "Get the weather",\n'
        '        "parameters": {\n            "type": "object",\n            "properties": {\n'
        '                "city": {\n                    "type": "string"\n                }\n'
        "            }\n        }\n    }\n}\n\n"
        "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|><|start_header_id|>'
        'ipython<|end_header_id|>\n\n"sunny"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
        "Sunny.<|eot_id|>"
    ),
    ("mistral", "chat"): (
        "<s>[INST] You are Twinkle.\n\nWho are you?[/INST] I am Twinkle.</s>"
    ),
    ("mistral", "prompt"): (
        "<s>[INST] You are Twinkle.\n\nWho are you?[/INST]"
    ),
    ("mistral", "multi"): (
        "<s>[INST] Hi[/INST] Hello!</s>[INST] Capital of France?[/INST] Paris.</s>"
    ),
    ("mistral", "tools"): (
        '<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": "Get the '
        'weather", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string"}}}}}][/AVAILABLE_TOOLS][INST] Weather in Paris?[/INST][TOOL_CALLS] [{"name": "get_weather", '
        '"arguments": {"city": "Paris"}, "id": "call00001"}]</s>[TOOL_RESULTS] {"content": sunny, "call_id": '
        '"call00001"}[/TOOL_RESULTS] Sunny.</s>'
    ),
    ("glm4", "chat"): (
        "[gMASK]<sop><|system|>\nYou are Twinkle.<|user|>\nWho are you?<|assistant|>\nI am Twinkle."
    ),
    ("glm4", "prompt"): (
        "[gMASK]<sop><|system|>\nYou are Twinkle.<|user|>\nWho are you?<|assistant|>"
    ),
    ("glm4", "multi"): (
        "[gMASK]<sop><|user|>\nHi<|assistant|>\nHello!<|user|>\nCapital of France?<|assistant|>\nParis."
    ),
    ("glm4", "tools"): (
        "[gMASK]<sop><|system|>\n"
        "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具\n\n"
        '## get_weather\n\n{\n    "name": "get_weather",\n    "description": "Get the weather",\n'
        '    "parameters": {\n        "type": "object",\n        "properties": {\n'
        '            "city": {\n                "type": "string"\n            }\n        }\n    }\n}\n'
        "在调用上述函数时，请使用 Json 格式表示调用的参数。<|user|>\nWeather in Paris?<|assistant|>get_weather\n"
        '{"city": "Paris"}<|observation|>\nsunny<|assistant|>\nSunny.'
    ),
    ("internlm2", "chat"): (
        "<s><|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Twinkle.<|im_end|>\n"
    ),
    ("internlm2", "prompt"): (
        "<s><|im_start|>system\nYou are Twinkle.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("internlm2", "multi"): (
        "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "Capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
    ),
    ("internlm2", "tools"): (
        '<s><|im_start|>system name=<|plugin|>\n[\n    {\n        "name": "get_weather",\n'
        '        "description": "Get the weather",\n        "parameters": {\n'
        '            "type": "object",\n            "properties": {\n                "city": {\n'
        '                    "type": "string"\n                }\n            }\n        }\n    }\n]\n'
        "<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        "<|action_start|><|plugin|>\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|><|im_end|>\n'
        "<|im_start|>environment name=<|plugin|>\nsunny<|im_end|>\n<|im_start|>assistant\n"
        "Sunny.<|im_end|>\n"
    ),
}


@pytest.mark.parametrize(("name", "case"), list(GOLDEN))
def test_golden_rendering(name, case):
    messages, kwargs = CASES[case]
    assert render_chat(family_tokenizer(name), messages, **kwargs) == GOLDEN[name, case]


@pytest.mark.parametrize("name", chat_template_names())
def test_prefixes_render_as_apply_chat_template_renders_them(name):
    """PrefixRenderer runs transformers' preparation once per conversation and renders the compiled template:
    every prefix must still be what apply_chat_template gives (this fails if a transformers release adds a step)."""
    tokenizer = family_tokenizer(name)
    reasoning = [{"role": "user", "content": "Q", "name": None},
                 {"role": "assistant", "content": "A", "thinking": "Hmm.", "tool_calls": None}]
    for messages, kwargs in [*CASES.values(), (reasoning, {}), (TOOL_CHAT, {"tools": TOOLS, "enable_thinking": False})]:
        tools, thinking = kwargs.get("tools"), kwargs.get("enable_thinking", True)
        messages = normalise_messages(messages, thinking)  # as assistant_spans renders them
        render = PrefixRenderer(tokenizer, messages, tools, thinking)
        assert render._steps is not None  # the direct path is the one under test
        for length, generation in itertools.product(range(1, len(messages) + 1), (False, True)):
            try:
                expected = tokenizer.apply_chat_template(messages[:length], tools=tools, tokenize=False,
                                                         add_generation_prompt=generation, enable_thinking=thinking)
            except jinja2.TemplateError:
                with pytest.raises(ChatTemplateError):
                    render(length, generation)
                continue
            assert render(length, generation) == expected, (messages[:length], generation)


def test_every_template_has_goldens_and_the_registry_lists_them():
    names = ["chatml", "deepseek_r1", "deepseek_v4", "glm4", "internlm2", "llama3", "mistral", "qwen2_5", "qwen3",
             "qwen3_5", "yi"]
    assert chat_template_names() == names == sorted(FAMILY_TOKENIZERS)
    assert {name for name, _ in GOLDEN} == set(names)
    assert all((name, "chat") in GOLDEN and (name, "prompt") in GOLDEN and (name, "multi") in GOLDEN for name in names)
    with pytest.raises(ValueError, match="chat template 'qwen9' is unknown; use one of: chatml, deepseek_r1"):
        get_chat_template("qwen9")


def _runs(tokenizer, encoded, trained=True):
    """Decoded runs of consecutive trained (or untrained) tokens."""
    runs, current = [], []
    for token, label in zip(encoded["input_ids"], encoded["labels"]):
        if (label != -100) == trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


# A system prompt, a reply whose reasoning is history by the end, a tool call with reasoning, its result, and a
# final reply with inline reasoning.
MASK_CHAT = [
    {"role": "system", "content": "You are Twinkle."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
    {"role": "assistant", "content": "<think>\nReport it.\n</think>\n\nSunny."},
]
PLAIN_CHAT = MASK_CHAT[:3] + [{"role": "user", "content": "Capital of France?"},
                              {"role": "assistant", "content": "Paris."}]
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
R1_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
DSML_CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             "</｜DSML｜tool_calls><｜end▁of▁sentence｜>")
QWEN3_5_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                "</tool_call><|im_end|>")
# What each family trains: reasoning where the template keeps it, the reply, the tool-call encoding and the token
# that ends the turn; never the prompt, the role headers or the generation prompt.
TRAINED = {
    "chatml": ["Hello!<|im_end|>", QWEN_CALL, "Sunny.<|im_end|>"],
    "qwen2_5": ["Hello!<|im_end|>", QWEN_CALL, "Sunny.<|im_end|>"],
    # The generation prompt ends with "<think>\n"; the first reply is history, so its reasoning is dropped.
    "qwen3_5": ["Hello!<|im_end|>", "Look it up.\n</think>\n\n" + QWEN3_5_CALL,
                "Report it.\n</think>\n\nSunny.<|im_end|>"],
    # The generation prompt opens no think block: a reply after the last query writes its own (when it reasons).
    "qwen3": ["Hello!<|im_end|>", "<think>\nLook it up.\n</think>\n\n" + QWEN_CALL,
              "<think>\nReport it.\n</think>\n\nSunny.<|im_end|>"],
    "yi": ["Hello!<|im_end|>", "Paris.<|im_end|>"],
    # After tool outputs there is no generation prompt to open the think block, so the reply writes all of it.
    "deepseek_r1": ["Hello!<｜end▁of▁sentence｜>", "Look it up.\n</think>\n\n" + R1_CALL,
                    "<think>\nReport it.\n</think>\n\nSunny.<｜end▁of▁sentence｜>"],
    # With tools the V4 encoder keeps every turn's reasoning.
    "deepseek_v4": ["Greet back.</think>Hello!<｜end▁of▁sentence｜>", "Look it up.</think>" + DSML_CALL,
                    "Report it.</think>Sunny.<｜end▁of▁sentence｜>"],
    "llama3": ["Hello!<|eot_id|>", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
               "Sunny.<|eot_id|>"],
    "mistral": [" Hello!</s>",
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
                " Sunny.</s>"],
    # No end marker: the next role token (a stop token of GLM-4's generation config) or an appended EOS.
    "glm4": ["\nHello!<|user|>", 'get_weather\n{"city": "Paris"}<|observation|>', "\nSunny.<|endoftext|>"],
    "internlm2": ["Hello!<|im_end|>",
                  '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
                  "<|action_end|><|im_end|>", "Sunny.<|im_end|>"],
}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_trained_tokens(name):
    tokenizer = family_tokenizer(name)
    messages = PLAIN_CHAT if name == "yi" else MASK_CHAT
    tools = None if name in ("yi", "deepseek_r1") else TOOLS
    encoded = encode_chat(tokenizer, messages, tools=tools)
    assert all(label in (-100, token) for token, label in zip(encoded["input_ids"], encoded["labels"]))
    assert _runs(tokenizer, encoded) == TRAINED[name]
    untrained = "".join(_runs(tokenizer, encoded, trained=False))
    prompts = [message["content"] for message in messages if message["role"] in ("system", "user", "tool")]
    assert all(prompt in untrained for prompt in prompts)


@pytest.mark.parametrize(("name", "trained"), [
    ("qwen3_5", ["Hello!<|im_end|>", QWEN3_5_CALL, "Sunny.<|im_end|>"]),
    ("qwen3", ["Hello!<|im_end|>", QWEN_CALL, "Sunny.<|im_end|>"]),
    ("deepseek_v4", ["Hello!<｜end▁of▁sentence｜>", DSML_CALL, "Sunny.<｜end▁of▁sentence｜>"]),
])
def test_enable_thinking_false_trains_replies_without_reasoning(name, trained):
    tokenizer = family_tokenizer(name)
    encoded = encode_chat(tokenizer, MASK_CHAT, tools=TOOLS, enable_thinking=False)
    assert _runs(tokenizer, encoded) == trained
    # The non-thinking generation prompt already closes the (empty) think block, so it is not trained.
    before_last_reply = _runs(tokenizer, encoded, trained=False)[2]
    assert before_last_reply.endswith("<think>\n\n</think>\n\n" if name.startswith("qwen3") else "<｜Assistant｜></think>")


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_generation_prompt_follows_enable_thinking(enable_thinking):
    tokenizer = family_tokenizer("qwen3_5")
    prompt = encode_prompt(tokenizer, CHAT[:2], enable_thinking=enable_thinking)
    assert tokenizer.decode(prompt) == GOLDEN["qwen3_5", "prompt" if enable_thinking else "prompt_no_thinking"]


def test_glm4_reply_ends_with_the_next_role_token_or_an_appended_eos():
    tokenizer = family_tokenizer("glm4")
    encoded = encode_chat(tokenizer, MULTI)
    assert _runs(tokenizer, encoded) == ["\nHello!<|user|>", "\nParis.<|endoftext|>"]
    assert encoded["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(encoded["input_ids"]) == GOLDEN["glm4", "multi"] + "<|endoftext|>"


def test_mistral_moves_the_system_prompt_to_the_last_user_turn():
    tokenizer = family_tokenizer("mistral")
    messages = [{"role": "system", "content": "Be brief."}, *MULTI]
    assert render_chat(tokenizer, messages) == (
        "<s>[INST] Hi[/INST] Hello!</s>[INST] Be brief.\n\nCapital of France?[/INST] Paris.</s>"
    )
    # Rendered alone, the first exchange carries the system prompt, the whole conversation does not.
    assert _runs(tokenizer, encode_chat(tokenizer, messages)) == [" Hello!</s>", " Paris.</s>"]


def test_replies_are_found_after_the_prompt_that_repeats_them():
    tokenizer = family_tokenizer("qwen3_5")
    messages = [
        {"role": "user", "content": "Paris."}, {"role": "assistant", "content": "Paris.", "reasoning_content": "Echo."},
        {"role": "user", "content": "Paris."}, {"role": "assistant", "content": "Paris."},
    ]
    encoded = encode_chat(tokenizer, messages)
    assert _runs(tokenizer, encoded) == ["Paris.<|im_end|>", "\n</think>\n\nParis.<|im_end|>"]
    assert _runs(tokenizer, encoded, trained=False) == [
        "<|im_start|>user\nParis.<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nParis.<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "\n",
    ]


def test_a_template_that_rewrites_earlier_replies_is_rejected():
    tokenizer = copy.deepcopy(family_tokenizer("chatml"))
    tokenizer.chat_template = CHATML_TEMPLATE.replace(
        "message['content']", "(message['content'] | upper if message['role'] == 'assistant' and not loop.last "
                              "else message['content'])")
    with pytest.raises(ChatTemplateError, match=r"renders reply messages\[1\] as 'Hello!<\|im_end\|>' when it ends"):
        encode_chat(tokenizer, MULTI)


@pytest.mark.parametrize(("name", "messages", "kwargs", "error"), [
    ("yi", TOOL_CHAT, {}, r"messages\[1\]: the Yi-1.5 chat format has no tool calls"),
    ("deepseek_r1", TOOL_CHAT, {"tools": TOOLS}, "has no prompt for tool schemas"),
    ("mistral", [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": [{**CALL, "id": "c1"}]}], {},
     "Tool call IDs should be alphanumeric strings with length 9"),
])
def test_formats_a_family_cannot_express_are_refused(name, messages, kwargs, error):
    with pytest.raises(ChatTemplateError, match=error):
        encode_chat(family_tokenizer(name), messages, **kwargs)


def test_family_template_fills_in_for_a_tokenizer_without_one():
    tokenizer = make_tiny_tokenizer(chat_template=None, **LLAMA3)
    assert ensure_chat_template(tokenizer, "llama3") is True
    assert tokenizer.chat_template == get_chat_template("llama3")
    assert _runs(tokenizer, encode_chat(tokenizer, CHAT)) == ["I am Twinkle.<|eot_id|>"]
    assert tokenizer.decode(encode_chat(tokenizer, CHAT)["input_ids"]) == GOLDEN["llama3", "chat"]


def test_own_template_is_kept_and_a_different_one_is_reported(caplog):
    tokenizer = make_tiny_tokenizer(**FAMILY_TOKENIZERS["chatml"])  # ships a plain ChatML template
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        assert ensure_chat_template(tokenizer, "chatml") is True
        assert not caplog.records
        assert ensure_chat_template(tokenizer, "llama3") is False
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert "renders a probe conversation differently from the 'llama3' family template" in caplog.text
    # Both start with the tokenizer's BOS, <|im_start|>; then ChatML writes a role, Llama 3 a header token.
    assert "first difference at character 12: 'system\\nYou are a helpful" in caplog.text
    # A template that cannot render the probe at all is reported the same way.
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        assert ensure_chat_template(tokenizer, "chatml") is False
    assert "cannot render the probe conversation" in caplog.text
