"""The chat template of the project's tiny models: ChatML turns with Hermes/Qwen-style tool calls.

    <|im_start|>system\n...tools as JSON lines in <tools></tools>...<|im_end|>\n
    <|im_start|>assistant\n{content}<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n

Everything the model writes itself (content, tool calls, the closing <|im_end|>) sits inside trl's
`{% generation %}` block, so `return_assistant_tokens_mask=True` marks exactly the model's own tokens;
the "<|im_start|>assistant\n" header is the generation prompt, i.e. part of the prompt.
Tool-call arguments may be a JSON object or the raw string the model wrote (harness trajectories).
"""

from __future__ import annotations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [IM_START, IM_END, "<|endoftext|>", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_response>",
                  "</tool_response>", "<tools>", "</tools>"]

TOOLS_PREAMBLE = ("\n\n# Tools\n\nYou may call one or more functions. Their signatures are in <tools></tools>:\n"
                  "<tools>\n")
TOOLS_SUFFIX = ("</tools>\n\nFor each call, return a JSON object with the function name and arguments in "
                "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- (tool.function if tool.function is defined else tool) | tojson }}{{- '\\n' }}"
    "{%- endfor %}"
    "{{- " + repr(TOOLS_SUFFIX) + " }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
