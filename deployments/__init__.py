"""The Ray Serve application: the ingress (ingress.py), renderer (renderer.py) and LLM server
(llm_server.py) deployments, the tensor-parallel rank actors (worker_group.py), the application
builder and its configuration (app.py, config.py, check_config.py, placement.py: whether the
cluster can hold what the app asks, config_reference.py, serve_main.py) and the metrics
(metrics.py).

    http/      the OpenAI-compatible wire (protocol, errors, limits, streaming, API keys, log)
    cluster/   sharing checkpoints between replicas (index, router, object-store tier)
    prompts/   rendering messages into token ids without Ray

May import engine/ and cache/; the benchmark tool (hybrid_serve_bench/) imports it.
"""
