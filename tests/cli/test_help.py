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


def test_help_cites_what_ships_not_the_internal_spec():
    """No help text cites "SPEC" (not shipped); definitions are in docs/definitions.md, which is."""
    cited = [name for name, parser in parsers(build_parser()) if "SPEC" in parser.format_help()]
    assert cited == []
    assert "docs/definitions.md" in build_parser().format_help() + "".join(
        p.format_help() for _, p in parsers(build_parser()))
    assert (README.parent / "docs" / "definitions.md").is_file()


def test_an_unknown_option_is_refused_by_its_command_with_the_nearest_option(capsys):
    """`ffkv index ... --top_k 5`: one line naming the index command, "did you mean --top-k?", and where its options
    are listed (not a usage block first)."""
    for argv, command, near in ((["index", "--corpus", "c", "--out", "o", "--top_k", "5"], "ffkv index", "--top-k"),
                                (["annotate", "export", "r", "--out", "x", "--keys_per_layer", "3"],
                                 "ffkv annotate export", "--keys-per-layer"),
                                (["serve", "r", "--prot", "80"], "ffkv serve", "--port")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.strip() == (f"{command}: error: unrecognized arguments: {' '.join(argv[-2:])} (did you mean {near}?) "
                               f"(options: `{command} --help`)")
    with pytest.raises(SystemExit):
        main(["serve", "r", "--zzzz"])
    assert "did you mean" not in capsys.readouterr().err  # nothing near: no guess


@pytest.mark.parametrize("argv, said", [
    (["idnex"], "ffkv: error: 'idnex' is not a command of ffkv (did you mean index?); the commands: index, "),
    (["annotate", "exprot"], "ffkv annotate: error: 'exprot' is not a command of ffkv annotate (did you mean export?)"),
    (["index", "--corpus", "c", "--out", "o", "--top-k", "0"],
     "ffkv index: error: argument --top-k: expected a positive integer, got '0' (options: `ffkv index --help`)"),
])
def test_a_mistyped_command_or_a_bad_value_is_one_line(capsys, argv, said):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(said), err


def test_every_flag_the_readme_table_names_is_one_of_a_command_it_names():
    """The README's command table against the parser: each option a row names belongs to a command that row names
    (`ffkv COMMAND` or `ffkv VERB NOUN`), and the exit statuses it lists are those `ffkv --help` prints."""
    options: dict[str, set[str]] = {}
    for name, parser in parsers(build_parser()):
        words = tuple(name.split()[1:])
        options[" ".join(words)] = {o for a in parser._actions for o in a.option_strings}
    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    wrong = []
    for line in table.splitlines():
        if not line.startswith("| `ffkv"):
            continue
        named = {" ".join(m.split()[:2]) if " ".join(m.split()[:2]) in options else m.split()[0]
                 for m in re.findall(r"`ffkv ((?:[a-z-]+)(?: [a-z-]+)?)", line)}
        have = set().union(*(options.get(c, set()) for c in named), options[""])
        wrong += [(sorted(named), flag) for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line) if flag not in have]
    assert not wrong, wrong
    from ffkv.errors import EXIT_CODES

    listed = re.search(r"the exit statuses \(([^)]*(?:\([^)]*\)[^)]*)*)\)", table).group(1)
    assert sorted(int(n) for n in re.findall(r"\b(\d{1,3}) [a-zA-Z]", listed)) == sorted(EXIT_CODES)
