"""The chat template the chat tests render with."""

# A Qwen3-style chat template, written for the tests: turns wrapped in <|im_start|>role ... <|im_end|>, and
# enable_thinking=false closes an empty think block right after the generation prompt, as Qwen3's does.
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
