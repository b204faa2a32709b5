"""Is ``cmatmul_pass.jit`` a drop-in for ``jax.jit``?  Run a jax test module with every ``jax.jit``
replaced by ``cmatmul_pass.jit(check=True)``; report the tests that pass under jax.jit and not under
the decorator, and every warning the decorator gave.

::

    python tools/jit_dropin_survey.py path/to/jax/tests/shard_map_test.py --out survey.jsonl

The test module is jax's own (``tests/shard_map_test.py`` of a jax checkout at the installed
version; it is not shipped with jax).  A copy with ``jax.jit`` replaced is imported by a child
process that runs its tests one by one and prints a line per test; a test that kills the child
(a segfault) or outlives ``--timeout`` is recorded as a crash and the child restarted after it.
Each test failing under the decorator is run again under plain jax.jit (``SURVEY_JIT=jax``): only
those passing there count.  Exit 0 when none fails only under the decorator.  (Minutes: about 45 on
2 CPU cores for the 444 tests of jax 0.10.2's shard_map_test.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: put before the test module's flag parsing: ``jax.jit`` there becomes ``_survey_jit``
SHIM = '''
import os as _survey_os, cmatmul_pass as _survey_cmatmul
_survey_jax_jit = jax.jit
def _survey_jit(f=None, **kw):
    if _survey_os.environ.get("SURVEY_JIT") == "jax":
        return _survey_jax_jit(f, **kw) if f is not None else _survey_jax_jit(**kw)
    if f is None:
        return lambda g: _survey_jit(g, **kw)
    return _survey_cmatmul.jit(f, check=True, **kw)
'''

#: the child: run the selected tests from index START on, one line per test (and per warning)
CHILD = r'''
import faulthandler, importlib, json, os, sys, time, unittest, warnings
sys.argv = sys.argv[:1]
sys.path.insert(0, os.path.dirname(MODULE))
faulthandler.enable()
from absl import flags
flags.FLAGS(["survey"], known_only=True)
suite = unittest.defaultTestLoader.loadTestsFromModule(importlib.import_module(os.path.basename(MODULE)[:-3]))
def flat(s):
    for t in s:
        yield from (flat(t) if isinstance(t, unittest.TestSuite) else (t,))
tests = [t for t in flat(suite) if any(f in t.id() for f in FILTERS)]
print(json.dumps({"count": len(tests)}), flush=True)
for i, t in enumerate(tests[START:], START):
    print(json.dumps({"start": i, "id": t.id()}), flush=True)
    result, begin = unittest.TestResult(), time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.run(result)
    for w in caught:
        if "cmatmul_pass" in str(w.message):
            print(json.dumps({"warning": i, "message": str(w.message)[:400]}), flush=True)
    status = "error" if result.errors else "fail" if result.failures else "skip" if result.skipped else "ok"
    why = (result.errors or result.failures or [(None, "")])[0][1]
    print(json.dumps({"end": i, "status": status, "s": round(time.time() - begin, 2), "why": why[-1500:]}), flush=True)
'''


def patched_copy(source: Path, folder: Path) -> Path:
    """The test module with ``jax.jit`` replaced (a copy in ``folder``)."""
    text = re.sub(r"\bjax\.jit\b", "_survey_jit", source.read_text())
    anchor = "config.parse_flags_with_absl()"
    if anchor not in text:
        raise SystemExit(f"{source}: no '{anchor}' line to put the shim before (not a jax test module?)")
    target = folder / f"survey_{source.name}"
    target.write_text(text.replace(anchor, SHIM + anchor, 1))
    return target


def run(module: Path, filters: list[str], jit: str, timeout: float) -> tuple[list[dict], list[dict]]:
    """Every selected test's record (``id``, ``status``: ok, fail, error, skip, crash), and the
    decorator's warnings, under ``jit`` ("cmatmul" or "jax")."""
    env = dict(os.environ, SURVEY_JIT=jit, JAX_TRACEBACK_FILTERING="off",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    records, warned, start, count = [], [], 0, None
    while count is None or start < count:
        code = CHILD.replace("MODULE", repr(str(module))).replace("FILTERS", repr(filters))
        child = subprocess.Popen([sys.executable, "-c", code.replace("START", str(start))], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=env, cwd=module.parent)
        current, deadline = None, [time.time() + timeout]
        watchdog = threading.Thread(target=_kill_when_late, args=(child, deadline), daemon=True)
        watchdog.start()
        for line in child.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            deadline[0] = time.time() + timeout
            if "count" in row:
                count = row["count"]
            elif "start" in row:
                current = row
            elif "warning" in row:
                warned.append({"id": current["id"], "message": row["message"]})
            elif "end" in row:
                records.append({"id": current["id"], "status": row["status"], "s": row["s"], "why": row["why"]})
                current = None
        code = child.wait()
        if current is None:
            break
        records.append({"id": current["id"], "status": "crash", "s": None, "why": f"exit {code}"})
        start = current["start"] + 1
    return records, warned


def _kill_when_late(child: subprocess.Popen, deadline: list[float]) -> None:
    """Kill ``child`` once ``deadline[0]`` (moved on by every line it prints) has passed."""
    while child.poll() is None:
        if time.time() > deadline[0]:
            child.kill()
            return
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_module", type=Path, help="a jax test module, e.g. jax/tests/shard_map_test.py")
    parser.add_argument("--filter", action="append", default=[],
                        help="run only tests whose id contains this (repeatable)")
    parser.add_argument("--out", type=Path, help="write every record (JSON lines) here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a test may take before it counts as a crash")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        module = patched_copy(args.test_module, Path(folder))
        records, warned = run(module, args.filter or [""], "cmatmul", args.timeout)
        failing = [r["id"] for r in records if r["status"] in ("fail", "error", "crash")]
        again = {r["id"]: r["status"] for r in run(module, failing, "jax", args.timeout)[0]} if failing else {}
    only_ours = [r for r in records if r["id"] in failing and again.get(r["id"]) in ("ok", "skip")]
    if args.out:
        with args.out.open("w") as out:
            for r in records:
                out.write(json.dumps(dict(r, under_jax_jit=again.get(r["id"]))) + "\n")
    statuses = {s: sum(r["status"] == s for r in records) for s in ("ok", "skip", "fail", "error", "crash")}
    print(f"{len(records)} tests under cmatmul_pass.jit(check=True): " + ", ".join(f"{n} {s}" for s, n in statuses.items()))
    print(f"{len(failing) - len(only_ours)} of the {len(failing)} failing also fail under jax.jit")
    for r in only_ours:
        print(f"FAILS ONLY UNDER cmatmul_pass.jit: {r['id']} ({r['status']}): {r['why'].strip().splitlines()[-1:]}")
    for w in warned:
        print(f"warning in {w['id']}: {w['message']}")
    return 1 if only_ours else 0


if __name__ == "__main__":
    sys.exit(main())
