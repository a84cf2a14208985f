"""`ffkv --version`, a description and help text on every subcommand and option, every subcommand in the README."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import ffkv
from ffkv.cli import build_parser, main

README = Path(__file__).resolve().parents[2] / "README.md"


def parsers(parser: argparse.ArgumentParser, name: str = "ffkv"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from parsers(p, f"{name} {sub}")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"ffkv {ffkv.__version__}"


def test_every_subcommand_and_option_has_help():
    missing = []
    for name, parser in parsers(build_parser()):
        if name != "ffkv" and not parser.description:
            missing.append(f"{name}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{name} {a.dest}: no help" for a in action._choices_actions if not a.help]
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: no help")
    assert not missing, missing


def test_every_subcommand_is_in_the_readme_table():
    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    commands = [name.split()[1] for name, _ in parsers(build_parser()) if len(name.split()) == 2]
    assert len(commands) >= 8
    for command in commands:
        assert re.search(rf"`ffkv {command}\b", table), command
    assert "`ffkv --version`" in table
