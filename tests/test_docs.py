"""Every fenced code block in the README and docs/ runs, so none can rot; the reason codes have
hints and a table row each.

- ```python blocks run as scripts, in order, in a scratch directory per document (holding
  ``model.mlir``, a copy of the bundled ``sp_mlp`` sample, and a link to ``hlo_samples/``): a block
  may write a file a later block of the same document reads.
- ```console / ```bash / ```sh blocks: each line is a command (``python -m cmatmul_pass ...`` or
  ``cmatmul-pass ...``) run there through bash, ``python`` being this interpreter, or an
  ``export NAME=value``; it must exit 0, or the code a trailing ``# exit N`` names.
- ```text, ```mlir and ```json blocks are pictures, not programs (a json block must parse).
- A block preceded by ``<!-- not run: why -->`` is skipped; there are few (NOT_RUN_AT_MOST).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "console", "bash", "sh"}
PICTURES = {"text", "mlir", "json"}
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->\s*$")
NOT_RUN_AT_MOST = 2
#: blocks in documents this suite does not own, not run, and why: (page, how the block starts) -> why
NOT_RUN_ELSEWHERE: dict[tuple[str, str], str] = {}
FENCE = re.compile(r"^```(\S*)\s*$")
COMMAND = re.compile(r"^(python -m cmatmul_pass|cmatmul-pass)( |$)")


def blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """(line, language, body, why it is not run) of every fenced block."""
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = NOT_RUN.match(lines[i - 1]) if i else None
        found.append((i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", marker and marker.group(1)))
        i = end + 1
    return found


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_block_is_labelled_and_few_are_not_run():
    not_run = []
    for path in DOCS:
        for line, lang, body, why in blocks(path):
            assert lang in RUN | PICTURES, f"{_doc_id(path)}:{line}: a block labelled {lang!r}"
            if why is not None:
                not_run.append((path.name, line))
            if lang == "json":
                json.loads(body)
    assert 0 < len(not_run) <= NOT_RUN_AT_MOST, not_run


def _skipped_elsewhere(path: Path, body: str) -> bool:
    return any(path.name == name and body.lstrip().startswith(start) for name, start in NOT_RUN_ELSEWHERE)


def _scratch(tmp_path: Path) -> Path:
    """The scratch directory's files; the directory holding this interpreter (the venv's bin:
    its ``python`` and the ``cmatmul-pass`` script), to put first on PATH."""
    shutil.copy(ROOT / "hlo_samples" / "sp_mlp.mlir", tmp_path / "model.mlir")
    (tmp_path / "hlo_samples").symlink_to(ROOT / "hlo_samples")
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "cmatmul-pass").exists() and (bin_dir / "python").exists()
    return bin_dir


def _run_shell_block(body: str, cwd: Path, env: dict, where: str) -> None:
    for raw in body.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value.strip('"')
            continue
        assert COMMAND.match(line), f"{where}: not a cmatmul_pass command: {line}"
        expected = int(m.group(1)) if (m := re.search(r"#\s*exit (\d+)\s*$", line)) else 0
        proc = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == expected, f"{where}: {line}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{where}: {line}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("path", [p for p in DOCS if any(b[1] in RUN and b[3] is None for b in blocks(p))],
                         ids=_doc_id)
def test_the_documents_code_runs(path, tmp_path):
    bin_dir = _scratch(tmp_path)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("XLA_FLAGS", None)  # each program asks for its devices, as a reader's would
    env.pop("CMATMUL_PASS_POLICY", None)  # and runs under the default policy, as a reader's would
    for line, lang, body, why in blocks(path):
        where = f"{_doc_id(path)}:{line}"
        if lang not in RUN or why is not None or _skipped_elsewhere(path, body):
            continue
        if lang == "python":
            proc = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, f"{where}\n{proc.stderr[-3000:]}"
        else:
            _run_shell_block(body, tmp_path, dict(env), where)


def test_the_readme_fits_two_screens_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    (first,) = [b for b in blocks(ROOT / "README.md") if b[1] == "console"][:1]
    assert [line.split("#")[0].strip() for line in first[2].splitlines()] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    # "run it on your model" on the first screen
    assert readme.splitlines().index("## Run it on your model") < 40
    assert "shard_map" in readme and "xla_gpu_threshold_for_windowed_einsum_mib" in readme


def test_no_page_narrates_development():
    """The README and docs/ are reference: what the software does, not who changed it when (that is
    CHANGELOG.md's and git's)."""
    # (the words spelled with a one-letter class: the pattern itself is no narration)
    narrative = re.compile(r"\bs[e]ssions?\b|\bi[s]sues? #?\d|\b(first|second|third|fourth|fifth|sixth|seventh|"
                           r"eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth) (s[e]ssion|round of work)",
                           re.IGNORECASE)
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not narrative.search(line), f"{_doc_id(path)}:{number}: {line}"


def _tracked(folder: str, pattern: str) -> list[Path]:
    """The files under ``folder`` that git tracks (every file there, outside a git checkout)."""
    proc = subprocess.run(["git", "ls-files", "--", folder], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return sorted((ROOT / folder).rglob(pattern))
    return sorted(ROOT / line for line in proc.stdout.splitlines() if Path(line).match(pattern))


def test_the_architecture_page_names_every_module():
    """docs/architecture.md shows the house as it is: every module of the package and every tool."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for path in _tracked("cmatmul_pass", "*.py"):
        name = path.relative_to(ROOT / "cmatmul_pass").as_posix()
        if name.endswith("__init__.py") and "/" in name:
            continue  # a subpackage's __init__ is its folder's line
        assert path.name in text or name in text, f"{name}: add its paragraph to docs/architecture.md"
    for path in _tracked("tools", "*"):
        if path.suffix in (".py", ".sh") and path.name != "__init__.py" and path.parent.name == "tools":
            assert path.name in text, f"tools/{path.name}"


def test_the_cli_page_is_what_its_generator_writes():
    """docs/cli.md's option and exit-code tables are written by tools/gen_cli_doc.py from the
    parser and cli.EXIT_CODES: after an edit of cli.py, `make cli-doc`."""
    from tools import gen_cli_doc

    text = (ROOT / "docs" / "cli.md").read_text()
    assert text == gen_cli_doc.updated(text), "docs/cli.md is stale: run `make cli-doc`"


def _cli_rows() -> dict[str, list[str]]:
    """docs/cli.md's option table: each option string -> the commands its row names."""
    rows = {}
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| ([^|]+) \|", line)
        if m and not m.group(1).isdigit():
            for word in re.findall(r"(?<![\w-])(-{1,2}[\w-]+|input)", m.group(1)):
                rows.setdefault(word, []).extend(c.strip() for c in m.group(2).split(","))
    return rows


def test_every_option_and_exit_code_is_on_the_cli_page_once():
    """Walk the argparse definitions (not the generator): every option of every command is on
    docs/cli.md in one row that names that command, and every exit code has its row; every
    command's --help ends with the same exit codes."""
    import argparse

    from cmatmul_pass import cli

    rows = _cli_rows()
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    seen = set()
    for name, command in [("(all)", parser), *sub.choices.items()]:
        assert cli.exit_codes_epilog() == command.epilog, name
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for option in action.option_strings or [action.dest]:
                assert name in rows.get(option, []), (name, option)
                seen.add(option)
    assert set(rows) == seen  # no row for an option the parser lacks
    codes = re.findall(r"^\| `(\d)` \| (.*) \|$", (ROOT / "docs" / "cli.md").read_text(), re.M)
    assert [int(code) for code, _ in codes] == list(cli.EXIT_CODES)
    assert "could not check" in cli.EXIT_CODES[3] and "internal error" in cli.EXIT_CODES[3]


def test_links_between_documents_resolve():
    for path in [*DOCS, ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith("http"):
                assert (path.parent / target).exists(), f"{_doc_id(path)}: {target}"


# ------------------------------------------------------------------ reason codes
def emitted_codes() -> set[str]:
    """Every reason code the pass can put in a report: the literal code of each ``Decline(...)``
    in the package, and each ``(code, reason)`` pair the options' verdicts return (sites.py, phases.py)."""
    codes, dynamic = set(), []
    for path in (ROOT / "cmatmul_pass").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Decline":
                first = node.args[0]
                if isinstance(first, ast.Constant):
                    codes.add(first.value)
                else:
                    dynamic.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Attribute) and t.attr == "reason_code" for t in node.targets):
                codes.add(node.value.value)  # a report entry recoded (phases._say_prefetchable)
            if path.name in ("sites.py", "psums.py") and isinstance(node, ast.FunctionDef) and node.name in (
                    "policy_verdict", "_all_reduce_strategy"):
                for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)):
                    pairs = [ret.value, *(e for e in ret.value.elts if isinstance(e, ast.Tuple))]
                    codes |= {p.elts[0].value for p in pairs
                              if len(p.elts) == 2 and isinstance(p.elts[0], ast.Constant) and isinstance(p.elts[0].value, str)}
    # four computed codes, each re-raising a Decline caught from the literal ones (the psum's
    # rewords the scatter side's message for the all_reduce: all_reduce.as_psum; an all_to_all
    # pair's gathers the declines of the dims it tried: all_to_all._match); a new computed code
    # needs a look, and a line here
    assert len(dynamic) == 4, dynamic
    return codes


def reason_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "docs" / "reasons.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_emitted_code_has_a_hint_and_a_row():
    from cmatmul_pass import reasons

    codes = emitted_codes()
    assert {"policy", "min_bytes", "chunks", "no_dim", "not_sum", "user_not_dot", "multiple_users"} <= codes
    assert codes <= set(reasons.REASONS), codes - set(reasons.REASONS)
    for code, reason in reasons.REASONS.items():
        assert reason.hint and reason.meaning and reasons.hint(code) == reason.hint
    assert set(reason_rows()) == set(reasons.REASONS)


def test_the_reasons_page_is_what_its_generator_writes():
    """docs/reasons.md's table is written by tools/gen_reasons_doc.py from reasons.py: after an
    edit of reasons.py, `make reasons-doc`."""
    from cmatmul_pass import reasons
    from tools import gen_reasons_doc

    text = (ROOT / "docs" / "reasons.md").read_text()
    assert text == gen_reasons_doc.updated(text), "docs/reasons.md is stale: run `make reasons-doc`"
    # the generator's rows hold each code's meaning, example and hint, as reason_rows reads them back
    rows = reason_rows()
    for code, reason in reasons.REASONS.items():
        assert rows[code][1:] == [reason.meaning, f"`explain {' '.join(reason.example)}`" if reason.example else "—",
                                  reason.hint]


def test_the_reasons_generator_rewrites_only_between_its_markers():
    from tools import gen_reasons_doc as gen

    page = f"intro\n{gen.BEGIN}\n| stale |\n{gen.END}\nafter\n"
    assert gen.updated(page) == f"intro\n{gen.BEGIN}\n{gen.table()}{gen.END}\nafter\n"
    with pytest.raises(ValueError, match="needs one"):
        gen.updated("no markers\n")


@pytest.mark.parametrize("code", [c for c, r in __import__("cmatmul_pass.reasons").reasons.REASONS.items() if r.example])
def test_each_example_shows_its_code_and_explain_prints_the_hint(code, capsys):
    from cmatmul_pass import reasons

    reason = reasons.REASONS[code]
    assert run_cli("explain", *reason.example) == 0
    out = capsys.readouterr().out
    assert f"[{code}]" in out and f"  to have it rewritten: {reason.hint}\n" in out
