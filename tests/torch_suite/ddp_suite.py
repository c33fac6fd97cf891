"""PyTorch's own DDP tests (``DistributedTest._DistTestBase``) on CPU, gloo, 2 ranks, against torch DDP or fastcoll.DDP.

Run by ``tests/torch_suite/run.py`` (``make test-torch-ddp-suite``), once per
implementation::

    FASTCOLL_PEER_DDP=fastcoll python tests/torch_suite/ddp_suite.py RESULTS.json [test_name ...]

With ``FASTCOLL_PEER_DDP=fastcoll`` the module substitutes ``fastcoll.DDP``
for torch's class before the test module is imported, at the top level: the
test processes are spawned, and each re-imports this module (as
``__mp_main__``), so every rank runs with the substitution too. fastcoll is
imported first, so that it binds the real torch class for itself
(``fastcoll.ddp.wrapper``'s base class, ``compile_support``); only the names
the tests look up are replaced: ``torch.nn.parallel.DistributedDataParallel``
and the test module's own ``DistributedDataParallel`` global.
``torch.nn.parallel.distributed.DistributedDataParallel`` stays torch's (dynamo
reads it).

Not collected by pytest (no ``test_*.py`` file here): every test spawns two
processes that import torch, about 15 s each on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import sys
import unittest

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "180")

IMPLEMENTATION = os.environ.get("FASTCOLL_PEER_DDP", "torch")
if IMPLEMENTATION not in ("torch", "fastcoll"):
    raise SystemExit(f"FASTCOLL_PEER_DDP must be 'torch' or 'fastcoll', not {IMPLEMENTATION!r}")

if IMPLEMENTATION == "fastcoll":
    import torch.nn.parallel

    import fastcoll  # before the replacement below: fastcoll binds the real torch class for itself

    torch.nn.parallel.DistributedDataParallel = fastcoll.DDP

import torch  # noqa: E402
import torch.testing._internal.distributed.distributed_test as DT  # noqa: E402
from recorder import Recorder  # noqa: E402  (this script's folder is on sys.path)
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if IMPLEMENTATION == "fastcoll":
    DT.DistributedDataParallel = fastcoll.DDP  # the test module's `from torch.nn.parallel import DistributedDataParallel`
    _mark_dir = os.environ.get("FASTCOLL_PEER_MARKS")
    if _mark_dir and __name__ == "__mp_main__":  # a spawned rank process: record what it will construct
        with open(os.path.join(_mark_dir, str(os.getpid())), "w") as f:
            f.write(f"{DT.DistributedDataParallel.__module__}.{DT.DistributedDataParallel.__qualname__}")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's CPU distributed tests, each in two freshly spawned rank processes (upstream's test_distributed_spawn)."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def main(argv: list) -> int:
    """Run the named tests (all given on the command line after the results path); write their outcomes as JSON."""
    out, names = argv[0], argv[1:]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(verbosity=2, resultclass=Recorder, stream=sys.stderr)
    result = runner.run(suite)
    with open(out, "w") as f:
        where = sys.modules["fastcoll"].__file__ if IMPLEMENTATION == "fastcoll" else torch.__file__
        json.dump({"implementation": IMPLEMENTATION, "from": where, "tests": result.outcomes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
