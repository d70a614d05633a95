"""The thinking switch reaches each chat template under the name it reads, as z-lab's benchmark harness maps it
(`dflash.benchmark._reasoning_kwargs`): on/off as `enable_thinking`, an effort level as `reasoning_strength` where
the template reads it, else `reasoning_effort` (gpt-oss); a template that reads none of them refuses the setting in
one line (issue 42, Build 6). The templates are small ones written here, on the micro tokenizer."""

from __future__ import annotations

import pytest
import yaml

from opd.cli import main
from opd.data.prompts import load_prompts, load_tokenizer
from opd.data.render import Rendering, render
from opd.errors import OpdError
from tests.helpers.chat_template import QWEN3_STYLE_TEMPLATE

TURNS = "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
# gpt-oss's harmony template states the effort in its system message, medium unless told
EFFORT_TEMPLATE = ("{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\\n' }}"
                   + TURNS + "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}")
STRENGTH_TEMPLATE = EFFORT_TEMPLATE.replace("reasoning_effort", "reasoning_strength").replace("Reasoning", "Strength")
PLAIN_TEMPLATE = TURNS + "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}"


@pytest.fixture
def tokenizer(micro_assets):
    return load_tokenizer(micro_assets["target"])


def text(tokenizer, template: str, rendering: Rendering) -> str:
    tokenizer.chat_template = template
    return render("2 + 2?", None, tokenizer, rendering).text


def test_an_effort_level_reaches_the_template_under_the_name_it_reads(tokenizer):
    assert text(tokenizer, EFFORT_TEMPLATE, Rendering("chat")).startswith("Reasoning: medium")
    assert text(tokenizer, EFFORT_TEMPLATE, Rendering("chat", reasoning_effort="high")).startswith("Reasoning: high")
    assert text(tokenizer, STRENGTH_TEMPLATE, Rendering("chat", reasoning_effort="low")).startswith("Strength: low")


def test_on_off_reaches_a_template_that_reads_enable_thinking(tokenizer):
    off = text(tokenizer, QWEN3_STYLE_TEMPLATE, Rendering("chat", enable_thinking=False))
    assert off.endswith("<think>\n\n</think>\n\n")
    assert not text(tokenizer, QWEN3_STYLE_TEMPLATE, Rendering("chat", enable_thinking=True)).endswith("</think>\n\n")


@pytest.mark.parametrize(("template", "rendering", "message"), [
    (EFFORT_TEMPLATE, Rendering("chat", enable_thinking=True),
     r"data.enable_thinking: true but .* reads no 'enable_thinking' \(it reads 'reasoning_effort': set "
     r"data.reasoning_effort instead\)"),
    (QWEN3_STYLE_TEMPLATE, Rendering("chat", reasoning_effort="high"),
     r"data.reasoning_effort: high but .* reads neither .* \(it reads 'enable_thinking': set data.enable_thinking"),
    (PLAIN_TEMPLATE, Rendering("chat", reasoning_effort="low"), r"data.reasoning_effort: low .*no reasoning switch"),
    (PLAIN_TEMPLATE, Rendering("chat", enable_thinking=False), r"data.enable_thinking: false .*no thinking switch"),
])
def test_a_template_that_reads_no_such_switch_refuses_it_in_one_line(tokenizer, micro_assets, template, rendering,
                                                                     message):
    tokenizer.chat_template = template
    with pytest.raises(OpdError, match=message) as err:
        load_prompts(micro_assets["train"], tokenizer, max_prompt_tokens=512, rendering=rendering)
    assert "\n" not in str(err.value)


def test_opd_validate_refuses_an_effort_the_targets_template_ignores_and_an_effort_without_chat(
        chat_assets, micro_spec_file, tmp_path, capsys):
    spec = yaml.safe_load(micro_spec_file.read_text())
    spec["models"] |= {"target_path": chat_assets["target"], "drafter_path": chat_assets["drafter"]}
    spec["data"] |= {"train_prompts": chat_assets["train"], "eval_prompts": chat_assets["heldout"], "render": "chat"}
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--set", "data.reasoning_effort=high"]) == 2
    assert "data.reasoning_effort: high but the tokenizer's chat template reads neither" in capsys.readouterr().err
    assert main(["validate", str(micro_spec_file), "--set", "data.reasoning_effort=high"]) == 2
    assert "reasoning_effort: high but render is raw" in capsys.readouterr().err
