"""The README and docs/ stay true: their programs run, their fragments call what exists, their
commands parse, their diagram is current, their links resolve, and the README stays a front page.

Each fenced block is checked by its language:

* ``python``: a whole program (no top-level ``await``, no name it does not bind itself) runs in a
  fresh interpreter; a fragment is compiled (top-level ``await`` allowed), its imports resolve,
  and every ``ctl.<name>(...)`` names a method of the controller (``SyncLifecycleController``
  when the block builds one) and passes only keywords it takes;
* ``bash``: each command is one this test knows: ``residency`` command lines are parsed by the
  command's own parser (and a scenario file must exist), scripts and files must exist, ``curl``
  must name a route of the service with a method it serves, ``pip install`` only extras that
  ``pyproject.toml`` defines;
* ``toml``: parses, and a drill scenario (``[drill]``) is accepted by the drill's parser;
* ``mermaid``: the README's diagram, checked by ``scripts/gen_diagram.py --check``;
* ``text``: not checked. A block without a language is refused, so nothing escapes unchecked.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import inspect
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_LIMIT = 8192


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the line their fence opens on."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            end = lines.index("```", i + 1)
            found.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return found


BLOCKS = [b for page in PAGES for b in blocks(page)]


def of(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang]


# -- the pages --------------------------------------------------------------------------------
def test_the_readme_is_a_front_page() -> None:
    """README.md is at most 8 KiB; the rest lives in docs/."""
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes (at most {README_LIMIT}): move it to docs/"


def test_every_docs_page_is_linked_from_the_readme_and_links_back() -> None:
    """Each docs/*.md is reachable from the README, and opens by linking back to it."""
    text = README.read_text()
    for page in DOCS:
        assert f"](docs/{page.name})" in text, f"README.md does not link docs/{page.name}"
        opening = page.read_text().split("\n## ", 1)[0]
        assert "](../README.md)" in opening, f"{page.name} does not link back to the README first"


def test_every_relative_link_resolves() -> None:
    """Links to files of the repository (README and docs/) point at files that exist."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            assert not anchor, f"{page.name}: link files, not anchors: {target}"
            assert (page.parent / path).exists(), f"{page.name}: {target} does not exist"


def test_every_script_and_file_the_pages_name_exists() -> None:
    """Paths named in the README and docs/ point at files that exist."""
    pattern = (r"(?<![\w/])((?:scripts|lifecycle|strategies|tests)/[\w./-]+\.(?:py|toml|txt|md|sh)"
               r"|scripts/\w+)")
    for page in PAGES:
        for path in set(re.findall(pattern, page.read_text())):
            assert (ROOT / path).exists(), f"{page.name}: {path}"


def test_every_block_has_a_language_this_test_checks() -> None:
    """No fence without a language: each block is checked, or marked ``text``."""
    known = {"python", "bash", "toml", "mermaid", "text"}
    bad = [str(b) for b in BLOCKS if b.lang not in known]
    assert not bad, f"blocks without a checked language: {bad}"


# -- mermaid ----------------------------------------------------------------------------------
def test_state_diagram_is_generated_from_the_transition_table() -> None:
    """scripts/gen_diagram.py --check passes: the diagram matches lifecycle._phase."""
    assert [b.page for b in of("mermaid")] == [README]
    done = subprocess.run([sys.executable, "scripts/gen_diagram.py", "--check"], cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, "run: python scripts/gen_diagram.py"


# -- python -----------------------------------------------------------------------------------
def free_names(tree: ast.Module) -> set[str]:
    """Names a block reads but never binds (nor are builtins): a fragment's context."""
    bound: set[str] = set(dir(builtins))
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if not isinstance(node, ast.Lambda):
                bound.add(node.name)
            bound.update(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def is_program(code: str) -> bool:
    """A block that runs on its own: no top-level await and no name it does not bind."""
    try:
        tree = ast.parse(code)
        compile(tree, "<block>", "exec")
    except SyntaxError:
        return False
    return not free_names(tree)


PROGRAMS = [b for b in of("python") if is_program(b.code)]
FRAGMENTS = [b for b in of("python") if not is_program(b.code)]


@pytest.mark.parametrize("block", PROGRAMS, ids=str)
def test_python_programs_run_as_written(block: Block) -> None:
    """A whole program in the pages runs to completion in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", block.code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{block}: {done.stderr[-3000:]}"
    if "ctl.sleep()" in block.code:
        assert "success=True" in done.stdout


def test_the_readme_example_is_a_program_that_runs() -> None:
    """The README's embedded example is one of the programs run (not a fragment)."""
    assert [b.page for b in PROGRAMS].count(README) == 1


@pytest.mark.parametrize("block", FRAGMENTS, ids=str)
def test_python_fragments_compile_import_and_call_what_exists(block: Block) -> None:
    """A fragment compiles, its imports resolve, and its ``ctl`` calls exist with those keywords."""
    import lifecycle

    tree = compile(block.code, str(block), "exec",
                   flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    compile(tree, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                __import__(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = __import__(node.module, fromlist=["_"])
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block}: {node.module}.{alias.name}"
    cls = (lifecycle.SyncLifecycleController if "SyncLifecycleController" in block.code
           else lifecycle.LifecycleController)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "ctl"):
            assert hasattr(cls, node.attr), f"{block}: {cls.__name__} has no {node.attr}"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "ctl"):
            method = getattr(cls, node.func.attr, None)
            if method is None:
                continue  # the attribute check names it
            params = inspect.signature(method).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                assert kw.arg in params, f"{block}: {node.func.attr}() takes no {kw.arg}="


# -- toml -------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", of("toml"), ids=str)
def test_toml_blocks_parse_and_drills_are_valid(block: Block) -> None:
    """A TOML block parses; a drill scenario is accepted by the drill's own parser."""
    data = tomllib.loads(block.code)
    if "drill" in data:
        from lifecycle.cli.drills import parse_scenario

        parse_scenario(data, str(block))


# -- bash -------------------------------------------------------------------------------------
def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split at
    ``;``, ``&&`` and ``|``, leading ``VAR=value`` assignments removed (``$VAR`` kept as text)."""
    found: list[list[str]] = []
    for line in code.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        current: list[str] = []
        for token in [*lex, ";"]:
            if token in {";", "&&", "||", "|", "&"}:
                while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                    current.pop(0)
                if current:
                    found.append(current)
                current = []
            else:
                current.append(token)
    return found


def residency_parser() -> argparse.ArgumentParser:
    from lifecycle.cli import _parser

    return _parser()


def check_residency(argv: list[str], where: str) -> None:
    parser = residency_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        raise AssertionError(f"{where}: residency {shlex.join(argv)} does not parse") from exit_
    scenario = getattr(args, "scenario", None)
    if scenario:
        assert (ROOT / scenario).exists(), f"{where}: {scenario}"


def check_curl(argv: list[str], where: str) -> None:
    from lifecycle.http._routes import ROUTES

    method, urls, i = "GET", list[str](), 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-X"):
            method = arg[2:] or argv[i + 1]
            i += 0 if arg[2:] else 1
        elif arg in {"-H", "-d", "--data", "-o", "-w"}:
            i += 1
        elif not arg.startswith("-"):
            urls.append(arg)
        i += 1
    assert len(urls) == 1, f"{where}: {argv}"
    path = urlparse(urls[0].replace("$S", "http://127.0.0.1:30000")).path
    assert path in ROUTES, f"{where}: no route {path}"
    assert method in ROUTES[path][1], f"{where}: {path} does not serve {method}"


def check_pip(argv: list[str], where: str) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert argv[1] == "install", f"{where}: {argv}"
    for spec in argv[2:]:
        m = re.search(r"\[([\w,-]+)\]", spec)
        for extra in (m.group(1).split(",") if m else []):
            assert extra in extras, f"{where}: no extra {extra!r} (pyproject.toml: {sorted(extras)})"


def check_command(argv: list[str], where: str) -> None:
    head, rest = argv[0], argv[1:]
    if head in {"scripts/residency", "residency"}:
        check_residency(rest, where)
    elif head == "scripts/test":
        assert (ROOT / head).exists()
        if rest[:1] == ["--gpu"]:
            check_command(["python", "scripts/gpu_run.py", *rest[1:]], where)
        for arg in rest:
            if arg.startswith("tests/"):
                assert (ROOT / arg.split("::")[0]).exists(), f"{where}: {arg}"
    elif head.startswith("scripts/") and head.endswith(".sh"):
        assert (ROOT / head).exists(), f"{where}: {head}"
    elif head in {"python", "python3", ".venv/bin/python"}:
        assert rest and rest[0].startswith("scripts/"), f"{where}: {argv}"
        assert (ROOT / rest[0]).exists(), f"{where}: {rest[0]}"
    elif head == "curl":
        check_curl(argv, where)
    elif head == "pip":
        check_pip(argv, where)
    else:
        raise AssertionError(f"{where}: this test does not know how to check {head!r}: teach it")


@pytest.mark.parametrize("block", of("bash"), ids=str)
def test_shell_commands_exist_and_parse(block: Block) -> None:
    """Each command of a shell block is known: its script exists, its options parse."""
    found = commands(block.code)
    assert found, f"{block}: no command"
    for argv in found:
        check_command(argv, str(block))
