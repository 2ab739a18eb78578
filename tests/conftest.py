"""Suite-wide: the profile cache (rpcompile.passes.profile_cache) lives in a fresh temporary directory per test, so
no test reads another's measured costs and the suite never writes into the real ``~/.cache/rpcompile``
(subprocesses inherit the variable)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path_factory.mktemp("rpcompile-cache")))
