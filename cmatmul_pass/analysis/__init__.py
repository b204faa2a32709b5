"""Facts about a module's values that the rewriters ask, each computed once per module.

:mod:`.variance`: which values are the same on every device of a collective's groups.
"""
