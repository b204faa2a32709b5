"""Ring geometry: who holds which shard, who sends to whom.

A collective's ``replica_groups`` lists, per group, the partitions in the order their
shards are concatenated.  The ring of a group follows that order, whatever it is
(strided groups of a 2-D mesh, permuted devices): position ``k`` of a group is the
partition whose shard sits at offset ``k * shard`` of the gathered value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import Decline


@dataclass(frozen=True)
class Ring:
    groups: tuple[tuple[int, ...], ...]
    num_partitions: int
    #: shift_pairs by shift (not part of the ring's identity)
    _pairs: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

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
        """Source→target pairs sending position ``k`` to position ``k + shift`` in every group
        (read-only: a ring's permutes ask for the same few, so each is made once)."""
        made = self._pairs.get(shift)
        if made is None:
            n = self.size
            pairs = [
                (group[k], group[(k + shift) % n])
                for group in self.groups
                for k in range(n)
            ]
            made = self._pairs[shift] = np.array(pairs, dtype=np.int64).reshape(-1, 2)
            made.setflags(write=False)
        return made


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


def groups_from_mesh_axes(
    mesh_sizes: Sequence[int], device_ids: Sequence[int], axes: Sequence[tuple[int, int, int]]
) -> np.ndarray:
    """The explicit groups of a ``#stablehlo.replica_group_mesh_axes`` attribute.

    ``axes`` lists ``(mesh axis, pre_size, size)`` per axis ref, in the attribute's order; a
    whole axis is ``(axis, 1, its size)``, a sub-axis ``"a":(pre_size)size`` takes the middle
    factor when the axis is split row-major into ``pre_size x size x rest``.  A group holds the
    devices that agree on every mesh coordinate the refs leave out; a device's place in its
    group counts row-major over the refs, the first ref the most major.  ``device_ids`` (empty:
    the iota order) gives the device at each row-major mesh position.  This is how XLA
    materialises such groups (``MeshAxesReplicaGroupList``).  Raises :class:`Decline` for refs
    that do not fit the mesh.
    """
    sizes = [int(n) for n in mesh_sizes]
    total = math.prod(sizes)
    ids = np.asarray(device_ids, dtype=np.int64) if len(device_ids) else np.arange(total, dtype=np.int64)
    if len(ids) != total:
        raise Decline("replica_groups", f"the mesh lists {len(ids)} device ids for {total} positions")
    coords = np.stack(np.unravel_index(np.arange(total), sizes), axis=1) if sizes else np.zeros((1, 0), np.int64)
    for i, (axis, pre, size) in enumerate(axes):
        n = sizes[axis]
        if pre < 1 or size < 1 or n % (pre * size):
            raise Decline("replica_groups", f"sub-axis ({pre}){size} does not divide mesh axis {axis} of size {n}")
        for other, other_pre, other_size in axes[:i]:
            # two parts of one axis must be disjoint factors of its row-major split
            if other == axis and other_pre % (pre * size) and pre % (other_pre * other_size):
                raise Decline("replica_groups", f"the replica groups' mesh axes overlap (axis {axis})")
    position = np.zeros(total, dtype=np.int64)
    rest = coords.copy()
    group_size = 1
    for axis, pre, size in axes:
        n = sizes[axis]
        post = n // (pre * size)
        digit = (coords[:, axis] // post) % size
        position = position * size + digit
        rest[:, axis] -= digit * post
        group_size *= size
    keys = np.ravel_multi_index(tuple(rest.T), sizes) if sizes else np.zeros(total, np.int64)
    distinct = np.unique(keys)
    if len(distinct) * group_size != total:
        raise Decline("replica_groups", "the replica groups' mesh axes overlap")
    groups = np.full((len(distinct), group_size), -1, dtype=np.int64)
    groups[np.searchsorted(distinct, keys), position] = ids
    if (groups < 0).any():
        raise Decline("replica_groups", "the replica groups' mesh axes overlap")
    return groups
