"""Output files (``rewrite -o``, ``--report-json``) are written without damaging the path: regular
files replaced atomically keeping their mode, new ones with the umask's, symlinks followed,
devices, FIFOs and ``/dev/stdout``-like links written through.  Nothing here touches the real
``/dev``: the device is a pseudo-terminal this test opens, ``stdout`` a link in tmp_path."""

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cmatmul_pass.output_files import OutputError, write_output
from conftest import ROOT, run_cli, sample


@pytest.fixture
def umask():
    """Set the process umask for the test; restored after it."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def leftovers(directory: Path, *expected: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in expected)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_umasks_mode(tmp_path, umask, mask, mode):
    umask(mask)
    out = tmp_path / "new.mlir"
    write_output(str(out), "module {}\n")
    assert out.read_text() == "module {}\n"
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert leftovers(tmp_path, "new.mlir") == []


def test_a_regular_file_is_replaced_atomically_keeping_its_mode(tmp_path, umask):
    umask(0o077)
    out = tmp_path / "out.json"
    out.write_text("old contents, longer than the new ones\n")
    out.chmod(0o640)
    inode = out.stat().st_ino
    reader = out.open()  # a reader of the old file keeps reading the old file (it was renamed over)
    write_output(str(out), "{}\n")
    assert out.read_text() == "{}\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert out.stat().st_ino != inode
    assert reader.read() == "old contents, longer than the new ones\n"
    reader.close()
    assert leftovers(tmp_path, "out.json") == []


def test_a_symlink_is_followed_and_its_target_replaced(tmp_path):
    target = tmp_path / "real" / "report.json"
    target.parent.mkdir()
    target.write_text("old\n")
    target.chmod(0o604)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_output(str(link), "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o604
    assert leftovers(target.parent, "report.json") == []


def test_a_dangling_symlink_gets_its_target_created(tmp_path, umask):
    umask(0o022)
    link = tmp_path / "link.mlir"
    link.symlink_to(tmp_path / "made.mlir")
    write_output(str(link), "module {}\n")
    assert link.is_symlink() and (tmp_path / "made.mlir").read_text() == "module {}\n"
    assert stat.S_IMODE((tmp_path / "made.mlir").stat().st_mode) == 0o644


def test_a_fifo_is_written_through(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    write_output(str(fifo), b"through the pipe\n")
    reader.join(timeout=10)
    assert received == [b"through the pipe\n"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert leftovers(tmp_path, "pipe") == []


def test_a_character_device_is_written_through(tmp_path):
    """A pseudo-terminal's slave (/dev/pts/N), a character device like /dev/null; its master
    reads what was written."""
    master, slave = os.openpty()
    try:
        name = os.ttyname(slave)
        assert stat.S_ISCHR(os.stat(name).st_mode)
        link = tmp_path / "tty"  # through a link too, as /dev/stdout is one
        link.symlink_to(name)
        write_output(str(link), b"to the terminal")
        assert os.read(master, 100).replace(b"\r\n", b"\n") == b"to the terminal"
        assert stat.S_ISCHR(os.stat(name).st_mode)
    finally:
        os.close(master)
        os.close(slave)


def test_a_dev_stdout_like_link_writes_to_the_process_stdout(tmp_path):
    """/dev/stdout is a link to /proc/self/fd/1; with stdout a pipe its target is no file of any
    directory.  The link (made in tmp_path, the same shape) is written through and stays."""
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    code = f"from cmatmul_pass.output_files import write_output; write_output({str(link)!r}, 'hello')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"hello"
    assert link.is_symlink() and leftovers(tmp_path, "stdout") == []


def test_a_directory_or_a_missing_parent_is_an_error_leaving_nothing(tmp_path):
    with pytest.raises(OutputError, match="is a directory"):
        write_output(str(tmp_path), "x")
    with pytest.raises(OutputError, match="no-such-dir/out: cannot write"):
        write_output(str(tmp_path / "no-such-dir" / "out"), "x")
    assert leftovers(tmp_path) == []


def test_dash_is_stdout(capfdbinary):
    write_output("-", b"on stdout")
    assert capfdbinary.readouterr().out == b"on stdout"


def test_the_cli_writes_rewrite_output_and_report_through_it(tmp_path, umask):
    umask(0o022)
    out, report = tmp_path / "out.mlir", tmp_path / "report.json"
    report.write_text("{}")
    report.chmod(0o600)
    assert run_cli("rewrite", sample("sp_mlp"), "-q", "-o", out, "--report-json", report) == 0
    assert "stablehlo.collective_permute" in out.read_text() and stat.S_IMODE(out.stat().st_mode) == 0o644
    assert '"sites"' in report.read_text() and stat.S_IMODE(report.stat().st_mode) == 0o600
