"""Tests for engine.chat_template: in-memory templates (fast) plus the real SmolLM2 / Gemma 3 files."""
import logging
import os
from pathlib import Path

import pytest
from gguf import GGUFReader

from engine.chat_template import CHATML_TEMPLATE, ChatTemplate
from engine.tokenizer import Tokenizer

# SmolLM2-135M-Instruct's template as stored in its GGUF (ChatML with a default system prompt).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Hi \n"},
    {"role": "assistant", "content": "Hey!"},
    {"role": "user", "content": "Bye"},
]


def fields(template: str | None = None, add_bos: bool | None = None) -> dict:
    """Minimal GGUF metadata: Gemma-like special token ids (<eos>=1, <bos>=2)."""
    f = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"],
         "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    if template is not None:
        f["tokenizer.chat_template"] = template
    if add_bos is not None:
        f["tokenizer.ggml.add_bos_token"] = add_bos
    return f


def render_with(template: str, messages=None, **kwargs) -> str:
    return ChatTemplate(template, "test").render(messages or [{"role": "user", "content": "x"}], **kwargs)


def test_gguf_template_is_used():
    tmpl = ChatTemplate.from_gguf_fields(fields(SMOLLM2_TEMPLATE), "llama")
    assert tmpl.source == "gguf"
    assert tmpl.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_add_generation_prompt_false_omits_assistant_header():
    tmpl = ChatTemplate(CHATML_TEMPLATE, "test")
    assert tmpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")


def test_missing_template_falls_back_to_chatml_and_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="strata.template"):
        tmpl = ChatTemplate.from_gguf_fields(fields(), "qwen2")
    assert tmpl.source == "fallback:chatml"
    assert [r.name for r in caplog.records] == ["strata.template"]
    assert tmpl.render([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")


def test_gemma3_fallback_folds_system_into_first_user_turn():
    tmpl = ChatTemplate.from_gguf_fields(fields(add_bos=False), "gemma3")
    assert tmpl.source == "fallback:gemma"
    assert tmpl.render(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHey!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_leading_bos_removed_when_tokenizer_adds_it():
    tmpl = ChatTemplate.from_gguf_fields(fields(add_bos=True), "gemma3")  # as llama.cpp's common/chat.cpp
    assert tmpl.render([{"role": "user", "content": "Hi"}]).startswith("<start_of_turn>user\nHi")


def test_gemma_fallback_rejects_non_alternating_roles():
    tmpl = ChatTemplate.from_gguf_fields(fields(), "gemma3")
    with pytest.raises(ValueError, match="alternate"):
        tmpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_override_file_wins(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    tmpl = ChatTemplate.from_gguf_fields(fields(SMOLLM2_TEMPLATE), "llama", override_path=str(path))
    assert tmpl.source == f"file:{path}"
    assert tmpl.render([{"role": "user", "content": "Hi"}]) == "Hi!"


def test_tools_passed_only_when_given():
    template = "{{ 'tools:' ~ (tools | length) if tools is defined else 'none' }}"
    assert render_with(template) == "none"
    assert render_with(template, tools=[{"type": "function"}]) == "tools:1"


def test_tojson_keeps_non_ascii_and_supports_indent():
    assert render_with("{{ {'a': 'é<'} | tojson }}") == '{"a": "é<"}'
    assert render_with("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"


def test_raise_exception_becomes_value_error():
    with pytest.raises(ValueError, match="nope"):
        render_with("{{ raise_exception('nope') }}")


def test_runtime_error_becomes_value_error():
    with pytest.raises(ValueError):
        render_with("{{ messages[0]['content'] + none }}")


def test_syntax_error_becomes_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", "test")


def test_content_parts_are_flattened():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                             {"type": "text", "text": "b"}]}]
    assert render_with("{{ messages[0]['content'] }}", messages) == "a\nb"
    assert isinstance(messages[0]["content"], list)  # the caller's message is not modified


def test_strftime_now_available():
    assert len(render_with("{{ strftime_now('%Y') }}")) == 4


def test_generation_tag_and_loop_controls():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    assert render_with(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_extra_variables_reach_the_template():
    assert render_with("{{ 'think' if enable_thinking else 'plain' }}", enable_thinking=True) == "think"


def test_trim_and_lstrip_blocks():
    assert render_with("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB"


@pytest.mark.reference
def test_matches_transformers_rendering():
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = ChatTemplate.from_gguf_fields(fields(SMOLLM2_TEMPLATE, add_bos=False), "llama").render(CONVERSATION)
    (theirs,), _ = render_jinja_template(conversations=[CONVERSATION], chat_template=SMOLLM2_TEMPLATE,
                                         add_generation_prompt=True)
    assert ours == theirs


def _model_file(key: str, name: str) -> Path:
    """$STRATA_TEST_<key> if set, else the strata model cache (<STRATA_HOME or ~/.cache/strata>/models)."""
    env, home = f"STRATA_TEST_{key}", Path(os.environ.get("STRATA_HOME") or Path.home() / ".cache" / "strata")
    path = Path(os.environ[env]) if os.environ.get(env) else home / "models" / name
    if not path.is_file():
        pytest.skip(f"{name} not available (set {env})")
    return path


def _gguf_fields(path: Path) -> dict:
    fields = GGUFReader(str(path)).fields
    return {k: f.contents() for k, f in fields.items() if k.startswith(("tokenizer.", "general.architecture"))}


@pytest.mark.slow
def test_smollm2_file_template_renders_one_im_start_per_turn():
    meta = _gguf_fields(_model_file("SMOLLM2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tmpl = ChatTemplate.from_gguf_fields(meta, meta["general.architecture"])
    ids = Tokenizer.from_gguf_fields(meta).encode(tmpl.render([{"role": "user", "content": "Hi"}]))
    assert tmpl.source == "gguf"
    assert ids[0] == 1 and ids.count(1) == 3  # default system turn, user turn, assistant header


@pytest.mark.slow
def test_gemma3_file_uses_fallback_and_tokenizes_with_one_bos():
    meta = _gguf_fields(_model_file("GEMMA3", "gemma-3-270m-q4_k_m.gguf"))
    tmpl = ChatTemplate.from_gguf_fields(meta, meta["general.architecture"])
    ids = Tokenizer.from_gguf_fields(meta).encode(tmpl.render([{"role": "user", "content": "Hi"}]))
    assert tmpl.source == "fallback:gemma"
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1  # <bos> <start_of_turn> user
