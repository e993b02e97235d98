"""`make serve`: check a Serve config file, then run Ray's `serve run` on it, stopping on SIGINT
as on SIGTERM, whether started in the foreground or the background.

    python -m deployments.serve_main serve_config.yaml [serve run options]

The file is first checked as `python -m deployments.check_config` does (exit status 2 and the
refused key), because `serve run` on a config file blocks even when the application fails to
build. Then both signals raise KeyboardInterrupt in this process, which `serve run` answers by
shutting Serve down and exiting: a shell starts a background command with SIGINT ignored, and
Python leaves an ignored SIGINT ignored, so `serve run &` would otherwise not stop on SIGINT.
"""

from __future__ import annotations

import signal
import sys

from deployments.check_config import main as check_config


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m deployments.serve_main SERVE_CONFIG.yaml [serve run options]",
              file=sys.stderr)
        return 2
    status = check_config(argv[:1])
    if status != 0:
        return status
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    from ray.serve.scripts import cli

    cli.main(args=["run", *argv], prog_name="serve")  # exits: click's standalone mode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
