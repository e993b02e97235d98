"""The GPU roofline benchmark (benchmarks/gpu_roofline.py), in parts:

  model          the ~1.5B GraniteMoeHybrid config, its random-weight checkpoint, the engine
                 config sized for the run, hand-built scheduled chunks
  floors         the H200's limits measured in the run (copy bandwidth, bf16 matmul rate), the
                 floor formulas (prefill FLOPs, decode bytes) and the targets
  instruments    torch.profiler summaries, host synchronisation lists, a step's timeline
  numerics       bf16 GPU logits against the fp32 CPU reference
  prefill_rows   cold prefill, checkpoint capture and restore, restore + prefill, capture
                 during the prefill
  decode_rows    decode steps at a batch size (async, sync, graph replay alone, host profile)
  decode_anatomy where a batch-1 decode step's GPU time goes around its graph
  report         the printed tables
"""
