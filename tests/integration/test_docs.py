"""Every command and code block of the README and docs/ runs as written.

Each markdown file's fenced blocks run in order in one scratch folder (the repository's
``tests``, ``examples`` and ``benchmarks`` linked into it), so a later block uses the
files an earlier one wrote, as a reader following the page would:

- ``bash``: the block runs in bash (``-e -o pipefail``), ``dflop`` and ``python`` being
  this environment's;
- ``python``: the block runs in one namespace per file;
- a block right after ``<!-- doc-test: file NAME -->`` is written to ``NAME``;
- a block right after ``<!-- doc-test: skip: WHY -->`` does not run here (WHY says what it
  needs: GPUs, a package install, the test suite itself); its ``dflop`` commands are still
  parsed by the real command line, so their flags are the ones ``--help`` lists.

Any other block fails the test: nothing in the docs goes unchecked by accident. Inline
code that starts with ``dflop COMMAND`` must use flags that command has.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_DIR as REPO_ROOT

pytestmark = pytest.mark.slow

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINKED = ("tests", "examples", "benchmarks")
DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(skip|file)\s*:?\s*(.*?)\s*-->")
BLOCK_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    directive: str | None  # "skip" / "file" / None
    argument: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{doc.name}:{i + 1}: a code block is never closed"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        match = DIRECTIVE.fullmatch(before.strip())
        out.append(
            Block(
                doc,
                i + 1,
                fence.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                match.group(1) if match else None,
                match.group(2) if match else "",
            )
        )
        i = end + 1
    return out


def dflop_commands(script: str) -> list[list[str]]:
    """The ``dflop`` command lines in a shell script (``dflop X``, ``python -m dflop.cli
    X``, ``torchrun ... -m dflop.cli X``), as argument lists after the program."""
    out = []
    for line in script.replace("\\\n", " ").split("\n"):
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part, comments=True)
            if words[:1] == ["dflop"]:
                out.append(words[1:])
            elif "dflop.cli" in words:
                out.append(words[words.index("dflop.cli") + 1 :])
    return out


def check_parses(argv: list[str], where: str) -> None:
    from dflop.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as stop:
        raise AssertionError(f"{where}: `dflop {shlex.join(argv)}` does not parse") from stop


def workdir_for(doc: Path, tmp_path: Path) -> Path:
    work = tmp_path / doc.stem
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(REPO_ROOT / name)
    return work


def run_doc(doc: Path, work: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    namespace: dict = {"__name__": "__doc__"}
    cwd = os.getcwd()
    os.chdir(work)
    try:
        for block in blocks(doc):
            if block.directive == "skip":
                assert block.argument, f"{block.where}: say why the block does not run here"
                for argv in dflop_commands(block.text):
                    check_parses(argv, block.where)
            elif block.directive == "file":
                (work / block.argument).write_text(block.text)
            elif block.lang in ("bash", "sh", "console"):
                done = subprocess.run(
                    ["bash", "-e", "-o", "pipefail", "-c", block.text],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_TIMEOUT_S,
                )
                assert done.returncode == 0, (
                    f"{block.where}: exit {done.returncode}\n{block.text}\n"
                    f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
                )
            elif block.lang == "python":
                exec(compile(block.text, block.where, "exec"), namespace)  # noqa: S102
            else:
                raise AssertionError(
                    f"{block.where}: a ```{block.lang} block that neither runs nor is a file "
                    "(add <!-- doc-test: file NAME --> or <!-- doc-test: skip: WHY -->)"
                )
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_block_runs_as_written(doc: Path, tmp_path: Path) -> None:
    run_doc(doc, workdir_for(doc, tmp_path))


def test_inline_commands_use_real_flags() -> None:
    """`dflop plan --trainable frozen-vision` in a sentence or table names a real flag."""
    from dflop.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
        for span in re.findall(r"`(dflop [^`]+)`", text):
            words = span.split()
            if len(words) < 2 or words[1] not in commands:
                continue
            known = set(commands[words[1]]._option_string_actions)  # noqa: SLF001
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
                assert flag in known, f"{doc.name}: `{span}` uses {flag}, not a flag of it"


def test_the_quick_start_holds_the_two_commands() -> None:
    """The README's two set-up commands are the ones .ci/run and the demo test run."""
    quick = [b for b in blocks(REPO_ROOT / "README.md") if b.directive == "skip"][:2]
    assert [b.text.strip() for b in quick] == [
        'python3 -m pip install torch==2.13.0 ".[plot]" && dflop demo',
        'python3 -m pip install torch==2.13.0 ".[test]" && python3 -m pytest',
    ]
    assert quick[1].text.strip() in (REPO_ROOT / ".ci" / "run").read_text()
