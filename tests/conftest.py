"""Suite-wide:

- the profile cache (rpcompile.passes.cost.profile_cache) lives in a fresh temporary directory per test, so no test
  reads another's measured costs and the suite never writes into the real ``~/.cache/rpcompile`` (subprocesses inherit
  the variable);
- under pytest-xdist (``make test``: one worker a core) each worker gets its share of the cores as torch intra-op
  threads, its subprocesses too (``OMP_NUM_THREADS``, unless the environment sets it): two workers of two threads
  each on the 2-core reference machine wait at parallel regions' barriers for a core the other worker holds
  (test_foreign_devices.py under ``-n 2``, runs interleaved at load 4.6-5.4: 74-76 s and 71-75 CPU-s with one
  thread a worker, 86-89 s and 85-86 CPU-s with two).
"""

from __future__ import annotations

import os

import pytest
import torch


def worker_threads(workers: int, cores: int | None) -> int:
    """Intra-op threads for one of ``workers`` test processes sharing ``cores``: its share, at least one."""
    return max(1, (cores or 1) // max(1, workers))


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # set in a worker before its configuration
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:  # a count given in the environment is kept
        threads = worker_threads(workers, os.cpu_count())
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path_factory.mktemp("rpcompile-cache")))
