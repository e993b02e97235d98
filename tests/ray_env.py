"""Environment for the Ray instances the tests start (the session's, tests/conftest.py, and
those of the scenarios run as subprocesses: tests/metrics, tests/soak, tests/cluster's fake
autoscaling cluster).

Serve gives a starting HTTP proxy PROXY_READY_CHECK_TIMEOUT_S (5 s) to answer its first ready
check, then kills it, and serve.start fails on the dead proxy (ActorDiedError). On a 2-core CI
machine, with a second Ray starting beside the session's, a proxy once took longer than that
(tests/soak in a fresh-clone run). A minute is well inside every test's own timeout.
Set it before ray.init: Ray's processes take the environment of the driver that starts them.
"""

SERVE_ON_TWO_CORES_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
