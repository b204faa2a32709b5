"""Golden tests: every hlo_samples/*.mlir against its CHECK and GOLDEN lines (FileCheck)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cmatmul_pass
from cmatmul_pass import ir_utils
from conftest import NEGATIVE, POSITIVE, SAMPLES
from tools.golden import dead_directives, expectation, golden_lines, replace_golden_block, GOLDEN_BEGIN, GOLDEN_END

FILECHECK = shutil.which("filecheck", path=str(Path(sys.executable).parent)) or shutil.which("filecheck")


def filecheck(check_file: Path, output: str, prefix: str) -> subprocess.CompletedProcess:
    assert FILECHECK, "the filecheck package is not installed (pip install -e '.[test]')"
    return subprocess.run(
        [FILECHECK, str(check_file), "--check-prefix", prefix],
        input=output, capture_output=True, text=True,
    )


def test_there_are_positive_and_negative_samples():
    assert len(POSITIVE) >= 10 and len(NEGATIVE) >= 5


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("prefix", ["CHECK", "GOLDEN"])
def test_sample_filecheck(path, prefix):
    text = path.read_text()
    assert f"// {prefix}" in text, f"{path.name} has no {prefix} lines"
    output = cmatmul_pass.rewrite(text, source=str(path)).text
    proc = filecheck(path, output, prefix)
    assert proc.returncode == 0, f"{path.name} ({prefix}):\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_positive_sample_rewrites_the_expected_sites(path):
    text = path.read_text()
    _, count = expectation(text)
    result = cmatmul_pass.rewrite(text, source=str(path))
    assert len(result.report.rewritten) == int(count)
    assert result.changed


@pytest.mark.parametrize("path", NEGATIVE, ids=lambda p: p.stem)
def test_negative_sample_is_unchanged_with_its_reason(path):
    text = path.read_text()
    _, code = expectation(text)
    result = cmatmul_pass.rewrite(text, source=str(path))
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
    assert not result.report.rewritten
    assert [s.reason_code for s in result.report.sites] == [code]
    assert all(s.reason for s in result.report.sites)


def test_no_sample_has_a_dead_check_line():
    dead = {p.name: dead_directives(p.read_text()) for p in SAMPLES}
    assert not {k: v for k, v in dead.items() if v}


def test_lint_catches_a_directive_without_colon():
    text = "// CHECK: ok\n// CHECK-NEXT  %6 = foo\n//GOLDEN-SAME bar\n// CHECKS are words\n"
    assert [n for n, _ in dead_directives(text)] == [2, 3]


def test_golden_lines_escape_filecheck_syntax():
    lines = golden_lines("a = dense<[[0, 1]]>\n  {{x}}\n")
    assert lines == ["// GOLDEN: a = dense<{{\\[\\[}}0, 1]]>", "// GOLDEN-NEXT: {{\\{\\{}}x}}"]


def test_update_replaces_only_the_marked_block():
    text = f"// CHECK: keep me\n{GOLDEN_BEGIN}\n// GOLDEN: stale\n{GOLDEN_END}\nmodule {{\n}}\n"
    new = replace_golden_block(text, "module {\n}\n")
    assert new.startswith("// CHECK: keep me\n")
    assert "stale" not in new and "// GOLDEN: module {" in new and new.endswith("module {\n}\n")


def test_a_stale_golden_fails(tmp_path):
    path = POSITIVE[0]
    text = path.read_text().replace("// GOLDEN-NEXT: %1 = ", "// GOLDEN-NEXT: %1 = stablehlo.bogus ", 1)
    stale = tmp_path / path.name
    stale.write_text(text)
    assert filecheck(stale, cmatmul_pass.rewrite(path.read_text()).text, "GOLDEN").returncode != 0
