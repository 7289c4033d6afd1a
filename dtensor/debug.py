"""Debug helpers: count the collectives the runtime issues, and show layouts.

- ``CommCounter``: counts and bytes per collective kind (``"all_gather"``,
  ``"all_reduce"``, ``"broadcast"``), as plain strings.
- ``CommDebugMode``: the API of ``torch.distributed.tensor.debug.CommDebugMode``
  (``get_comm_counts()``, ``get_total_counts()``, ``comm_module_counts``), plus
  bytes moved (``get_comm_bytes()``, ``get_total_bytes()``).
- ``visualize_sharding(dt)``: a table of which rank holds which block.

Keys of ``CommDebugMode`` counts are PyTorch's functional-collective op
packets, as in PyTorch, so code written for it reads ours unchanged:

=========================  ===============================================
our kind                   key (``funcol = torch.ops.c10d_functional``)
=========================  ===============================================
``"all_gather"``           ``funcol.all_gather_into_tensor``
``"all_reduce"``           ``funcol.all_reduce``
``"broadcast"``            ``funcol.broadcast``
``"reduce_scatter"``       ``funcol.reduce_scatter_tensor``
``"all_to_all"``           ``funcol.all_to_all_single``
``"scatter"``              ``torch.ops.c10d.scatter_``
=========================  ===============================================

The returned dicts also accept our kind strings as keys (``counts["all_gather"]``)
and give 0 for absent keys. Bytes are those of the buffer each collective fills
on this rank: an all-reduce or broadcast of ``t`` moves ``t.nbytes``, an
all-gather over ``n`` ranks ``n * t.nbytes``. Only the runtime's own
collectives are counted (not ``torch.distributed`` calls made by user code).

Example:
    >>> with CommDebugMode() as comm:
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> comm.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor]
    1
    >>> comm.get_comm_bytes()["all_gather"]      # 2 ranks, 8 float32 each
    64
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Any

import torch

from dtensor import _comm, _rank_state
from dtensor._module_tracker import ModuleTracker, in_backward
from dtensor.mesh import unravel

__all__ = ["CommCounter", "CommDebugMode", "sharding_table", "visualize_sharding"]


class CommCounter:
    """Counts collectives (and their bytes) by kind.

    Example:
        >>> with CommCounter() as c:
        ...     y = x.redistribute(mesh, [Replicate()])
        >>> c.counts, c.total, c.bytes
        ({'all_gather': 1}, 1, {'all_gather': 64})
    """

    def __init__(self) -> None:
        self._counter: Counter = Counter()
        self._bytes: Counter = Counter()

    def record(self, kind: str, nbytes: int) -> None:
        self._counter[kind] += 1
        self._bytes[kind] += int(nbytes)

    def __enter__(self) -> CommCounter:
        # A rank thread of an in-process world that has not touched a DTensor
        # yet is made a rank now, so the listener is its rank's (not the
        # process's, which would never hear that rank's collectives).
        _rank_state.auto_enter()
        _comm.push_counter(self)
        return self

    def __exit__(self, *exc) -> None:
        _comm.pop_counter(self)

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counter)

    @property
    def total(self) -> int:
        return sum(self._counter.values())

    @property
    def bytes(self) -> dict[str, int]:
        """Bytes moved per kind (see the module docstring for what counts)."""
        return dict(self._bytes)

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes.values())

    def __getitem__(self, kind: str) -> int:
        return self._counter[kind]


def _kind_keys() -> dict[str, Any]:
    f = torch.ops.c10d_functional
    return {
        "all_gather": f.all_gather_into_tensor,
        "all_reduce": f.all_reduce,
        "broadcast": f.broadcast,
        "reduce_scatter": f.reduce_scatter_tensor,
        # distribute_tensor's scatter: PyTorch's mode counts its c10d op so
        "scatter": torch.ops.c10d.scatter_,
        "all_to_all": f.all_to_all_single,
    }


class _Counts(defaultdict):
    """Counts keyed by torch's op packets; our kind strings work as keys too."""

    def __init__(self) -> None:
        super().__init__(int)

    def __missing__(self, key):
        alias = _kind_keys().get(key) if isinstance(key, str) else None
        if alias is not None and alias in self:
            return self[alias]
        return 0  # like torch's defaultdict, without inserting the key

    def get(self, key, default=None):
        if key in self:
            return self[key]
        alias = _kind_keys().get(key) if isinstance(key, str) else None
        return self[alias] if alias is not None and alias in self else default


class CommDebugMode:
    """Counts the runtime's collectives, by kind and by module, with bytes.

    Compatible with ``torch.distributed.tensor.debug.CommDebugMode``:
    ``get_comm_counts()``, ``get_total_counts()``, and ``comm_module_counts``
    (``{module fqn: {"forward": {key: n}, "backward": {key: n}}}`` with a
    ``"Global"`` entry; a collective counts for its module and every parent).
    Collectives are attributed as PyTorch does (``dtensor/_module_tracker.py``):
    a style's output hook counts for its module, backward collectives under
    ``"backward"`` for the module whose gradient is being computed, and
    collectives outside any module (an optimizer step) for ``"Global"``.
    Counting restarts at each ``with``.

    Example:
        >>> with CommDebugMode() as comm:
        ...     model(x).sum().backward()
        >>> comm.get_total_counts(), comm.get_total_bytes()
        >>> comm.comm_module_counts["MLP.net1"]["forward"]
        >>> print(comm.generate_comm_debug_tracing_table())
    """

    def __init__(self) -> None:
        self.comm_counts: _Counts = _Counts()
        self.comm_bytes: _Counts = _Counts()
        self.comm_module_counts: dict[str, dict[str, _Counts]] = {}
        self.comm_module_bytes: dict[str, dict[str, _Counts]] = {}
        self._parameters: dict[str, dict[str, Any]] = {}
        self._sharding: dict[str, Any] = {}
        self._tracker = None

    # Recording -------------------------------------------------------------------
    def record(self, kind: str, nbytes: int) -> None:
        key = _kind_keys().get(kind, kind)
        self.comm_counts[key] += 1
        self.comm_bytes[key] += int(nbytes)
        tracker = self._tracker
        phase = "backward" if in_backward() else "forward"
        modules = tracker.modules() if tracker is not None else {"Global"}
        for name in modules:
            for table, amount in ((self.comm_module_counts, 1),
                                  (self.comm_module_bytes, int(nbytes))):
                entry = table.get(name)
                if entry is None:
                    entry = table[name] = {"forward": _Counts(), "backward": _Counts()}
                entry[phase][key] += amount

    def __enter__(self) -> CommDebugMode:
        self.comm_counts.clear()
        self.comm_bytes.clear()
        self.comm_module_counts.clear()
        self.comm_module_bytes.clear()
        self._parameters.clear()
        self._sharding.clear()
        for table in (self.comm_module_counts, self.comm_module_bytes):
            table["Global"] = {"forward": _Counts(), "backward": _Counts()}
        self._tracker = ModuleTracker(on_forward=self._on_forward)
        self._tracker.__enter__()
        _rank_state.auto_enter()  # see CommCounter.__enter__
        _comm.push_counter(self)
        return self

    def __exit__(self, *exc) -> None:
        _comm.pop_counter(self)
        self._tracker.__exit__(*exc)

    def _on_forward(self, name: str, module) -> None:
        from dtensor.tensor import DTensor

        for pname, p in module.named_parameters(recurse=False):
            self._parameters.setdefault(name, {})[pname] = p.data
            if isinstance(p.data, DTensor):
                self._sharding[f"{name}.{pname}"] = p.data.placements

    # Reading ---------------------------------------------------------------------
    def get_comm_counts(self) -> dict[Any, int]:
        """Collectives per key (torch's op packet; our kind strings also work)."""
        return self.comm_counts

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_comm_bytes(self) -> dict[Any, int]:
        """Bytes moved per key, keyed like ``get_comm_counts()``."""
        return self.comm_bytes

    def get_total_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """``{module fqn: {parameter name: parameter data}}`` of modules run inside."""
        return self._parameters

    def get_sharding_info(self) -> dict[str, Any]:
        """``{"module.param": placements}`` of the DTensor parameters of modules run inside."""
        return self._sharding

    def generate_comm_debug_tracing_table(self, noise_level: int = 0) -> str:
        """Per module and phase: each collective's count and bytes, indented by depth."""
        names = {v: k for k, v in _kind_keys().items()}
        lines = []
        for module in sorted(self.comm_module_counts, key=lambda m: (m != "Global", m)):
            depth = 0 if module == "Global" else module.count(".") + 1
            lines.append("  " * depth + module)
            for phase in ("forward", "backward"):
                counts = self.comm_module_counts[module][phase]
                sizes = self.comm_module_bytes[module][phase]
                for key, n in counts.items():
                    lines.append(
                        "  " * (depth + 1)
                        + f"{phase}: {names.get(key, key)} x{n}, {sizes[key]} bytes"
                    )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"CommDebugMode(get_total_counts()={self.get_total_counts()}, "
            f"get_total_bytes()={self.get_total_bytes()})"
        )


# visualize_sharding ----------------------------------------------------------------
def _span(start: int, length: int) -> str:
    return f"{start}:{start + length}"


def sharding_table(dt) -> str:
    """The table ``visualize_sharding`` prints, as a string (pure: no collectives).

    One cell per distinct block: rows and columns are index ranges
    (half-open, ``start:stop``) of the global tensor, cells list the global
    ranks holding that block. A 1-D tensor is one row. Ranks whose block is
    empty (uneven shards) are listed below the table.
    """
    from dtensor.errors import ShardingError

    spec = dt._spec
    if spec.ndim not in (1, 2):
        raise ShardingError(
            f"visualize_sharding: supports 1-D and 2-D DTensors, got {spec.ndim}-D "
            f"{spec}; view it as 2-D first, e.g. dt.flatten(0, -2)"
        )
    mesh = spec.mesh
    cells: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    empty = []
    for flat, rank in enumerate(mesh.ranks):
        coord = unravel(flat, mesh.shape)
        size, offset = spec.local_block(coord)
        if spec.ndim == 1:
            size, offset = (1, *size), (0, *offset)
        if 0 in size:
            empty.append(rank)
            continue
        key = ((offset[0], size[0]), (offset[1], size[1]))
        cells.setdefault(key, []).append(rank)
    rows = sorted({k[0] for k in cells})
    cols = sorted({k[1] for k in cells})
    row_label = (lambda r: "") if spec.ndim == 1 else (lambda r: f"rows {_span(*r)}")
    header = [""] + [f"cols {_span(*c)}" if spec.ndim == 2 else f"{_span(*c)}" for c in cols]
    table = [header]
    for r in rows:
        line = [row_label(r)]
        for c in cols:
            ranks = cells.get((r, c), [])
            line.append(("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
                        if ranks else "-")
        table.append(line)
    if spec.ndim == 1:  # no row labels
        table = [line[1:] for line in table]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    out = [f"{spec} on {mesh!r}"]
    out += ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
            for line in table]
    partial = [f"axis {a}: {p}" for a, p in enumerate(spec.placements) if p.is_partial()]
    if partial:
        out.append("partial (cells hold pieces still to reduce): " + ", ".join(partial))
    if empty:
        out.append("empty blocks (uneven shards): ranks " + ",".join(map(str, empty)))
    return "\n".join(out)


def visualize_sharding(dt, header: str = "", *, all_ranks: bool = False, file=None) -> str | None:
    """Print which rank holds which block of a 1-D or 2-D DTensor.

    Call it on every rank, like PyTorch's: by default only the mesh's first
    member (coordinate 0 on every axis) prints; ``all_ranks=True`` prints on
    every member. Ranks outside the mesh print nothing. No communication.
    Returns the table on the ranks that print, else ``None``.

    Example (``[Shard(0), Shard(1)]`` of a 4x6 tensor on a 2x2 mesh)::

        f32[4,6](S(0), S(1)) on DeviceMesh('cpu', [[0, 1], [2, 3]])
                  cols 0:3  cols 3:6
        rows 0:2  rank 0    rank 1
        rows 2:4  rank 2    rank 3
    """
    coord = dt._spec.mesh.get_coordinate()
    text = sharding_table(dt)  # validated on every rank, outsiders included
    if coord is None or not (all_ranks or not any(coord)):
        return None
    if header:
        text = f"{header}\n{text}"
    print(text, file=file or sys.stdout)
    return text
