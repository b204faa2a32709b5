#!/usr/bin/env python
"""Does the pass still give the same output?  Snapshot every output, then compare byte for byte.

    python tools/same_output.py save DIR     # the outputs of the pass as it is now, into DIR
    python tools/same_output.py check DIR    # the same outputs again, compared with DIR's
    SAME_OUTPUT_PACKAGE=FOLDER python tools/same_output.py save DIR   # FOLDER/cmatmul_pass's outputs

(Save and check with the same tools/: the bench models' locations name its lines and its path.
So FOLDER holds only the package, say a symlink to another checkout's ``cmatmul_pass``: a whole
checkout there, ``git worktree add`` say, would lend its tools/ too, and every output through
``cmatmul_pass.jit`` would differ by that path.)

Outputs: for every ``hlo_samples/*.mlir`` under a few option sets, and for the bench models
(``tools.bench.MODELS``) at L = 1, 4, 8, 32 on both paths (the text path, ``rewrite`` on
``lowered.as_text()``, and ``cmatmul_pass.jit``'s, ``decorator.rewrite_lowered``): the
rewritten module's text without and with locations, and the report's JSON.  A performance
change must leave every one byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# the models are sized for a CPU, far too small for the cost model to predict a ring faster on an
# H100: they are measured under policy "all", every ring built
os.environ.setdefault("CMATMUL_PASS_POLICY", "all")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if os.environ.get("SAME_OUTPUT_PACKAGE"):  # a folder holding another copy of cmatmul_pass (the one before a change)
    sys.path.insert(0, os.environ["SAME_OUTPUT_PACKAGE"])

import cmatmul_pass  # noqa: E402
from cmatmul_pass import ir_utils  # noqa: E402
from cmatmul_pass.decorator import rewrite_lowered  # noqa: E402
from cmatmul_pass.errors import InputError  # noqa: E402
from cmatmul_pass.pipeline import Options  # noqa: E402

SAMPLE_OPTIONS = {
    "default": Options(),
    "auto": Options(policy="auto"),
    "bidi": Options(variant="bidi"),
    "chunk": Options(all_reduce="chunk"),
    "noshare": Options(share_rings=False),
}
MODEL_OPTIONS = {"default": Options(), "auto": Options(policy="auto"), "unroll2": Options(variant="unroll2")}
LAYERS = (1, 4, 8, 32)


def _outputs(result) -> dict[str, bytes]:
    module = result.module
    return {
        "text": ir_utils.print_module(module).encode(),
        "debug": ir_utils.print_module(module, debug_info=True).encode(),
        "report": result.report.to_json().encode(),
    }


def outputs(models: bool = True):
    """(name, {kind: bytes}) for every output checked."""
    for path in sorted((ROOT / "hlo_samples").glob("*.mlir")):
        text = path.read_text()
        for label, options in SAMPLE_OPTIONS.items():
            try:
                result = cmatmul_pass.rewrite(text, options, source=path.name)
            except InputError as exc:
                yield f"sample.{path.stem}.{label}", {"error": str(exc).encode()}
                continue
            yield f"sample.{path.stem}.{label}", _outputs(result)
    if not models:
        return
    from tools import bench

    for model, make in bench.MODELS.items():
        for layers in LAYERS:
            fn, args = make(layers)
            lowered = fn.lower(*args)
            text = lowered.as_text()
            for label, options in MODEL_OPTIONS.items():
                if label != "default" and layers not in (4, 32):
                    continue
                yield f"{model}.L{layers}.{label}.text", _outputs(cmatmul_pass.rewrite(text, options, source="bench"))
                yield f"{model}.L{layers}.{label}.jit", _outputs(rewrite_lowered(lowered, options, "bench"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("save", "check"))
    parser.add_argument("dir")
    parser.add_argument("--no-models", action="store_true", help="the samples only")
    args = parser.parse_args(argv)
    print(f"cmatmul_pass from {Path(cmatmul_pass.__file__).parent}", flush=True)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    differ = checked = 0
    for name, files in outputs(not args.no_models):
        for kind, data in files.items():
            path = out / f"{name}.{kind}"
            if args.mode == "save":
                path.write_bytes(data)
                continue
            checked += 1
            if not path.exists() or path.read_bytes() != data:
                differ += 1
                print(f"DIFFERS: {path.name} ({hashlib.sha1(data).hexdigest()[:10]})", flush=True)
                (out / "new").mkdir(exist_ok=True)
                (out / "new" / path.name).write_bytes(data)
    if args.mode == "check":
        print(f"{checked} outputs checked, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
