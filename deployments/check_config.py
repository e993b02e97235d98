"""Check a Serve config file's hybrid-serve applications without starting anything.

    python -m deployments.check_config serve_config.yaml

`serve run serve_config.yaml` hands the file to the Serve controller and then blocks whatever
happens: when build_app refuses an application's args, the error shows in its log and the
application stays DEPLOY_FAILED, but the command does not exit. This runs build_app on every
application of the file whose import_path is deployments.app:build_app, here, and exits with
status 2 and the message naming the key if any is refused (`make serve` runs it first). It also
checks that this machine (or the Ray cluster, when one is initialised) can hold what each
application asks with the file's starting replicas and ray_actor_options
(deployments/placement.py): a config Serve could never place is refused instead of waited for;
and that the file's `deployments:` name only deployments the application's graph has
(deployment_names: the lean path has no OpenAIIngress, and a Renderer only with
render_in_replica false), which Serve would refuse after the deploy started.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

IMPORT_PATH = "deployments.app:build_app"


def check_serve_config(path: str | Path) -> list[str]:
    """The names of the file's hybrid-serve applications, each built once (no Ray needed).
    Raises ValueError naming the application and the refused key (PlacementError when the
    machine or cluster cannot hold what an application asks)."""
    from deployments.app import build_app
    from deployments.config import parse_app_config
    from deployments.placement import PlacementError, check_placement, deployment_names
    from deployments.serving_path import serving_path

    config = yaml.safe_load(Path(path).read_text()) or {}
    checked = []
    for app in config.get("applications") or []:
        if app.get("import_path") != IMPORT_PATH:
            continue
        name = app.get("name", "<unnamed>")
        try:
            build_app(app.get("args") or {})  # the placement of one replica each, among others
            replicas, actor_options = starting_replicas(app.get("deployments") or [])
            app_config = parse_app_config(app.get("args") or {})
            lean = serving_path(app_config).lean
            graph = deployment_names(app_config, lean)
            for named in replicas:
                if named not in graph:
                    raise ValueError(f"deployments: {named!r} is not a deployment of this application on "
                                     f"the {'lean' if lean else 'classic'} path (it has {', '.join(graph)}; "
                                     "a Renderer only with render_in_replica false or on the classic path)")
            try:
                check_placement(app_config, replicas, actor_options, lean=lean)
            except PlacementError as exc:
                raise PlacementError(exc.key, f"invalid hybrid-serve app args: {exc}") from None
        except PlacementError as exc:
            raise PlacementError(exc.key, f"{path}: application {name!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{path}: application {name!r}: {exc}") from None
        checked.append(name)
    return checked


def starting_replicas(deployments: list[dict]) -> tuple[dict[str, int], dict[str, dict]]:
    """From an application's `deployments:` entries: deployment name -> the replicas Serve
    starts (num_replicas, else autoscaling_config initial_replicas or min_replicas; at least 1:
    a deployment that scales from zero must still fit one), and name -> ray_actor_options (they
    override build_app's)."""
    replicas, actor_options = {}, {}
    for entry in deployments:
        name = entry.get("name")
        scaling = entry.get("autoscaling_config") or {}
        count = entry.get("num_replicas")
        if not isinstance(count, int):  # unset or "auto"
            count = scaling.get("initial_replicas") or scaling.get("min_replicas") or 1
        replicas[name] = int(count)
        if entry.get("ray_actor_options"):
            actor_options[name] = entry["ray_actor_options"]
    return replicas, actor_options


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
