"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from pipellm.shared.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from pipellm.shared.demo_model import CHAT_TEMPLATE
from pipellm.shared.tokenizer import load_tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (  # Mistral / Llama-2 style: alternating roles enforced with raise_exception
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
# Multi-line, indented: exercises trim_blocks/lstrip_blocks, namespace, loop controls, tojson
# (no HTML escaping, options), strftime_now, and keys dropped when None.
FANCY = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ message['role'] }}: {{ message['content'] | tojson }}
    {% if message.tool_calls is defined %}
        calls={{ message.tool_calls | tojson(indent=2, sort_keys=True) }}
    {% endif %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
{% endfor %}
year={{ strftime_now('%Y') }} tools={{ tools is none }}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi <b>é</b> 🎉"},
     {"role": "assistant", "content": "Hello, \"friend\".\n"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c\nd"}],
]


def hf_render(tokenizer_file: Path, template: str, messages, add_generation_prompt: bool,
              bos="<s>", eos="</s>") -> str:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file),
                                               bos_token=bos, eos_token=eos)
    return tok.apply_chat_template(messages, tokenize=False, chat_template=template,
                                   add_generation_prompt=add_generation_prompt)


def write_config(path: Path, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_demo_template_matches_transformers(demo_model_dir, conv, gen):
    ct = load_chat_template(demo_model_dir)
    assert ct is not None and ct.source == CHAT_TEMPLATE
    assert (ct.bos_token, ct.eos_token) == ("<s>", "</s>")
    messages = CONVERSATIONS[conv]
    want = hf_render(demo_model_dir / "tokenizer.json", CHAT_TEMPLATE, messages, gen)
    got = ct.render(messages, add_generation_prompt=gen)
    assert got == want
    assert got.startswith("<s>") and got.endswith("<s>assistant\n" if gen else "</s>\n")
    auto = transformers.AutoTokenizer.from_pretrained(demo_model_dir)  # the saved config too
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == got


@pytest.mark.parametrize("name,template,bos,eos", [
    ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    ("qwen2", QWEN2, None, "<|im_end|>"),
    ("mistral", MISTRAL, "<s>", "</s>"),
    ("fancy", FANCY, "<s>", "</s>"),
])
@pytest.mark.parametrize("gen", [True, False])
def test_real_world_templates_match_transformers(tmp_path, demo_model_dir, name, template, bos,
                                                 eos, gen):
    bos_entry = None if bos is None else {"content": bos, "special": True}  # AddedToken-like
    ct = load_chat_template(write_config(tmp_path / name, chat_template=template,
                                         bos_token=bos_entry, eos_token=eos))
    assert ct is not None and (ct.bos_token, ct.eos_token) == (bos, eos)
    convs = CONVERSATIONS if name != "mistral" else [CONVERSATIONS[0], CONVERSATIONS[2]]
    for messages in convs:
        want = hf_render(demo_model_dir / "tokenizer.json", template, messages, gen, bos, eos)
        assert ct.render(messages, add_generation_prompt=gen) == want


def test_none_valued_keys_are_dropped_like_transformers(tmp_path, demo_model_dir):
    ct = load_chat_template(write_config(tmp_path, chat_template=FANCY, bos_token="<s>"))
    messages = [{"role": "user", "content": "x", "tool_calls": None},
                {"role": "assistant", "content": "y", "tool_calls": [{"name": "f", "id": 1}]}]
    got = ct.render(messages)
    assert got == hf_render(demo_model_dir / "tokenizer.json", FANCY, messages, True)
    assert got.count("calls=") == 1 and "null" not in got
    assert messages[0]["tool_calls"] is None  # the caller's messages are not modified


def test_raise_exception_becomes_chat_template_error(tmp_path, demo_model_dir):
    ct = load_chat_template(write_config(tmp_path, chat_template=MISTRAL))
    bad_order = [{"role": "assistant", "content": "first"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ct.render(bad_order)
    with pytest.raises(ChatTemplateError, match="Only user and assistant"):
        ct.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    demo = load_chat_template(demo_model_dir)
    with pytest.raises(ChatTemplateError, match="Unsupported role: tool") as err:
        demo.render([{"role": "tool", "content": "42"}])
    assert isinstance(err.value, ValueError)  # the gateway maps ValueError to a 400


def test_missing_template_is_none(tmp_path):
    assert load_chat_template(tmp_path) is None  # no tokenizer_config.json at all
    assert load_chat_template(write_config(tmp_path / "plain", bos_token="<s>")) is None
    assert load_chat_template(write_config(tmp_path / "null", chat_template=None)) is None


def test_broken_templates_raise_chat_template_error(tmp_path):
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        load_chat_template(write_config(tmp_path / "syntax", chat_template="{% for m in x %}"))
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        (tmp_path / "json").mkdir()
        (tmp_path / "json" / "tokenizer_config.json").write_text("{broken")
        load_chat_template(tmp_path / "json")
    with pytest.raises(ChatTemplateError, match="string or a list"):
        load_chat_template(write_config(tmp_path / "type", chat_template=42))
    runtime = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError):
        runtime.render([{"role": "user", "content": "text"}])
    undefined = ChatTemplate("{{ messages[0].content.missing.deeper }}")
    with pytest.raises(ChatTemplateError, match="chat template error"):
        undefined.render([{"role": "user", "content": "text"}])
    ok = ChatTemplate(QWEN2)
    for bad in ([], "hello", [["role", "user"]]):
        with pytest.raises(ChatTemplateError):
            ok.render(bad)


def test_sandbox_blocks_unsafe_access():
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError):
        sneaky.render([{"role": "user", "content": "x"}])


def test_list_of_named_templates_takes_default(tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS {{ messages | length }}"},
                 {"name": "default", "template": "DEFAULT {{ messages | length }}"}]
    ct = load_chat_template(write_config(tmp_path / "list", chat_template=templates))
    assert ct.render([{"role": "user", "content": "x"}]) == "DEFAULT 1"
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        load_chat_template(write_config(tmp_path / "nodefault", chat_template=templates[:1]))


def test_chat_template_jinja_file_wins(tmp_path, demo_model_dir):
    root = write_config(tmp_path, chat_template="FROM CONFIG", bos_token="<|begin_of_text|>",
                        eos_token={"content": "<|eot_id|>"})
    (root / "chat_template.jinja").write_text(LLAMA3, encoding="utf-8")
    ct = load_chat_template(root)
    messages = CONVERSATIONS[1]
    want = hf_render(demo_model_dir / "tokenizer.json", LLAMA3, messages, True,
                     "<|begin_of_text|>", "<|eot_id|>")
    assert ct.render(messages) == want and want.startswith("<|begin_of_text|>")
    only_file = tmp_path / "only-file"
    only_file.mkdir()
    (only_file / "chat_template.jinja").write_text(QWEN2, encoding="utf-8")
    assert load_chat_template(only_file).render(messages, False).endswith("Bye<|im_end|>\n")


def test_encoding_adds_no_second_bos(demo_model_dir):
    ct = load_chat_template(demo_model_dir)
    assert ct.add_special_tokens is False
    messages = CONVERSATIONS[1]
    ids = ct.encode(load_tokenizer(demo_model_dir), messages)
    auto = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    assert ids == auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           return_dict=False)
    assert ids[:2] != [1, 1] and ids.count(1) == len(messages) + 1  # one <s> per turn, no extra


def test_developer_messages_are_system_messages_unless_the_template_knows_them(
        tmp_path, demo_model_dir):
    """OpenAI's `developer` role is its newer name for `system` (llama.cpp maps it so too)."""
    demo = load_chat_template(demo_model_dir)
    as_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    as_developer = [{"role": "developer", "content": "be brief"}, as_system[1]]
    assert demo.render(as_developer) == demo.render(as_system)
    knows = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{# developer #}"
    ct = load_chat_template(write_config(tmp_path, chat_template=knows))
    assert ct.render(as_developer).startswith("[developer]be brief")


def test_template_kwargs_and_continue_final_message_as_transformers(tmp_path, demo_model_dir):
    """vLLM's chat_template_kwargs are template variables; continue_final_message ends the
    prompt inside the last message (transformers' apply_chat_template does the same)."""
    from transformers import PreTrainedTokenizerFast

    thinking = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                "{% endfor %}{% if add_generation_prompt %}<assistant>"
                "{% if enable_thinking is false %}<think></think>{% endif %}{% endif %}")
    ct = load_chat_template(write_config(tmp_path, chat_template=thinking))
    chat = [{"role": "user", "content": "hi"}]
    assert ct.render(chat).endswith("<assistant>")
    assert ct.render(chat, extra={"enable_thinking": False}).endswith("<think></think>")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(demo_model_dir / "tokenizer.json"))
    hf.chat_template = thinking
    partial = chat + [{"role": "assistant", "content": "The answer is "}]
    want = hf.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert ct.render(partial, False, continue_final=True) == want
    assert want.endswith("<assistant>The answer is ")
    with pytest.raises(ChatTemplateError):
        ct.render(chat + [{"role": "assistant", "content": ""}], False, continue_final=True)
