"""All or nothing per collective: which one the pass is working on, and what the next try leaves.

The pass rewrites a module in one walk.  Two outcomes make it start again from the input,
leaving one collective as written:

- a collective moved to its matmul (sunk into a loop, hoisted into one, moved past row-wise
  ops, merged with a second stage) whose rings were then declined wherever it went (policy,
  ``min_bytes``, the cost model, another ring took the dot): the motion alone is not what the
  options asked for, so the next try does not move it (the site reports why it stayed);
- a failure while working on a collective (an exception from a matcher or a rewrite, IR that
  does not verify, a collective placed where its group may not run it alike): the next try
  leaves that collective as written, and its report entry says what failed (``pass_error``).

A collective is known across tries by its op name, its location and its occurrence among the
ops of that name and location in the order the pass meets them: two tries meet the same ops
in the same order up to the first one they treat differently, which is the one just banned.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from . import ir_utils
from ._jax_private import ir
from .errors import CmatmulError, InternalError
from .report import SiteReport

#: at most this many tries (each leaves one more collective as written) before the failure stands
MAX_TRIES = 8
MOTION, SITE = "motion", "site"
#: the site kind a collective's entry has, by op name
KINDS = {"stablehlo.all_gather": "all_gather_dot", "stablehlo.reduce_scatter": "dot_reduce_scatter",
         "stablehlo.all_reduce": "dot_all_reduce", "stablehlo.all_to_all": "all_to_all_chunk"}


@dataclass
class Bans:
    """What the tries so far leave as written: key -> (MOTION or SITE, why)."""

    by_key: dict[tuple, tuple[str, str]] = field(default_factory=dict)

    def add(self, key: tuple, what: str, why: str) -> None:
        self.by_key[key] = (what, why)


class Attempts:
    """One try's bookkeeping: keys of the collectives met, the one being worked on, the moved
    sites' report entries by the collective they were moved from."""

    def __init__(self, source: str, bans: Bans):
        self.source = source
        self.bans = bans
        self._keys: dict[ir.Operation, tuple] = {}
        self._seen: Counter = Counter()
        self._current: list[tuple] = []
        self._moved: dict[tuple, list[SiteReport]] = {}

    def key(self, op: ir.OpView | ir.Operation) -> tuple:
        op = op.operation
        key = self._keys.get(op)
        if key is None:
            where = (op.name, ir_utils.render_location(op.location, self.source))
            self._seen[where] += 1
            key = self._keys[op] = (*where, self._seen[where])
        return key

    @contextlib.contextmanager
    def on(self, op: ir.OpView | ir.Operation):
        """Work on ``op``'s collective: a failure inside is an InternalError naming its key."""
        key = self.key(op)
        self._current.append(key)
        try:
            yield key
        except InternalError as failure:
            if getattr(failure, "key", None) is None:
                failure.key = key
            raise
        except CmatmulError:
            raise  # the input's or the options' fault, said as such
        except Exception as exc:  # noqa: BLE001 - a bug of the pass: leave this collective as written
            failure = InternalError(
                f"working on the {key[0].split('.')[-1]} at {key[1]} failed (a cmatmul_pass bug): "
                f"{type(exc).__name__}: {' '.join(str(exc).split())}")
            failure.key = key
            raise failure from exc
        finally:
            self._current.pop()

    @contextlib.contextmanager
    def on_behalf(self, key: tuple):
        """The sites made inside are the motion of the collective known by ``key`` (a stack's
        gather, worked on earlier), as far as :meth:`moved` goes."""
        self._current.append(key)
        try:
            yield
        finally:
            self._current.pop()

    def left(self, op: ir.OpView | ir.Operation, function: str) -> SiteReport | None:
        """The report entry of ``op``'s collective when an earlier try failed on it (it stays as
        written), else None."""
        key = self.key(op)
        ban = self.bans.by_key.get(key)
        if ban is None or ban[0] != SITE:
            return None
        return SiteReport(kind=KINDS.get(key[0], key[0]), location=key[1], function=function, rewritten=False,
                          reason_code="pass_error", reason=f"left as written: {ban[1]}")

    def may_move(self, op: ir.OpView | ir.Operation) -> str | None:
        """None where ``op``'s collective may be moved; else why not (an earlier try moved it and
        no ring formed where it went)."""
        ban = self.bans.by_key.get(self.key(op))
        return ban[1] if ban is not None and ban[0] == MOTION else None

    def moved(self, entry: SiteReport) -> None:
        """``entry`` is a site the current collective was moved to."""
        if self._current:
            self._moved.setdefault(self._current[-1], []).append(entry)

    def undone(self) -> dict[tuple, str]:
        """The motions none of whose sites was rewritten (key -> what their sites said)."""
        return {key: "where it would go, no ring formed: " +
                "; ".join(dict.fromkeys(f"{e.reason} [{e.reason_code}]" for e in entries))
                for key, entries in self._moved.items() if not any(e.rewritten for e in entries)}
