"""Which modules are units, and which unit holds each parameter (pure: module trees only).

    unit_modules = choose_units(model, units=None, min_numel=2**20)    # root first
    groups = group_parameters(model, unit_modules)    # per unit: [ParamRef(name, param, owners)]
    layout = flat_layout([r.param.numel() for r in groups[0]], world_size=2)
    layout.pieces(rank)      # [Piece(j, a, b, at)]: elements [a, b) of parameter j, at `at`

A unit is the set of parameters gathered and freed together. Its parameters are laid end to end
in one flat tensor, each starting on a multiple of ALIGN elements, padded to world_size equal
parts; rank r keeps part r (its shard). The cuts then fall on multiples of ALIGN inside every
parameter, so a shard's vectorised loops see the same element alignment as the whole tensor's
(ZeRO-1's reason, optim/zero.py), and every part has the same size, as all_gather_single and
reduce_scatter_single need.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn

from ddptrain.optim.partition import ALIGN

# The size policy's default: a submodule holding at least this many parameters not already in a
# smaller unit becomes a unit (4 MiB of float32): big enough that a collective's fixed latency
# is small beside its transfer, small enough that one unit is a small part of a large model.
DEFAULT_UNIT_MIN_NUMEL = 2**20

# Containers without a forward of their own: hooks on them never run, so they cannot be units.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class Piece(NamedTuple):
    """Elements [a, b) of parameter j (flat, in memory order), at offset `at` of a shard."""

    j: int
    a: int
    b: int
    at: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a unit lies in its flat tensor, and each rank's part of it."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    shard_numel: int
    world_size: int

    @property
    def padded_numel(self) -> int:
        """Elements of the whole flat tensor: world_size parts of shard_numel."""
        return self.shard_numel * self.world_size

    def pieces(self, rank: int) -> list[Piece]:
        """Every parameter's piece in rank's part, in parameter order (a == b: none of it)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for j, (start, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a = min(max(start, lo), hi)
            b = max(min(start + n, hi), a)
            out.append(Piece(j, a - start if b > a else 0, b - start if b > a else 0, a - lo))
        return out

    def gaps(self, rank: int) -> list[tuple[int, int]]:
        """The ranges of rank's part that hold no parameter (alignment and end padding)."""
        covered = sorted((p.at, p.at + p.b - p.a) for p in self.pieces(rank) if p.b > p.a)
        gaps, end = [], 0
        for start, stop in covered:
            if start > end:
                gaps.append((end, start))
            end = max(end, stop)
        if end < self.shard_numel:
            gaps.append((end, self.shard_numel))
        return gaps


def flat_layout(numels: Sequence[int], world_size: int, align: int = ALIGN) -> FlatLayout:
    """Parameters end to end, each from a multiple of `align`, cut into world_size equal parts
    whose size is a multiple of `align`."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end += -(-n // align) * align
    shard_numel = -(-end // (world_size * align)) * align
    return FlatLayout(tuple(numels), tuple(offsets), shard_numel, world_size)


@dataclass
class ParamRef:
    """One parameter of the model and every (module, attribute name) that holds it."""

    name: str  # as in model.named_parameters()
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def choose_units(
    root: nn.Module,
    units: Iterable[nn.Module | type[nn.Module]] | None,
    min_numel: int = DEFAULT_UNIT_MIN_NUMEL,
) -> list[nn.Module]:
    """The unit modules in pre-order, root first: the modules (or every module of the types)
    named in `units`, else the size policy."""
    everything = list(root.modules())
    if units is None:
        picked = _by_size(root, min_numel)
    else:
        picked = set()
        for item in units:
            if (
                isinstance(item, type)
                and issubclass(item, CONTAINERS)
                or isinstance(item, CONTAINERS)
            ):
                raise ValueError(
                    f"units cannot name {item!r}: a container's forward is never called, so it "
                    "is never gathered; name the modules inside it (or their class) instead"
                )
            if isinstance(item, type) and issubclass(item, nn.Module):
                picked |= {id(m) for m in everything if isinstance(m, item)}
            elif isinstance(item, nn.Module) and any(m is item for m in everything):
                picked.add(id(item))
            else:
                raise ValueError(
                    f"units must name submodules of the wrapped module or module classes; got "
                    f"{item!r}, which is neither"
                )
    return [root] + [m for m in everything if id(m) in picked and m is not root]


def _by_size(root: nn.Module, min_numel: int) -> set[int]:
    """FSDP's size-based policy: bottom up, a module whose parameters not yet in a unit number at
    least min_numel becomes a unit; a container's count passes on to the module holding it."""
    picked: set[int] = set()
    seen: set[int] = set()

    def unclaimed(m: nn.Module) -> int:
        if id(m) in seen:
            return 0
        seen.add(id(m))
        n = sum(p.numel() for _, p in m.named_parameters(recurse=False))
        n += sum(unclaimed(child) for child in m.children())
        if m is not root and n >= min_numel and not isinstance(m, CONTAINERS):
            picked.add(id(m))
            return 0
        return n

    unclaimed(root)
    return picked


def group_parameters(root: nn.Module, unit_modules: list[nn.Module]) -> list[list[ParamRef]]:
    """Each unit's parameters, in named_parameters() order. A parameter goes to the innermost
    unit whose module contains every module holding it: a weight tied across two units belongs
    to the unit around both, so it is gathered while either uses it."""
    index = {id(m): u for u, m in enumerate(unit_modules)}
    parent: list[int | None] = [None] * len(unit_modules)
    unit_of: dict[int, int] = {}

    def visit(m: nn.Module, current: int) -> None:
        if id(m) in unit_of:
            return  # a module reused in two places belongs where it was first seen
        if id(m) in index and m is not root:
            parent[index[id(m)]] = current
            current = index[id(m)]
        unit_of[id(m)] = current
        for child in m.children():
            visit(child, current)

    visit(root, 0)
    refs: dict[int, ParamRef] = {}
    holders: dict[int, set[int]] = {}
    for prefix, m in root.named_modules():
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
            ref = refs.setdefault(id(p), ParamRef(f"{prefix}.{name}" if prefix else name, p))
            ref.owners.append((m, name))
            holders.setdefault(id(p), set()).add(unit_of[id(m)])
    groups: list[list[ParamRef]] = [[] for _ in unit_modules]
    for key, ref in refs.items():
        groups[_common_unit(holders[key], parent)].append(ref)
    return groups


def _common_unit(units: set[int], parent: list[int | None]) -> int:
    """The innermost unit that is (or contains) every unit in `units`."""

    def chain(u: int | None) -> list[int]:
        out = []
        while u is not None:
            out.append(u)
            u = parent[u]
        return out

    chains = [chain(u) for u in sorted(units)]
    shared = set(chains[0]).intersection(*chains[1:])
    return next(u for u in chains[0] if u in shared)
