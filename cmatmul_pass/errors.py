"""Typed errors.  Each message is one line a user can act on."""

from __future__ import annotations


class CmatmulError(Exception):
    """Base class of every error cmatmul_pass raises on purpose."""


class InputError(CmatmulError):
    """The input cannot be read as a StableHLO module.

    ``str(err)`` is ``"<source>:<line>:<col>: <message>"`` (line/col where MLIR gave
    one), suitable as the CLI's one-line diagnostic.
    """

    def __init__(self, source: str, message: str, line: int | None = None, col: int | None = None):
        self.source = source
        self.message = " ".join(message.split())  # one line, whatever MLIR said
        self.line = line
        self.col = col
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}"
            if self.col is not None:
                where += f":{self.col}"
        return f"{where}: {self.message}"


class InternalError(CmatmulError):
    """The pass produced IR that does not verify: a bug in cmatmul_pass, never the user's."""


class ExecutionError(CmatmulError):
    """A module could not be compiled or run for the numerics check."""


class NumericsMismatch(CmatmulError):
    """``cmatmul_pass.jit(check=True)``: the rewritten program's outputs differ from the original's."""


class Decline(Exception):
    """A candidate site the pass leaves unchanged.

    ``code`` is a stable identifier (tests and tools match on it); ``message`` is the
    sentence the report and ``explain`` show.
    """

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")
