"""Finders: walk a module, return typed site records (or declines with reasons).

Nothing here mutates IR.  Each ``find_*`` returns one record per candidate
collective: a site the rewriter can apply, or a :class:`DeclinedSite` saying why it
stays as it is.  ``match_*`` matches one collective against the IR as it is now
(the pipeline matches each site just before rewriting it, so earlier rewrites are
seen).
"""

from .all_gather import (
    ALL_GATHER_DOT,
    AllGatherSite,
    Consumer,
    all_gathers,
    find_all_gather_dot,
    match_all_gather,
)
from .common import FULLY_MANUAL, DeclinedSite, ManualRegion, ModuleInfo, manual_region
from .reduce_scatter import (
    DOT_REDUCE_SCATTER,
    ReduceScatterSite,
    Term,
    find_dot_reduce_scatter,
    match_reduce_scatter,
    reduce_scatters,
    region_is_sum,
)

Site = AllGatherSite | ReduceScatterSite | DeclinedSite

__all__ = [
    "ALL_GATHER_DOT",
    "DOT_REDUCE_SCATTER",
    "FULLY_MANUAL",
    "AllGatherSite",
    "Consumer",
    "DeclinedSite",
    "ManualRegion",
    "ModuleInfo",
    "ReduceScatterSite",
    "Site",
    "Term",
    "all_gathers",
    "find_all_gather_dot",
    "find_dot_reduce_scatter",
    "manual_region",
    "match_all_gather",
    "match_reduce_scatter",
    "reduce_scatters",
    "region_is_sum",
]
