"""The Ray Serve application on two serving paths (serving_path.py): the lean LLM server that
serves HTTP itself behind HAProxy (llm_server_ingress.py), or the classic ingress
(ingress.py) in front of the renderer (renderer.py) and LLM server (llm_server.py); the OpenAI
API both serve (frontend.py), the tensor-parallel rank actors (worker_group.py), the
application builder and its configuration (app.py, config.py, check_config.py, placement.py:
whether the cluster can hold what the app asks, config_reference.py, serve_main.py) and the
metrics (metrics.py; engine_metrics.py exports an engine's from its replica).

    http/      the OpenAI-compatible wire (protocol, errors, limits, streaming, API keys, log)
    cluster/   sharing checkpoints between replicas (index, router, object-store tier)
    prompts/   rendering messages into token ids without Ray

May import engine/ and cache/; the benchmark tool (hybrid_serve_bench/) imports it.
"""
