"""The ``torchsupervisor`` command line: one module per command, clear help, exit statuses."""

from __future__ import annotations

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
