"""Fixtures shared by the tests of this folder (the service's own live in
``launch``; the property suite's in ``tests/properties/conftest.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def fresh_process():
    """``fresh_process(script)`` runs ``python -c script PORT`` in a new
    interpreter (nothing imported yet; PORT is free for a 1-rank world's
    ``init_method``) and returns the ``CompletedProcess``. Skipped under
    torchrun: every rank would start one.

    Example:
        >>> p = fresh_process("import sys; print(sys.argv[1].isdigit())")
        >>> p.stdout
        'True\\n'
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        pytest.skip("self-test starts its own process; run it with plain pytest")

    def run(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in _WORLD_ENV}
        return subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True,
                              text=True, timeout=timeout, env=env)

    return run
