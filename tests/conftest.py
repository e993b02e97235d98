"""Session-wide fixtures shared by every test directory.

`ray_session` starts Ray once per pytest session (only for tests that ask for it, so unit and
numerics tests never pay for it) and shuts it down at the end. It is sized for a 2-core CI box:
4 logical CPUs so fractional actors fit, a 256 MiB object store, no dashboard. The Serve
fixtures on top of it are in tests/e2e/serve_fixtures.py.

Every test that starts Ray or Serve (it asks for ray_session, directly or through a Serve
fixture, or lives in a directory of such tests) is marked `ray`. `make test` runs the others
first on two pytest-xdist workers (`-m "not ray" -n 2`), then the `ray` tests in one process,
one at a time, with one Ray instance and their fixed ports, and nothing else competing for
the two cores (several of them time Serve's behaviour under load).
"""

from __future__ import annotations

import os

import pytest

from tests.ray_env import SERVE_ON_TWO_CORES_ENV

# The Serve session (one Serve instance and app per pytest session) for every Serve test
# directory; only where Ray Serve is installed (the GPU machine runs tests/gpu without it).
try:
    import pydantic  # noqa: F401
    import ray.serve  # noqa: F401
except ImportError:
    pytest_plugins: tuple[str, ...] = ()
else:
    pytest_plugins = ("tests.e2e.serve_fixtures",)

RAY_NUM_CPUS = 4
RAY_OBJECT_STORE_BYTES = 256 * 1024 * 1024
# Directories whose tests start Ray themselves (a subprocess, a fake cluster) or Serve.
RAY_TEST_DIRS = ("e2e", "cluster", "cluster_checkpoints", "metrics", "soak")


def pytest_collection_modifyitems(config, items):
    """Mark every Ray test `ray`: see the module docstring."""
    for item in items:
        if "ray_session" in item.fixturenames or item.path.parent.name in RAY_TEST_DIRS:
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance for the whole session (reuses one a caller already started)."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        os.environ.update(SERVE_ON_TWO_CORES_ENV)
        ray.init(
            address="local",  # a new local Ray, never one a stale /tmp/ray/ray_current_cluster names
            num_cpus=RAY_NUM_CPUS,
            object_store_memory=RAY_OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
            namespace="hybrid-serve-tests",
        )
    yield ray
    if started_here:
        ray.shutdown()
