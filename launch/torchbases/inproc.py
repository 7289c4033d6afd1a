"""An empty c10d world for the in-process bases inside a rank.

``MultiThreadedTestCase`` installs PyTorch's threaded process group in
place of c10d's world, and the ``LocalDTensor*`` bases join a ``fake``
default group of their own: inside a rank (torchrun) both would meet the
rank's real default group (``init_process_group`` refuses a second one, a
destroy would end the world). While such a test's setup, call and teardown
run, c10d holds a world of its own, empty at first and kept between the
tests of the session (a continuous local base keeps its fake group for the
class); the rank's world is put back after each phase.

PyTorch's DTensor caches sharding decisions by mesh shape, and a cached
result carries the mesh it was made on: a fake 4-rank mesh and the rank's
real 4-rank mesh compare equal, so a cached spec would name the other
world's groups. Those caches are emptied whenever c10d changes worlds here.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_own = None  # the in-process tests' c10d state, between phases


@contextlib.contextmanager
def own_world() -> Iterator[None]:
    """Run the body with c10d holding the in-process tests' own world."""
    from launch.rank.subworld import NAME_BASE, _capture, _install, _State

    global _own
    if _own is None:
        _own = _State(None, {}, 97 * NAME_BASE, None, None)
    rank_world = _capture()
    hook = sys.excepthook  # init_process_group wraps it; keep the service's
    _install(_own)
    forget_dtensor_caches()
    try:
        yield
    finally:
        sys.excepthook = hook
        _own = _capture()
        _install(rank_world)
        forget_dtensor_caches()


def forget_dtensor_caches() -> None:
    """Empty PyTorch's DTensor caches that hold meshes (if it is loaded)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    api = sys.modules.get("torch.distributed.tensor._api")
    prop = getattr(getattr(getattr(api, "DTensor", None), "_op_dispatcher", None),
                   "sharding_propagator", None)
    for fn in (getattr(prop, "propagate_op_sharding", None),
               getattr(sys.modules.get("torch.distributed.tensor._redistribute"),
                       "_gen_transform_infos", None),
               getattr(getattr(sys.modules.get("torch.distributed.tensor._collective_utils"),
                               "MeshTopoInfo", None), "build_from_mesh", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
