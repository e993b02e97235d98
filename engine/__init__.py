"""The in-process engine: requests in, tokens out, with request-boundary checkpoints.

Packages, top to bottom (each may import only those below it; pyproject.toml's import
contracts check this):

    core/         the step loop: LLMEngine, Scheduler, AsyncLLMEngine, outputs, checkpoint exchange
    execution/    workers per tensor-parallel rank, executors, loader, sampler
    speculative/  drafters, verification routes, speculative scheduling rules
    routes/       how a step's batch reaches the model: eager passes and CUDA graphs
    checkpoints/  checkpoint policy, sources, bundle store, shards, transfer format, import checks
    models/       the model families (GraniteMoeHybrid, Bamba, Nemotron-H, Falcon-H1, Qwen3-Next)
    layers/       mixers, MLPs, norms and parallel linear layers
    kernels/      pure-PyTorch references and their Triton kernels (gpu/)
    parallel/     one rank's share: process group, shard layout, cache capacity
    interfaces/   the typed objects that cross these boundaries

engine_config.py (EngineConfig) and model_config.py (a parsed config.json) are read by all.
engine/ imports cache/ and never deployments/ or Ray.
"""
