"""Golden tests: every hlo_samples/*.mlir against its CHECK and GOLDEN lines (FileCheck)."""

import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import cmatmul_pass
from cmatmul_pass import ir_utils
from conftest import NEGATIVE, POSITIVE, SAMPLES
from cmatmul_pass.cli import options_from_argv, render_with_args
from tools.golden import (
    GOLDEN_BEGIN,
    GOLDEN_END,
    GOLDEN_PREFIX,
    HLO_GOLDENS_JAX,
    MAIN_ARGS,
    SPLIT_ARGS,
    begin_marker,
    dead_directives,
    expectation,
    golden_blocks,
    golden_lines,
    intent_prefix,
    replace_golden_block,
)

FILECHECK = shutil.which("filecheck", path=str(Path(sys.executable).parent)) or shutil.which("filecheck")


def filecheck(check_file: Path, output: str, prefix: str) -> subprocess.CompletedProcess:
    assert FILECHECK, "the filecheck package is not installed (pip install -e '.[test]')"
    return subprocess.run(
        [FILECHECK, str(check_file), "--check-prefix", prefix],
        input=output, capture_output=True, text=True,
    )


def test_there_are_positive_and_negative_samples():
    assert len(POSITIVE) >= 10 and len(NEGATIVE) >= 5


BLOCKS = [(path, prefix, args) for path in SAMPLES for prefix, args in golden_blocks(path.read_text())]


@pytest.mark.parametrize(
    "path, golden, args", BLOCKS, ids=[f"{p.stem}-{g}" for p, g, _ in BLOCKS]
)
@pytest.mark.parametrize("kind", ["intent", "golden"])
def test_sample_filecheck(path, golden, args, kind):
    """Every golden block: the pass run with the block's options, FileCheck'd against the block
    (``golden``) and against the variant's hand-stated intent lines (``intent``)."""
    if kind == "golden" and "--emit hlo" in " ".join(args) and jax.__version__ != HLO_GOLDENS_JAX:
        pytest.skip(f"the HLO golden is XLA's converter text under jax {HLO_GOLDENS_JAX} (its output differs by "
                    "release); the block's intent checks still run")
    text = path.read_text()
    prefix = golden if kind == "golden" else intent_prefix(golden)
    assert f"// {prefix}:" in text or f"// {prefix}-" in text, f"{path.name} has no {prefix} lines"
    output = render_with_args(text, args, source=str(path))
    proc = filecheck(path, output, prefix)
    assert proc.returncode == 0, f"{path.name} ({prefix}, {' '.join(args)}):\n{proc.stderr[-3000:]}"


def test_variant_blocks_exist_for_every_site_kind_and_option():
    variants = {}
    for path, golden, args in BLOCKS:
        if golden != "GOLDEN":
            variants.setdefault(" ".join(args), set()).add(path.stem)
    assert {"--bidirectional", "--unroll 2", "--unroll full"} <= set(variants)
    assert any("--annotate-streams" in a for a in variants) and any("--emit hlo" in a for a in variants)
    for args in ("--bidirectional", "--unroll 2", "--unroll full"):
        assert {"ag_dot_1d", "ag_dot_contracting", "rs_dot_1d", "ag_dot_qkv"} <= variants[args]


def test_variant_block_markers_round_trip():
    marker = begin_marker("BIDI_GOLDEN", ["--bidirectional", "--unroll", "2"])
    text = f"{marker}\n// BIDI_GOLDEN: stale_line\n{GOLDEN_END}\n"
    assert golden_blocks(text) == [("BIDI_GOLDEN", ["--bidirectional", "--unroll", "2"])]
    assert intent_prefix("BIDI_GOLDEN") == "BIDI" and intent_prefix("GOLDEN") == "CHECK"
    new = replace_golden_block(text, "x\ny\n", "BIDI_GOLDEN", ["--bidirectional", "--unroll", "2"])
    assert "// BIDI_GOLDEN: x\n// BIDI_GOLDEN-NEXT: y\n" in new and "stale_line" not in new


@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_positive_sample_rewrites_the_expected_sites(path):
    text = path.read_text()
    _, count = expectation(text)  # under the main block's options (MAIN_ARGS: the uni ring; SPLIT_ARGS)
    args = dict(golden_blocks(text))[GOLDEN_PREFIX]
    assert tuple(args) in (MAIN_ARGS, SPLIT_ARGS)
    result = cmatmul_pass.rewrite(text, options_from_argv(args), source=str(path))
    assert len(result.report.rewritten) == int(count)
    assert result.changed


@pytest.mark.parametrize("path", NEGATIVE, ids=lambda p: p.stem)
def test_negative_sample_is_unchanged_with_its_reason(path):
    text = path.read_text()
    _, codes = expectation(text)  # one code per candidate site (a psum's chunks: two)
    result = cmatmul_pass.rewrite(text, source=str(path))
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
    assert not result.report.rewritten
    assert [s.reason_code for s in result.report.sites] == codes.split()
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
