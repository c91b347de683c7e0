"""`render_chat` against `transformers`' own rendering (committed fixtures, see
tests/fixtures/chat_templates/make_fixtures.py): a real Qwen3 template (tools, reasoning,
namespaces), Zephyr's (trim_blocks / lstrip_blocks), Mistral's (raise_exception), and one
that exercises the extras."""

import copy
import json
import os
from datetime import datetime

import jinja2
import pytest

from recurrax.nn.pretrained import render_chat

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
with open(os.path.join(HERE, "expected.json"), encoding="utf-8") as f:
    CASES = json.load(f)
OPTIONS = ("add_generation_prompt", "tools", "date_string")


def template(name: str) -> str:
    with open(os.path.join(HERE, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("case", CASES, ids=[f"{c['template']}-{c['case']}" for c in CASES])
def test_renders_as_transformers(case):
    messages = case["messages"]
    before = copy.deepcopy(messages)
    options = {name: case[name] for name in OPTIONS if name in case}
    if "error" in case:
        with pytest.raises(jinja2.TemplateError, match=case["message"].replace(".", r"\.")):
            render_chat(template(case["template"]), messages, **options, **case["special_tokens"])
    else:
        assert render_chat(template(case["template"]), messages, **options, **case["special_tokens"]) == case["text"]
    assert messages == before  # the caller's messages are not changed (aliases are added to copies)


def test_strftime_now_is_the_local_time():
    years = {str(datetime.now().year)}
    rendered = render_chat("{{ strftime_now('%Y') }}", [])
    years.add(str(datetime.now().year))  # a new year between the two reads
    assert rendered in years


def test_template_runs_in_the_immutable_sandbox():
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])
    assert render_chat("{{ messages.__class__ }}", []) == ""  # internals are undefined


def test_a_message_must_be_a_dict():
    with pytest.raises(TypeError, match=r"messages\[1\]"):
        render_chat("", [{"role": "user", "content": "x"}, "hello"])
