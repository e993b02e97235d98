"""The roofline's printed report: the rows against their floors and targets, then what each
row's profile says (async against sync steps, the graph replay alone, the batch-1 step's
anatomy, host profiles, top kernels and critical paths, timelines, host synchronisations)."""

from __future__ import annotations


def print_report(report: dict) -> None:
    """Print the tables of a finished run's report (the dict gpu_roofline.py writes as JSON)."""
    rows = report["rows"]
    print(f"\n{'row':<40}{'time ms':>10}{'floor ms':>10}{'ratio':>8}{'target':>8}{'tok/s':>12}")
    for r in rows:
        target = f"{r['target']:>8.2f}" if "target" in r else f"{'-':>8}"
        rate = f"{r['tokens_per_s']:>12.0f}" if "tokens_per_s" in r else f"{'-':>12}"
        print(f"{r['name']:<40}{r['seconds'] * 1e3:>10.2f}{r['floor_seconds'] * 1e3:>10.2f}"
              f"{r['ratio_to_floor']:>8.2f}{target}{rate}")
    for r in rows:
        if "sync_seconds" in r:
            print(f"{r['name']}: {r['seconds'] * 1e3:.3f} ms a step with async scheduling, "
                  f"{r['sync_seconds'] * 1e3:.3f} ms ({r['sync_ratio_to_floor']:.2f} of the floor) "
                  "with each step collected before the next is staged")
    for r in rows:
        if "graph_replay_seconds" in r:
            print(f"{r['name']}: the graph replay alone {r['graph_replay_seconds'] * 1e3:.3f} ms of the "
                  f"{r['seconds'] * 1e3:.3f} ms step")
    anatomy = report.get("batch1_step_anatomy")
    if anatomy:
        print(f"\n{'decode batch 1, chains of ' + str(anatomy['chain']) + ' steps':<40}{'GPU ms a step':>14}")
        for v in anatomy["chains"]:
            print(f"{v['name']:<40}{v['gpu_s'] * 1e3:>14.3f}")
        print(f"the worker's async steps under the profiler: {anatomy['async_span_s'] * 1e3:.3f} ms a step, "
              "critical path a step:")
        for k in anatomy["async_critical_path"]:
            print(f"  {k['seconds'] * 1e3:8.3f} ms {k['count'] / anatomy['profiled_steps']:5.1f}x  {k['kernel']}")
    for r in rows:
        if "host_profile" in r:
            print(f"\n{r['name']}, host side:")
            print("\n".join(r["host_profile"]))
    for r in rows:
        if "profile" not in r:
            continue
        prof = r["profile"]
        span = f", first to last kernel {prof['gpu_span_s'] * 1e3:.2f} ms" if prof.get("gpu_span_s") else ""
        print(f"\n{r['name']}: wall {prof['wall_s'] * 1e3:.2f} ms, GPU kernels {prof['gpu_kernel_s'] * 1e3:.2f} ms "
              f"({prof['gpu_share']:.0%}){span}, {prof['kernel_launches']} launches")
        for k in prof["top"]:
            print(f"  {k['seconds'] * 1e3:8.3f} ms {k['count']:5d}x  {k['kernel']}")
        if "host_lead_s" in prof:
            print(f"  host before the first kernel {prof['host_lead_s'] * 1e3:.3f} ms, after the last "
                  f"{prof['host_tail_s'] * 1e3:.3f} ms; CUDA runtime calls by host time:")
            for c in prof["runtime_calls"]:
                print(f"  {c['seconds'] * 1e3:8.3f} ms {c['count']:5d}x  {c['call']}")
        if r["name"].startswith("decode"):
            print("  critical path (time each kernel adds after the previous one ends):")
            for k in prof["critical_path"]:
                print(f"  {k['seconds'] * 1e3:8.3f} ms {k['count']:5d}x  {k['kernel']}")
    for r in rows:
        if r.get("timeline"):
            print(f"\n{r['name']}: timeline, ms from the step's start (median of 5 runs)")
            print(f"{'point':<22}{'host':>8}{'GPU':>8}")
            for point, at in r["timeline"].items():
                gpu = f"{at['gpu_ms']:>8.3f}" if "gpu_ms" in at else f"{'':>8}"
                print(f"{point:<22}{at['host_ms']:>8.3f}{gpu}")
        if r.get("submit_profile"):
            print("\n".join(r["submit_profile"]))
    for r in rows:
        syncs = r.get("host_synchronisations")
        if not syncs:
            continue
        labelled = syncs.items() if "in-pass" in r["name"] else [(r["name"], syncs)]
        for label, found in labelled:
            print(f"\n{label}: host synchronisations (torch sync debug mode), {sum(found.values())}")
            for where, count in found.items():
                print(f"  {count:4d}x  {where}")
