"""One yes/no fact per value, decided from its operands' (the analyses' shared walk).

A step looks at one value and returns either the operands it still needs decided, or no
operands and the answer.  :func:`decide` runs the steps depth-first without recursion (a
chain of elementwise ops can be thousands long) and remembers every answer in ``memo``.
"""

from __future__ import annotations

from typing import Callable, Iterable

from .._jax_private import ir

Step = Callable[[ir.Value], tuple[list[ir.Value], bool]]


def decide(value: ir.Value, step: Step, memo: dict) -> bool:
    """``value``'s answer (and every answer on the way, in ``memo``)."""
    stack = [value]
    while stack:
        top = stack[-1]
        if top in memo:
            stack.pop()
            continue
        pending, answer = step(top)
        if pending:
            stack.extend(pending)
            continue
        memo[top] = answer
        stack.pop()
    return memo[value]


def all_of(values: Iterable[ir.Value], memo: dict) -> tuple[list[ir.Value], bool]:
    """A step's result that is true when every one of ``values`` is: those still undecided,
    or none and the answer."""
    values = list(values)
    pending = [v for v in values if v not in memo]
    return (pending, False) if pending else ([], all(memo[v] for v in values))
