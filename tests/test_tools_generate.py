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
from recurrax.nn.pretrained import from_pretrained, generate, load_tokenizer
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
    from recurrax.nn import pretrained

    calls = []

    class Finished:
        tokens, token_times, finish_reason, text = [], [], "stop", ""

        def __iter__(self):
            return iter(["done"])

    monkeypatch.setattr(pretrained, "stream_text", lambda *args, **options: calls.append((args, options)) or Finished())
    assert cli.main(["generate", directory, "--prompt", "x", "--max-new-tokens", "7", "--temperature", "0.5",
                     "--top-k", "3", "--top-p", "0.5", "--repetition-penalty", "1.3", "--seed", "9", "--stop", "a",
                     "--stop", "b"]) == 0
    (args, options), = calls
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
