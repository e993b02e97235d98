"""Check a Serve config file's hybrid-serve applications without starting anything.

    python -m deployments.check_config serve_config.yaml

`serve run serve_config.yaml` hands the file to the Serve controller and then blocks whatever
happens: when build_app refuses an application's args, the error shows in its log and the
application stays DEPLOY_FAILED, but the command does not exit. This runs build_app on every
application of the file whose import_path is deployments.app:build_app, here, and exits with
status 2 and the message naming the key if any is refused (`make serve` runs it first).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

IMPORT_PATH = "deployments.app:build_app"


def check_serve_config(path: str | Path) -> list[str]:
    """The names of the file's hybrid-serve applications, each built once (no Ray needed).
    Raises ValueError naming the application and the refused key."""
    from deployments.app import build_app

    config = yaml.safe_load(Path(path).read_text()) or {}
    checked = []
    for app in config.get("applications") or []:
        if app.get("import_path") != IMPORT_PATH:
            continue
        name = app.get("name", "<unnamed>")
        try:
            build_app(app.get("args") or {})
        except ValueError as exc:
            raise ValueError(f"{path}: application {name!r}: {exc}") from None
        checked.append(name)
    return checked


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m deployments.check_config SERVE_CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        names = check_serve_config(argv[0])
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{argv[0]}: {len(names)} hybrid-serve application(s) accepted: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
