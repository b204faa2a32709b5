"""Facts about a module's values that the rewriters ask, each computed once per module.

:mod:`.variance`: which values are the same on every device of a collective's groups.
:mod:`.slack`: whether a collective's operand is ready early, and what compute could hide it.
:mod:`.dataflow`: the depth-first walk both decide their per-value facts with.
"""
