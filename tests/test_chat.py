"""Chat inputs: a row's ids are the target tokenizer's own chat template, the same on every path, and bad chat
input is one line naming the file:line or the field.

The fixture template (tests/helpers/chat_template.py) is Qwen3's shape: turns in <|im_start|>role ... <|im_end|>,
and enable_thinking=false closes an empty think block after the generation prompt.
"""

from __future__ import annotations

import json

import pytest
import yaml

from opd.cli import main
from opd.data.prompts import load_prompts, load_tokenizer
from opd.data.render import Rendering
from opd.errors import OpdError
from opd.spec import SpecError, load_spec
from tests.helpers.chat_template import QWEN3_STYLE_TEMPLATE
from tests.helpers.fake_vllm import VLLM_SETS, fake_vllm, fake_vllm_ray  # noqa: F401 (fixtures)

CHAT = Rendering("chat")


@pytest.fixture(scope="module")
def tokenizer(chat_assets):
    return load_tokenizer(chat_assets["target"])


def rows_of(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def expected_ids(tokenizer, row: dict, enable_thinking: bool | None = None) -> list[int]:
    """The reference: HF's apply_chat_template, tokenizing itself, on the row's turns."""
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **extra)


@pytest.mark.parametrize("thinking", [None, True, False])
def test_rendered_ids_equal_apply_chat_template(chat_assets, tokenizer, thinking):
    prompts = load_prompts(chat_assets["train"], tokenizer, max_prompt_tokens=512,
                           rendering=Rendering("chat", thinking)).prompts
    rows = rows_of(chat_assets["train"])
    assert [p.ids for p in prompts] == [expected_ids(tokenizer, r, thinking) for r in rows]


def test_thinking_on_and_off_render_as_qwen3(chat_assets, tokenizer):
    path = chat_assets["train"]
    texts = {t: load_prompts(path, tokenizer, max_prompt_tokens=512, rendering=Rendering("chat", t)).prompts[2].text
             for t in (None, True, False)}
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSum 4 and 4.<|im_end|>\n<|im_start|>assistant\n"
    assert texts[None] == texts[True] == head  # Qwen3 thinks by default: the model opens <think> itself
    assert texts[False] == head + "<think>\n\n</think>\n\n"
    ids = load_prompts(path, tokenizer, max_prompt_tokens=512, rendering=Rendering("chat", False)).prompts[2].ids
    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids.count(special[0]) == 3 and ids.count(special[1]) == 2  # each tag is one token, as in Qwen3
    blank = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert ids[-2 - 2 * len(blank):] == special[2:3] + blank + special[3:4] + blank  # the empty think block


def test_plain_row_under_chat_is_one_user_message_and_raw_stays_raw(chat_assets, tokenizer):
    chat = load_prompts(chat_assets["train"], tokenizer, max_prompt_tokens=512, rendering=CHAT).prompts[0]
    assert chat.text == "<|im_start|>user\nTom has 3 apples. How many?<|im_end|>\n<|im_start|>assistant\n"
    raw_file = chat_assets["root"] + "/plain.jsonl"
    open(raw_file, "w").write(json.dumps({"id": "p0", "prompt": "Tom has 3 apples. How many?"}) + "\n")
    (raw,) = load_prompts(raw_file, tokenizer, max_prompt_tokens=512).prompts
    assert raw.text == "Tom has 3 apples. How many?"
    assert raw.ids == tokenizer("Tom has 3 apples. How many?", add_special_tokens=False)["input_ids"]


BAD_ROWS = {
    "no user turn": ({"id": "b", "messages": [{"role": "system", "content": "hi"}]}, "no user turn"),
    "unknown role": ({"id": "b", "messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    "non-string content": ({"id": "b", "messages": [{"role": "user", "content": 3}]}, "content is not a string"),
    "empty messages": ({"id": "b", "messages": []}, "non-empty list"),
    "turn without role": ({"id": "b", "messages": [{"content": "hi"}]}, "'role' and 'content'"),
    "both forms": ({"id": "b", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "both"),
    "too long": ({"id": "b", "messages": [{"role": "user", "content": "word " * 60}]}, "rendered prompt has"),
    "ends on the answer": ({"id": "b", "messages": [{"role": "user", "content": "1 + 1?"},
                                                    {"role": "assistant", "content": "2"}]},
                           "'messages' ends on the assistant's turn (expected the user's turn last"),
    "empty content": ({"id": "b", "messages": [{"role": "user", "content": " "}]},
                      "messages[0].content is empty (expected non-empty text"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_chat_row_is_one_line_with_file_and_line(tmp_path, tokenizer, case):
    row, message = BAD_ROWS[case]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "1 + 1?"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(OpdError) as err:
        load_prompts(str(path), tokenizer, max_prompt_tokens=64, rendering=CHAT)
    assert f"{path}:2: " in str(err.value) and message in str(err.value) and "\n" not in str(err.value)
    skipped = load_prompts(str(path), tokenizer, max_prompt_tokens=64, rendering=CHAT, skip_bad_lines=True)
    assert [p.id for p in skipped.prompts] == ["a"] and len(skipped.skipped) == 1


def test_rendered_length_counts_the_template(tmp_path, tokenizer):
    """A prompt that fits raw but not once wrapped in the template is refused under chat."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "1 + 1?"}) + "\n")
    raw = len(load_prompts(str(path), tokenizer, max_prompt_tokens=512).prompts[0].ids)
    load_prompts(str(path), tokenizer, max_prompt_tokens=raw)
    with pytest.raises(OpdError, match="more than data.max_prompt_tokens"):
        load_prompts(str(path), tokenizer, max_prompt_tokens=raw, rendering=CHAT)


def test_messages_row_under_raw_names_the_switch(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(OpdError, match=r"p.jsonl:1: .*needs data.render: chat"):
        load_prompts(str(path), tokenizer, max_prompt_tokens=64)


def test_chat_without_a_template_and_a_thinking_switch_that_does_nothing_are_refused(chat_assets, micro_assets,
                                                                                      tmp_path):
    plain = load_tokenizer(micro_assets["target"])  # the micro tokenizer has no chat template
    with pytest.raises(OpdError, match="data.render: chat but the tokenizer has no chat template"):
        load_prompts(chat_assets["train"], plain, max_prompt_tokens=512, rendering=CHAT)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no thinking switch
    load_prompts(chat_assets["train"], plain, max_prompt_tokens=512, rendering=CHAT)
    for thinking in (True, False):
        with pytest.raises(OpdError, match="data.enable_thinking: .* reads no 'enable_thinking'"):
            load_prompts(chat_assets["train"], plain, max_prompt_tokens=512, rendering=Rendering("chat", thinking))


def test_thinking_switch_without_chat_is_a_spec_error(micro_spec_file):
    with pytest.raises(SpecError, match="enable_thinking"):
        load_spec(micro_spec_file, overrides=["data.enable_thinking=false"])
    spec = load_spec(micro_spec_file, overrides=["data.render=chat", "data.enable_thinking=false"])
    assert (spec.data.render, spec.data.enable_thinking) == ("chat", False)


# ------------------------------------------------------------------------------------------------ every path


@pytest.fixture
def chat_spec_file(micro_spec_file, chat_assets, tmp_path):
    spec = yaml.safe_load(micro_spec_file.read_text())
    spec["models"].update(target_path=chat_assets["target"], drafter_path=chat_assets["drafter"])
    spec["data"].update(train_prompts=chat_assets["train"], eval_prompts=chat_assets["heldout"],
                        render="chat", enable_thinking=False, max_prompt_tokens=64)
    spec.update(steps=1)
    spec["rollout"].update(max_new_tokens=4)
    spec["eval"].update(max_new_tokens=3)
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_every_path_feeds_the_target_the_rendered_ids(chat_spec_file, chat_assets, tokenizer, tmp_path,
                                                      fake_vllm, monkeypatch):
    """Rollout, eval, SFT data generation (HF and vLLM) and serve-bench all decode apply_chat_template's ids."""
    from opd.decoding.speculative import SpeculativeDecoder

    train = [expected_ids(tokenizer, r, False) for r in rows_of(chat_assets["train"])]
    heldout = [expected_ids(tokenizer, r, False) for r in rows_of(chat_assets["heldout"])]
    decoded: list[list[list[int]]] = []
    generate = SpeculativeDecoder.generate
    monkeypatch.setattr(SpeculativeDecoder, "generate",
                        lambda self, prompts, *a, **k: decoded.append([list(p) for p in prompts])
                        or generate(self, prompts, *a, **k))

    assert main(["eval", str(chat_spec_file)]) == 0
    assert decoded and all(batch == heldout for batch in decoded)  # every setting decodes all 4, in file order
    decoded.clear()
    assert main(["train", str(chat_spec_file)]) == 0  # engine local, one step: one rollout batch of 2
    assert decoded[0] and all(ids in train for ids in decoded[0])

    sets = [arg for s in VLLM_SETS for arg in ("--set", s)]  # the stand-in vLLM's environment
    for engine in ("hf", "vllm"):
        out = tmp_path / f"sft-{engine}.jsonl"
        assert main(["gen-sft-data", str(chat_spec_file), "--engine", engine, "--out", str(out),
                     "--set", "sft.response_max_new_tokens=2", *sets]) == 0
        assert [json.loads(line)["prompt_ids"] for line in out.read_text().splitlines()] == train
    (llm,) = fake_vllm.made()
    assert [p["prompt_token_ids"] for p in llm.calls[0][0]] == train

    assert main(["serve-bench", str(chat_spec_file), "--draft", chat_assets["drafter"], "--concurrency", "1",
                 "--no-baseline", "--set", "eval.num_prompts=4", *sets]) == 0
    served = fake_vllm.made()[1].served
    assert served and all(ids in heldout for ids in served) and set(map(tuple, heldout)) <= set(map(tuple, served))


def test_validate_prints_the_first_prompt_as_the_target_sees_it(chat_spec_file, capsys):
    assert main(["validate", str(chat_spec_file)]) == 0
    out = capsys.readouterr().out
    assert "data.render: chat" in out and "#   <|im_start|>user\n#   Tom has 3 apples. How many?<|im_end|>\n" in out
    assert out.endswith("#   <|im_start|>assistant\n#   <think>\n#   \n#   </think>\n#   \n#   \n")  # ends "\n\n"
    assert yaml.safe_load(out)["data"]["render"] == "chat"  # the comments keep it a loadable spec


# ------------------------------------------------------------------------------------------------ shipped configs

MODES = {  # config -> (render, enable_thinking, rollout cap, eval cap): the paper's settings
    "qwen3-4b.yaml": ("chat", False, 2048, 2048), "qwen3-8b.yaml": ("chat", False, 2048, 2048),
    "qwen3-4b-thinking.yaml": ("chat", True, 4096, 8192), "qwen3-8b-thinking.yaml": ("chat", True, 4096, 8192),
    "qwen3-30b-a3b.yaml": ("chat", None, 4096, 8192),  # the Thinking checkpoint: its template always thinks
    "tiny.yaml": ("raw", None, None, None),  # the embedded default: trained without a template
}


@pytest.mark.parametrize("name", MODES)
def test_shipped_configs_say_their_mode(name):
    from pathlib import Path

    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / name, check_paths=False)
    render, thinking, rollout_cap, eval_cap = MODES[name]
    assert (spec.data.render, spec.data.enable_thinking) == (render, thinking)
    if rollout_cap:
        assert (spec.rollout.max_new_tokens, spec.sft.response_max_new_tokens) == (rollout_cap, rollout_cap)
        assert spec.eval.max_new_tokens == eval_cap


def test_the_tiny_target_decodes_the_chat_rendered_prompts(tmp_path, monkeypatch):
    """End to end on the shipped tiny target: its tokenizer with the fixture template (no new tokens, so the tags
    are spelled in its byte pieces and the vocabulary still fits the target), `opd eval` under chat."""
    import shutil
    from pathlib import Path

    from opd.decoding.speculative import SpeculativeDecoder

    root = Path(__file__).resolve().parents[1]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "opd/assets/tiny/target" / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_STYLE_TEMPLATE}))
    tokenizer = load_tokenizer(str(tmp_path))
    heldout = [expected_ids(tokenizer, r, False) for r in rows_of(root / "opd/assets/tiny/prompts/heldout.jsonl")[:2]]
    decoded: list[list[list[int]]] = []
    generate = SpeculativeDecoder.generate
    monkeypatch.setattr(SpeculativeDecoder, "generate",
                        lambda self, prompts, *a, **k: decoded.append([list(p) for p in prompts])
                        or generate(self, prompts, *a, **k))
    monkeypatch.chdir(root)
    assert main(["eval", "configs/tiny.yaml", "--set", f"models.tokenizer_path={tmp_path}", "--set", "data.render=chat",
                 "--set", "data.enable_thinking=false", "--set", "eval.num_prompts=2",
                 "--set", "eval.max_new_tokens=4", "--set", "eval.samples_path=null"]) == 0  # decode: no raw samples
    assert decoded and all(batch == heldout for batch in decoded)
    assert tokenizer.decode(heldout[0]).endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
