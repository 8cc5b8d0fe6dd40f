"""`omni-triton serve --help` / `demo --help` and the stream client's --help: every option explains itself and
shows its default."""

from __future__ import annotations

import re

import pytest

from omni_triton import cli, client


def option_entries(help_text: str) -> dict[str, str]:
    """{option: its help text} from argparse's help output (an entry runs until the next option line)."""
    entries, current = {}, None
    for line in help_text.splitlines():
        match = re.match(r"^  (-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(2)
            entries[current] = line[match.end():]
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    entries.pop("--help", None)
    return entries


def help_of(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv + ["--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [["serve"], ["demo"]])
def test_every_command_line_option_has_help_with_its_default(argv, capsys):
    entries = option_entries(help_of(cli.main, argv, capsys))
    assert {"--max-tokens-cap", "--max-text-chars", "--max-audio-seconds", "--first-chunk-frames"} <= set(entries)
    undocumented = {option: text for option, text in entries.items() if "default" not in text}
    assert not undocumented, undocumented


def test_stream_client_documents_the_request_semantics(capsys):
    entries = option_entries(help_of(client.main, [], capsys))
    assert "N + 1 talker tokens" in entries["--max-audio-frames"]
    assert "0 = greedy" in entries["--temperature"] and "penalty still applies" in entries["--temperature"]
    assert "else 1.0" in entries["--repetition-penalty"]
    assert "1.05" in entries["--talker-repetition-penalty"] and "-1 = a fresh random seed" in entries["--seed"]
    assert all("default" in text for text in entries.values())


def test_api_options_have_help_with_their_default(capsys):
    entries = option_entries(help_of(cli.main, ["api"], capsys))
    assert {"--triton-grpc", "--host", "--port", "--checkpoint"} <= set(entries)
    undocumented = {option: text for option, text in entries.items() if "default" not in text}
    assert not undocumented, undocumented
