"""`recurrax generate` as users run it: a real subprocess on a tiny checkpoint directory built
here, its stdout equal to the Python API's offline greedy `generate` decoded; `--chat` with a
conversation on stdin; bad input ending with a message, not a traceback."""

import io
import json
import os
import subprocess
import sys

import pytest

from _tiny_checkpoint import write_checkpoint
from recurrax.nn.pretrained import GenerationSession, from_pretrained, generate, load_tokenizer
from recurrax.tools import cli

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    write_checkpoint(path)
    return path


def offline_text(directory, ids, max_new_tokens, **sampling):
    """The Python API's result: `generate`'s tokens, stopped at an end-of-sequence id, decoded."""
    tokenizer = load_tokenizer(directory)
    tokens = generate(from_pretrained(directory), [ids], max_new_tokens, stop_tokens=tokenizer.eos_token_ids,
                      **sampling)[0]
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


def test_prompt_in_a_subprocess_streams_the_greedy_continuation(directory):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "recurrax.tools.cli", "generate", directory, "--prompt",
                          "Once upon a time", "--max-new-tokens", "16"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    ids = load_tokenizer(directory).encode("Once upon a time")
    assert run.stdout == offline_text(directory, ids, 16) + "\n"
    assert "loaded" in run.stderr and "tokens/s" in run.stderr


def test_chat_reads_a_conversation_from_stdin(directory, monkeypatch, capsys):
    messages = [{"role": "user", "content": "Hi! 你好"}]
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(messages)))
    assert cli.main(["generate", directory, "--chat", "--system", "Be brief.", "--max-new-tokens", "12",
                     "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "5"]) == 0
    out = capsys.readouterr()
    ids = load_tokenizer(directory).apply_chat_template([{"role": "system", "content": "Be brief."}, *messages],
                                                        tokenize=True)
    assert out.out == offline_text(directory, ids, 12, temperature=0.8, top_k=50, top_p=0.9, seed=5) + "\n"
    assert "tokens/s" in out.err


def test_every_sampling_option_reaches_stream_text(directory, monkeypatch, capsys):
    from recurrax import generation

    calls = []

    class Finished:
        tokens, token_times, finish_reason, text = [], [], "stop", ""

        def __iter__(self):
            return iter(["done"])

    monkeypatch.setattr(generation, "stream_text", lambda *args, **options: calls.append((args, options)) or Finished())
    assert cli.main(["generate", directory, "--prompt", "x", "--max-new-tokens", "7", "--temperature", "0.5",
                     "--top-k", "3", "--top-p", "0.5", "--repetition-penalty", "1.3", "--seed", "9", "--stop", "a",
                     "--stop", "b"]) == 0
    (args, options), = calls
    assert isinstance(options.pop("session"), GenerationSession)
    assert args[2:] == ("x", 7) and options == dict(temperature=0.5, top_k=3, top_p=0.5, repetition_penalty=1.3,
                                                    seed=9, stop=["a", "b"])
    assert capsys.readouterr().out == "done\n"


def test_missing_tokenizer_is_a_message(tmp_path, capsys):
    assert cli.main(["generate", str(tmp_path), "--prompt", "x"]) == 1
    assert "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--temperature", "-1"], ["--top-p", "0"], ["--top-k", "0"],
                                    ["--repetition-penalty", "0"], ["--system", "without --chat"]])
def test_bad_options_are_usage_errors(directory, option, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["generate", directory, "--prompt", "x", *option])
    assert exit.value.code == 2 and option[0] in capsys.readouterr().err


def test_readme_commands_parse():
    """Every `recurrax generate` line of the README's "Chat with a checkpoint" names its
    fixture directory and only options the command has."""
    import pathlib
    import shlex

    from recurrax.tools.generate import parse_args

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Chat with a checkpoint"):]
    section = section[: section.index("\n## ")]
    lines = [line.split("recurrax generate", 1)[1].split("  #")[0] for line in section.splitlines()
             if "recurrax generate " in line and not line.startswith("`")]
    assert len(lines) >= 4
    for line in lines:
        args = parse_args(shlex.split(line))
        assert os.path.isdir(pathlib.Path(__file__).parents[1] / args.model)


def chat_at_a_terminal(directory, lines, monkeypatch, capsys, *options):
    """`recurrax generate DIR --chat` at a (pretend) terminal typing `lines`: stdout's replies
    and the prompt tokens each turn prefilled (from stderr)."""
    import re

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    typed = iter(lines + [""])
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    assert cli.main(["generate", directory, "--chat", "--max-new-tokens", "6", *options]) == 0
    out = capsys.readouterr()
    return out.out.split("\n")[:-1], [int(n) for n in re.findall(r"; (\d+) prompt tokens prefilled", out.err)]


def reply_tokens(directory, ids):
    """Offline: `generate`'s greedy tokens for `ids` and their text (up to an eos id)."""
    tokenizer = load_tokenizer(directory)
    tokens = generate(from_pretrained(directory), [ids], 6, stop_tokens=tokenizer.eos_token_ids)[0]
    return tokens, tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


def test_a_chat_turn_prefills_only_its_new_tokens(directory, monkeypatch, capsys):
    """Turn 2 of a ChatML chat (a template that only appends) continues turn 1's state: its
    ids are turn 1's prompt, the reply's tokens as generated and the new markup and message;
    they spell the template's rendering of the whole conversation, its reply is `generate`'s
    for them, and it prefills them less what turn 1 fed (its prompt and reply but the last
    token, which was sampled, not fed)."""
    tokenizer = load_tokenizer(directory)
    replies, prefilled = chat_at_a_terminal(directory, ["Hi! 你好", "And then?"], monkeypatch, capsys)
    first = tokenizer.apply_chat_template([{"role": "user", "content": "Hi! 你好"}], tokenize=True)
    tokens, text = reply_tokens(directory, first)
    assert replies[0] == text
    spoken = [t for t in tokens if t not in tokenizer.eos_token_ids]
    markup = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    second = first + spoken + tokenizer.encode(markup, add_special_tokens=False)
    conversation = [{"role": "user", "content": "Hi! 你好"}, {"role": "assistant", "content": text},
                    {"role": "user", "content": "And then?"}]
    assert tokenizer.decode(second, skip_special_tokens=False) == tokenizer.apply_chat_template(conversation)
    assert replies[1] == reply_tokens(directory, second)[1]
    assert prefilled == [len(first), len(second) - len(first) - len(tokens) + 1]


def test_a_template_that_rewrites_earlier_text_prefills_the_whole_conversation(directory, tmp_path, monkeypatch,
                                                                               capsys):
    """A template whose first line counts the messages: turn 2's rendering does not start with
    turn 1's, so turn 2 is the rendering encoded whole, prefilled whole, and its reply is
    `generate`'s for it."""
    import shutil

    from _tiny_checkpoint import CHATML

    counting = str(tmp_path / "counting")
    shutil.copytree(directory, counting)
    with open(os.path.join(counting, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = "{{ messages | length }} messages\n" + CHATML
    with open(os.path.join(counting, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    tokenizer = load_tokenizer(counting)
    replies, prefilled = chat_at_a_terminal(counting, ["Hi!", "And then?"], monkeypatch, capsys)
    conversation = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": replies[0]},
                    {"role": "user", "content": "And then?"}]
    second = tokenizer.apply_chat_template(conversation, tokenize=True)
    assert replies[1] == reply_tokens(counting, second)[1]
    assert prefilled[1] == len(second)


def test_a_missing_package_is_one_line_naming_what_to_install(directory, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert cli.main(["generate", directory, "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'recurrax[pretrained]'" in err and "Traceback" not in err


@pytest.mark.parametrize("broken", ["weights", "template"])
def test_a_broken_checkpoint_is_one_line_not_a_traceback(directory, tmp_path, broken, capsys):
    """Corrupt model.safetensors; a chat template that does not parse (with --chat)."""
    import shutil

    path = str(tmp_path / "broken")
    shutil.copytree(directory, path)
    if broken == "weights":
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"not a safetensors file")
    else:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|im_end|>", "chat_template": "{% for %}"}, f)
    assert cli.main(["generate", path, "--prompt", "x", *(["--chat"] if broken == "template" else [])]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("recurrax generate: ") and len([line for line in err if "loaded" not in line]) == 1
    assert ("SafetensorError" if broken == "weights" else "TemplateSyntaxError") in err[-1]
