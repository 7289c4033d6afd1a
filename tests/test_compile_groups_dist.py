"""Covers: the process groups and meshes that compiled code names
(``dtensor/_comm.py`` group names, ``dtensor/mesh.py`` ``__fx_repr__`` and
``_cache_key``, ``DTensor._stable_hash_for_caching``).

Compiled code bakes process-group *names* into its generated code and is
cached in memory and on disk. The properties here: every name it uses
resolves for as long as compiled code may run (whatever happens to the mesh
object that traced it), names are a pure function of the world and the ranks,
and a program cached in one world is never replayed in another (issue: "Could
not resolve the process group registered under the name dtensor:0_1", hit when
a 2-rank run loaded an AOTAutograd cache entry written by a 4-rank run).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

from dtensor import DeviceMesh, DTensor, Replicate, Shard, _comm, distribute_tensor


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()
    with torch._inductor.config.patch(compile_threads=1):
        yield
    torch._dynamo.reset()


def _gather_twice(mesh: DeviceMesh):
    """A compiled function over ``mesh`` (reversed ranks: a real named group)."""

    @torch.compile(backend="inductor", fullgraph=True)
    def step(local):
        t = DTensor.from_local(local, mesh, [Shard(0)])
        return (t * 2).redistribute(mesh, [Replicate()]).to_local()

    return step


def _gather_digests(text: str, world) -> list[int]:
    """Every rank's digest of ``text`` (all_gather_object needs numpy)."""
    mine = torch.tensor([int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)])
    out = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(out, mine, group=world.group)
    return [int(t) for t in out]


@pytest.mark.world_size(2)
def test_group_names_are_a_function_of_world_and_ranks(world) -> None:
    mesh = DeviceMesh("cpu", [1, 0])
    name = mesh.get_group().group_name
    assert name == f"dtensor:{_comm.world_tag()}:1_0"
    assert len(set(_gather_digests(name, world))) == 1, name
    # Equal geometry in the same world is the same mesh, and shares its group.
    again = DeviceMesh("cpu", [1, 0])
    assert again == mesh and hash(again) == hash(mesh)
    assert again.get_group() is mesh.get_group()


@pytest.mark.world_size(2)
def test_compiled_code_outlives_the_mesh_that_traced_it(world) -> None:
    step = _gather_twice(DeviceMesh("cpu", [1, 0]))
    first = step(torch.full((2, 3), float(world.rank)))
    gc.collect()  # the mesh is only referenced by compiled code now
    second = step(torch.full((2, 3), float(world.rank + 10)))
    # Mesh [1, 0]: rank 1 holds rows 0-1, rank 0 rows 2-3.
    assert torch.equal(first, torch.cat([torch.full((2, 3), 2.0), torch.full((2, 3), 0.0)]))
    assert torch.equal(second, torch.cat([torch.full((2, 3), 22.0), torch.full((2, 3), 20.0)]))


@pytest.mark.world_size(2)
def test_meshes_over_the_same_ranks_built_and_dropped_in_turn(world) -> None:
    results = []
    for k in range(3):
        mesh = DeviceMesh("cpu", [1, 0], mesh_dim_names=("tp",) if k % 2 else None)
        step = _gather_twice(mesh)
        del mesh
        gc.collect()
        results.append(step(torch.full((2, 3), float(world.rank + k))))
        del step
        gc.collect()
        torch._dynamo.reset()
    for k, got in enumerate(results):
        want = torch.cat([torch.full((2, 3), 2.0 * (1 + k)), torch.full((2, 3), 2.0 * k)])
        assert torch.equal(got, want), (k, got)


@pytest.mark.world_size(2)
def test_cache_keys_name_the_world(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    key = mesh._cache_key()
    assert key[-1] == _comm.world_tag() and key[-2] == dist.get_rank()
    x = distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)])
    assert repr(key) in mesh.__fx_repr__()[0]
    hashes = _gather_digests(x._stable_hash_for_caching(), world)
    assert hashes[0] != hashes[1]  # programs are specialised to the rank


# A fresh process from a warm on-disk cache ---------------------------------------
_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    from dtensor import DeviceMesh, Replicate, Shard, distribute_tensor
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo")
    torch._inductor.config.compile_threads = 1
    mesh = DeviceMesh("cpu", [0, 1])
    out = {}
    if mesh.get_coordinate() is not None:
        step = torch.compile(lambda w, x: (x @ w).relu().sum(), backend="inductor",
                             fullgraph=True)
        g = torch.Generator().manual_seed(0)
        w = distribute_tensor(torch.randn(8, 4, generator=g), mesh, [Shard(1)])
        w.requires_grad_()
        x = distribute_tensor(torch.randn(6, 8, generator=g), mesh, [Replicate()])
        loss = step(w, x)
        loss.backward()
        out = {"loss": loss.full_tensor().item(), "grad": w.grad.full_tensor().tolist(),
               "aot": dict(counters["aot_autograd"])}
    dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(script: Path, n: int, out: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                        "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                           env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           str(script), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.world_size(1)
@pytest.mark.dist_timeout(900)
def test_warm_disk_cache_from_another_world_is_never_replayed(tmp_path) -> None:
    """A 3-rank run, then two 2-rank runs, one inductor cache directory."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cache = tmp_path / "inductor-cache"
    three = _run_world(script, 3, tmp_path / "three.json", cache)
    two = _run_world(script, 2, tmp_path / "two.json", cache)      # failed before the fix
    again = _run_world(script, 2, tmp_path / "again.json", cache)
    for got in (two, again):
        assert got["loss"] == three["loss"] and got["grad"] == three["grad"]
    # The 3-rank world's entry is not this world's: a miss, then a hit.
    assert two["aot"].get("autograd_cache_hit", 0) == 0, two["aot"]
    assert again["aot"].get("autograd_cache_hit", 0) == 1, again["aot"]


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
