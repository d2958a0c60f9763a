"""The ``torchsupervisor`` command line: one module per command, clear help, exit statuses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchsupervisor.cli import build_parser, main

COMMANDS = ["ls", "inspect", "verify", "events", "export"]


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ["demo", *COMMANDS]:
        assert f"    {command} " in out
    assert main([]) == 2  # no command: the help, and a usage status
    assert "usage: torchsupervisor" in capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_a_clear_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: torchsupervisor {command} ")
    assert "examples:" in out and f"torchsupervisor {command} runs/exp" in out
    assert "``" not in out  # the module docstrings are shown without their markup


def test_unknown_command_and_missing_argument(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["lsx"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'lsx'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "only-one-argument"])
    assert exit_info.value.code == 2


def test_demo_keeps_its_own_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: torchsupervisor demo" in out and "--max-steps" in out


def test_parser_is_built_from_the_command_modules():
    parser = build_parser()
    args = parser.parse_args(["verify", "runs/exp", "--all"])
    assert (args.command, args.logdir, args.all) == ("verify", "runs/exp", True)


def test_demo_help_gives_every_option_a_help_text_and_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    options = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert "--logdir" in options and "--save-model-secs" in options
    # Every option but --help shows "(default: ...)" after a help text.
    blocks = out.split("\n  --")[1:]
    assert len(blocks) == len(options)
    for block in blocks:
        assert "(default: " in block, block
    assert "``" not in out


def test_the_demo_without_scikit_learn_says_what_to_install(tmp_path):
    # As after `pip install torchsupervisor` without the [demo] extra.
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "from torchsupervisor.cli import main\n"
        f"sys.exit(main(['demo', '--logdir', {str(tmp_path / 'run')!r}, '--max-steps', '3']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("torchsupervisor demo: error: ")
    assert 'pip install "torchsupervisor[demo]"' in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("from_the_file", [True, False], ids=["its data file", "load_digits"])
def test_the_demo_reads_the_digits_load_digits_gives(monkeypatch, from_the_file):
    """The digits come from scikit-learn's data file without importing scikit-learn, or
    through ``load_digits`` where a release keeps the file elsewhere: the same arrays."""
    import numpy as np
    from sklearn.datasets import load_digits

    from torchsupervisor.demo import digits

    if not from_the_file:
        monkeypatch.setattr(digits.os.path, "isfile", lambda path: False)
    images, labels = digits.load_digits_arrays()
    expected = load_digits()
    assert images.dtype == expected.images.dtype and labels.dtype == np.int64
    assert np.array_equal(images, expected.images) and np.array_equal(labels, expected.target)


def test_the_demo_on_a_missing_bucket_says_so_in_one_line(s3_server):
    # A 30-line traceback, where `torchsupervisor ls` said it in one line.
    env = {**os.environ, **s3_server.env}
    demo = [sys.executable, "-m", "torchsupervisor", "demo", "--logdir", "s3://no-such-bucket/r"]
    proc = subprocess.run(demo, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("torchsupervisor demo: error: ")
    assert "the bucket 'no-such-bucket' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
