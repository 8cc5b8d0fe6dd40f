"""The README's commands work as written: every `omni-triton <verb>` it names answers `--help`, every `--option`
it shows exists, every relative link in it and in docs/ points at a file inside the repository, CI runs its test
command, it stays a short guide, and its performance table says what the results file it cites says.

The verbs are read from the README itself, so a verb added to the README is checked without touching this file,
and a verb the README names but the CLI lacks fails here, by name."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
from pathlib import Path

import pytest

from omni_triton import cli, client

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"
DEMO_COMMAND = "bash scripts/setup.sh && .venv/bin/omni-triton demo"
# Flags the README quotes as what `serve` passes on to tritonserver, not options of ours.
TRITONSERVER_FLAGS = {"--allow-client-shm"}
README_MAX_BYTES = 12 * 1024  # a user's guide; the detail lives in docs/
DOCS_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def visible_markdown(path: Path) -> str:
    """The file without HTML comments (notes to maintainers, not shown to a reader)."""
    return re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.DOTALL)


def code_of(markdown: str) -> list[str]:
    """Fenced code blocks and inline code spans: where the README shows commands."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
    return blocks + [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def named_commands(markdown: str) -> list[tuple[str, ...]]:
    """Every `omni-triton VERB` in the code, as argv prefixes; `build KIND` (or a synopsis `build a|b|c`) gives
    one prefix per builder, since each builder has its own parser."""
    commands = set()
    for code in code_of(markdown):
        for match in re.finditer(r"(?<![\w-])omni-triton\s+([a-z][\w-]*)(?:\s+([a-z][\w|-]*))?", code):
            verb, argument = match.groups()
            if verb == "build" and argument:
                commands.update(("build", kind) for kind in argument.split("|") if kind)
            else:
                commands.add((verb,))
    return sorted(commands)


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    """`omni-triton ARGV --help` run in this process (the console script is `omni_triton.cli:main`)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code in (0, None), (
        f"README.md names `omni-triton {' '.join(argv)}`, but `omni-triton {' '.join(argv)} --help` exits with "
        f"{exit_.value.code}: {err.getvalue().strip()[-400:]}")
    return out.getvalue()


README_COMMANDS = named_commands(visible_markdown(README))


def test_the_readme_names_the_main_verbs():
    """Guards the parsing below: if it found nothing, the per-verb test would pass on no cases."""
    assert {("serve",), ("demo",), ("bench",), ("build", "python-backend")} <= set(README_COMMANDS)


@pytest.mark.parametrize("argv", README_COMMANDS, ids=" ".join)
def test_every_verb_the_readme_names_answers_help(argv):
    assert "usage:" in help_text(argv)


def test_every_option_the_readme_shows_exists():
    """Each `--option` in the README's code belongs to a command it names or to the stream client."""
    known = "\n".join(help_text(argv) for argv in README_COMMANDS)
    with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit):
        client.main(["--help"])
    known += out.getvalue()
    shown = {option for code in code_of(visible_markdown(README))
             for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", code)}
    unknown = sorted(option for option in shown - TRITONSERVER_FLAGS
                     if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", known))
    assert not unknown, f"README.md shows options that no command's --help knows: {unknown}"


@pytest.mark.parametrize("page", DOCS_PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    targets = re.findall(r"\]\(([^)\s]+)\)", visible_markdown(page))
    relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert relative or page != README, "README.md links no docs: the link parsing broke"
    missing = [t for t in relative if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links files that do not exist: {missing}"
    outside = [t for t in relative if not (page.parent / t).resolve().is_relative_to(ROOT)]
    assert not outside, f"{page.relative_to(ROOT)} links files outside the repository: {outside}"


@functools.cache
def markdown_files() -> frozenset[str]:
    """The names of the repository's Markdown files (not the environment's or the build's)."""
    return frozenset(path.name for path in ROOT.rglob("*.md")
                     if not {".git", ".venv", "build", "node_modules"} & set(path.relative_to(ROOT).parts))


@pytest.mark.parametrize("page", DOCS_PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_markdown_file_a_page_names_is_in_the_repository(page):
    """A reader cannot open a design note or a README that only exists on someone's machine."""
    named = set(re.findall(r"([\w-]+\.md)\b", visible_markdown(page)))
    assert not named - markdown_files(), (f"{page.relative_to(ROOT)} names files the repository does not hold: "
                                          f"{sorted(named - markdown_files())}")


def test_the_readme_is_a_short_guide():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to a "
                                      "docs/ page and link it")


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages, "no docs pages found"
    assert not {page for page in pages if f"]({page})" not in index}, "docs/README.md misses a page"


def test_the_two_commands_are_shown_and_ci_runs_the_test_command():
    code = code_of(visible_markdown(README))
    assert DEMO_COMMAND in code[0] and TEST_COMMAND in code[1], "the README must open with the two commands"
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def markdown_table(text: str) -> list[list[str]]:
    """The first Markdown table in ``text``: its rows (header first, the separator left out) as stripped cells."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rows = [[cell.strip().replace("**", "") for cell in line.strip("|").split("|")] for line in lines]
    return [row for row in rows if not all(set(cell) <= set("-:") for cell in row)]


# README performance row label -> the same cell from a bench results.json row
PERFORMANCE_CELLS = {
    "TTFA p50 / p95 ms": lambda r: f"{r['ttfa_p50'] * 1000:.0f} / {r['ttfa_p95'] * 1000:.0f}",
    "TTFT p50 ms": lambda r: f"{r['ttft_p50'] * 1000:.0f}",
    "RTF mean": lambda r: f"{r['rtf_mean']:.3f}",
    "requests/s": lambda r: f"{r['requests_per_s']:.2f}",
    "streams that ran dry": lambda r: f"{r['ran_dry']} of {r['requests']}",
}


def test_the_readme_performance_table_is_the_results_file_it_cites():
    text = visible_markdown(README)
    section = text[text.index("## Performance"):]
    section = section[:section.index("\n## ", 1)]
    cited = re.search(r"\]\((benchmarks/results/[^)#]+/results\.md)\)", section)
    assert cited, "the README's performance section must link the results.md its table comes from"
    results = json.loads((ROOT / cited.group(1)).with_name("results.json").read_text())["results"]
    by_level = {row["concurrency"]: row for row in results if row["system"] == "server"}
    header, *rows = markdown_table(section)
    levels = [int(level) for level in header[1:]]
    assert rows and set(levels) <= set(by_level), f"README levels {levels}, results have {sorted(by_level)}"
    for label, *cells in rows:
        cell = next((cell for name, cell in PERFORMANCE_CELLS.items() if label.startswith(name)), None)
        assert cell is not None, f"README performance row {label!r}: add how to check it to PERFORMANCE_CELLS"
        expected = [cell(by_level[level]) for level in levels]
        assert cells == expected, f"README performance row {label!r} says {cells}, {cited.group(1)} {expected}"
