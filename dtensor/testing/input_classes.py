"""Input classes of a fuzzing example, in DTensor's terms: mesh shape,
placements, dtype, op and size (``empty`` / ``scalar`` / ``uneven`` /
``even``).

The property suite's conftest hands this to the test service through its
``pytest_launch_classify`` hook; the service itself knows no DTensor names.
Values are read by duck typing (a ``MeshLayout``/``DeviceMesh``-like value, a
tuple of ``Shard``/``Replicate``/``Partial``), so placements of either
implementation (``--dtensor-impl``) are classified alike.

Example::

    classify([("layout", MeshLayout((2, 2), (0, 1, 2, 3))),
              ("x", torch.zeros(3, 5)), ("ps", (Shard(1), Replicate()))], op="abs")
    # {"dtype": "float32", "mesh": "2x2", "placements": "(S(1), R)",
    #  "op": "abs", "size": "uneven"}
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["classify"]

PLACEMENT_TYPES = {"Shard", "Replicate", "Partial", "_StridedShard", "StridedShard"}


def classify(values: list[tuple[str, Any]], op: str = "") -> dict[str, str]:
    """Input classes of one example from its ``(label, value)`` draws."""
    found: dict[str, str] = {}
    shapes: list[tuple[int, ...]] = []
    meshes: list[tuple[int, ...]] = []
    places: list[tuple[Any, ...]] = []

    def walk(v: Any, depth: int) -> None:
        tname = type(v).__name__
        if hasattr(v, "dtype") and hasattr(v, "shape") and hasattr(v, "numel"):
            found.setdefault("dtype", str(v.dtype).removeprefix("torch."))
            shapes.append(tuple(v.shape))
            return
        if tname == "dtype" and str(v).startswith("torch."):
            found.setdefault("dtype", str(v).removeprefix("torch."))
            return
        if tname in ("MeshLayout", "DeviceMesh") or (
                hasattr(v, "ranks") and isinstance(getattr(v, "shape", None), tuple)):
            shape = getattr(v, "shape", None)
            if not isinstance(shape, tuple) and hasattr(v, "mesh"):
                shape = tuple(v.mesh.shape)
            if isinstance(shape, tuple):
                meshes.append(tuple(int(s) for s in shape))
            return
        if isinstance(v, (tuple, list)) and v and all(
                type(p).__name__ in PLACEMENT_TYPES for p in v):
            places.append(tuple(v))
            return
        if depth >= 3:
            return
        if isinstance(v, (tuple, list)):
            if v and all(isinstance(x, int) for x in v) and len(v) <= 4:
                shapes.append(tuple(v))
                return
            for x in list(v)[:16]:
                walk(x, depth + 1)
        elif isinstance(v, dict):
            for x in list(v.values())[:16]:
                walk(x, depth + 1)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name, None), depth + 1)

    for label, v in values:
        if label == "op" and isinstance(v, str):
            op = op or v
        walk(v, 0)
    if meshes:
        found["mesh"] = "x".join(map(str, meshes[0])) or "()"
    if places:
        found["placements"] = "(" + ", ".join(_compact(p) for p in places[0]) + ")"
    if op:
        found["op"] = op
    found["size"] = _size_class(shapes, meshes[0] if meshes else None,
                                places[0] if places else None)
    return found


def _compact(p: Any) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"S({getattr(p, 'dim', '?')})"
    if name == "Replicate":
        return "R"
    if name == "Partial":
        return f"P({getattr(p, 'reduce_op', 'sum')})"
    return str(p)


def _size_class(shapes: list[tuple[int, ...]], mesh: tuple[int, ...] | None,
                places: tuple[Any, ...] | None) -> str:
    if any(0 in s for s in shapes):
        return "empty"
    if shapes and all(s == () for s in shapes):
        return "scalar"
    if mesh and places and shapes:
        shape = shapes[0]
        for axis, p in enumerate(places):
            d = getattr(p, "dim", None)
            if type(p).__name__ == "Shard" and isinstance(d, int) and axis < len(mesh):
                if -len(shape) <= d < len(shape) and shape[d] % mesh[axis]:
                    return "uneven"
    return "even" if shapes else "none"
