"""hybrid-serve-bench: chat workloads against any OpenAI-compatible server, checkpoint policies
side by side, and the report (Markdown table + PNG plots).

Modules, one responsibility each:
  tokens.py      token counts and prompt token ids, with the served model's tokenizer (never estimated)
  workloads.py   pure: the conversations of each workload, from a seed and sizes
  accounting.py  pure: shareable tokens (what a perfect prefix cache could restore) per request
  client.py      one streaming chat request -> one RequestRecord
  runner.py      conversations, concurrency and Poisson arrivals against targets -> records
  stats.py       pure: percentiles and the summary rows
  plots.py       the PNG plots (matplotlib, Agg)
  report.py      the result JSON, the Markdown report and the plots, under one folder
  policies.py    hybrid-serve in process, one Serve app per checkpoint_slots setting
  engine_target.py  the engine in process with no Ray and no HTTP, one per setting (--in-process)
  launcher.py    one server process in a session of its own: start, wait until it answers, stop all of it
  peer_servers.py   the commands compare-servers --launch runs: hybrid-serve, vLLM's CPU server
  peer_suite.py  the passes run against each launched server, and the peer table
  compare_launched.py  compare-servers --launch: each server in turn, one table, peers.json
  cli.py         `hybrid-serve-bench run | compare-servers | compare-policies`
"""
