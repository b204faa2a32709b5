"""Ring geometry: who holds which shard, who sends to whom.

A collective's ``replica_groups`` lists, per group, the partitions in the order their
shards are concatenated.  The ring of a group follows that order, whatever it is
(strided groups of a 2-D mesh, permuted devices): position ``k`` of a group is the
partition whose shard sits at offset ``k * shard`` of the gathered value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import Decline


@dataclass(frozen=True)
class Ring:
    groups: tuple[tuple[int, ...], ...]
    num_partitions: int

    @property
    def size(self) -> int:
        return len(self.groups[0])

    def position_table(self) -> np.ndarray:
        """``table[partition_id]`` = the partition's position in its group (uint32, the index type of the rings)."""
        table = np.zeros(self.num_partitions, dtype=np.uint32)
        for group in self.groups:
            for position, partition in enumerate(group):
                table[partition] = position
        return table

    def shift_pairs(self, shift: int) -> np.ndarray:
        """Source→target pairs sending position ``k`` to position ``k + shift`` in every group."""
        n = self.size
        pairs = [
            (group[k], group[(k + shift) % n])
            for group in self.groups
            for k in range(n)
        ]
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def ring_from_replica_groups(groups: np.ndarray, num_partitions: int) -> Ring:
    """Build a :class:`Ring`, or raise :class:`Decline` when the groups are not a partition of the devices."""
    if groups.ndim != 2 or groups.size == 0:
        raise Decline("replica_groups", f"replica_groups of shape {list(groups.shape)} are not a list of equal-size groups")
    n = groups.shape[1]
    if n < 2:
        raise Decline("ring_size_1", "every replica group has one member: nothing is communicated")
    flat = groups.reshape(-1)
    if (flat < 0).any():
        raise Decline("replica_groups", "replica_groups contain padding (-1): groups of unequal size are not rewritten")
    if (flat >= num_partitions).any():
        raise Decline(
            "replica_groups",
            f"replica_groups name partition {int(flat.max())} but the module has {num_partitions} partitions",
        )
    if sorted(flat.tolist()) != list(range(num_partitions)):
        raise Decline(
            "replica_groups",
            "replica_groups do not list every partition exactly once; the position table would be ambiguous",
        )
    return Ring(tuple(tuple(int(p) for p in g) for g in groups), num_partitions)
