"""The KV cache format (engine/parallel/kv_cache_format.py, EngineConfig.kv_cache_dtype): where
FP8 is refused, how its blocks are sized, where its scales come from, and that checkpoints of
one format never enter an engine of another (engine/checkpoints/import_checks.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from deployments.config import parse_app_config
from engine.checkpoints.import_checks import ImportExpectations, ImportRejection, check_exported, expected_shard_layout
from engine.checkpoints.transfer import (
    CheckpointHeader, ExportedCheckpoint, checkpoint_digest, make_shard, model_identity,
)
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.models.registry import load_model_config
from engine.parallel.cache_capacity import check_cache_budgets, size_caches
from engine.parallel.kv_cache_format import (
    SCALES_FILE, check_kv_cache_device, kv_cache_format, kv_storage_dtype, load_kv_scales,
)
from engine.parallel.shard_layout import rank_shard_layout
from engine.parallel.tensor_parallel import TensorParallel

TINY = load_model_config(str(DEFAULT_MODEL_DIR))  # attention layers 2 and 5, 2 KV heads
CUDA_BF16 = dict(device="cuda", dtype="bfloat16", max_model_len=512)


def test_fp8_is_refused_off_cuda_and_unknown_formats_everywhere():
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 runs on device cuda only"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(device="cuda", kv_cache_dtype="fp8_e5m2")
    assert EngineConfig(device="cuda", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match=r"engine: kv_cache_dtype fp8_e4m3 runs on device cuda only"):
        parse_app_config({"engine": {"kv_cache_dtype": "fp8_e4m3"}})
    engine = parse_app_config({"engine": {"device": "cuda", "kv_cache_dtype": "fp8_e4m3"}}).engine
    assert engine.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="runs on cuda only"):
        check_kv_cache_device(engine, torch.device("cpu"))
    check_kv_cache_device(EngineConfig(), torch.device("cpu"))  # auto: anywhere


def test_fp8_blocks_take_half_the_bytes_so_a_budget_holds_twice_the_blocks():
    budget = dict(kv_cache_bytes=8 << 20, state_cache_bytes=8 << 20)
    bf16 = size_caches(EngineConfig(**CUDA_BF16, **budget), TINY, TensorParallel.single())
    fp8 = size_caches(EngineConfig(**CUDA_BF16, **budget, kv_cache_dtype="fp8_e4m3"), TINY, TensorParallel.single())
    # 2 layers x K and V x 2 KV heads x 32 dims x 16 tokens: 4,096 elements a block
    assert bf16.bundle_sizing.kv_bytes_per_token * 16 == 4096 * 2
    assert fp8.bundle_sizing.kv_bytes_per_token * 16 == 4096 * 1
    assert fp8.num_blocks == 2 * bf16.num_blocks == 2 * ((8 << 20) // 8192)
    assert fp8.bundle_sizing.hidden_row_bytes == bf16.bundle_sizing.hidden_row_bytes  # still bf16
    assert kv_storage_dtype(EngineConfig(**CUDA_BF16, kv_cache_dtype="fp8_e4m3")) == torch.float8_e4m3fn
    assert kv_storage_dtype(EngineConfig(**CUDA_BF16)) == torch.bfloat16


def test_scales_default_to_one_and_come_from_the_model_dir(tmp_path):
    assert torch.equal(load_kv_scales(tmp_path, (2, 5), 2), torch.ones(2, 2, 2))
    (tmp_path / SCALES_FILE).write_text(json.dumps({"k_scale": {"2": 0.5, "5": [0.25, 2.0]}, "v_scale": {"5": 0.125}}))
    scales = load_kv_scales(tmp_path, (2, 5), 2)
    assert scales.tolist() == [[[0.5, 0.5], [0.25, 2.0]], [[1.0, 1.0], [0.125, 0.125]]]
    # a drafter layer (numbered num_hidden_layers) comes after the model's own
    (tmp_path / SCALES_FILE).write_text(json.dumps({"v_scale": {"6": [3.0, 4.0]}}))
    assert load_kv_scales(tmp_path, (2, 5, 6), 2)[1].tolist() == [[1.0, 1.0], [1.0, 1.0], [3.0, 4.0]]


@pytest.mark.parametrize("content,message", [
    ({"k_scale": {"3": 0.5}}, "layer '3', which is not an attention layer"),
    ({"k_scale": {"2": 0.0}}, "must be a positive number or a list of 2"),
    ({"v_scale": {"2": [1.0, 2.0, 3.0]}}, "must be a positive number or a list of 2"),
    ({"v_scale": {"2": "1.0"}}, "must be a positive number"),
    ({"k_scale": {"2": float("inf")}}, "must be a positive number"),
    ({"q_scale": {"2": 1.0}}, "expected an object with k_scale and/or v_scale"),
    ({"k_scale": [1.0]}, "k_scale must map layer indices to scales"),
])
def test_a_bad_scales_file_is_refused_naming_it(tmp_path, content, message):
    (tmp_path / SCALES_FILE).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as error:
        load_kv_scales(tmp_path, (2, 5), 2)
    assert SCALES_FILE in str(error.value)


def test_a_bad_scales_file_fails_the_budget_check_the_app_runs_at_build(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    (model_dir / SCALES_FILE).write_text("{not json")
    config = EngineConfig(**CUDA_BF16, model_dir=str(model_dir), kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="not a JSON file"):
        check_cache_budgets(config, TINY)
    check_cache_budgets(dataclasses.replace(config, kv_cache_dtype="auto"), TINY)  # auto reads no scales


def test_each_rank_takes_its_kv_heads_scales_and_the_identity_follows_the_scales(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    config = EngineConfig(**CUDA_BF16, model_dir=str(model_dir), kv_cache_dtype="fp8_e4m3")
    unit = kv_cache_format(config, TINY)
    assert unit.quantized and unit.dtype_name == "float8_e4m3fn" and unit.identity().startswith("fp8_e4m3:")
    assert kv_cache_format(dataclasses.replace(config, kv_cache_dtype="auto"), TINY).identity() == "auto"
    (model_dir / SCALES_FILE).write_text(json.dumps({"k_scale": {"2": [0.5, 0.25]}}))
    scaled = kv_cache_format(config, TINY)
    assert scaled.identity() != unit.identity()
    for rank in (0, 1):  # two ranks, one KV head each
        layout = rank_shard_layout(TINY, TensorParallel(rank, 2))
        assert scaled.rank_scales(layout).tolist() == [[[(0.5, 0.25)[rank]], [1.0]], [[1.0], [1.0]]]


def _exported(kv_dtype: torch.dtype, kv_cache: str) -> ExportedCheckpoint:
    """A well-formed one-rank checkpoint of the tiny model (fp32 on cuda) over 20 tokens, its
    K/V in kv_dtype, its header naming kv_cache."""
    model = model_identity(str(DEFAULT_MODEL_DIR), "float32", "cuda")
    layout = expected_shard_layout(TINY, TensorParallel.single(), "float32",
                                   kv_dtype=str(kv_dtype).removeprefix("torch."))
    tokens = tuple(range(3, 23))
    namespace = (str(DEFAULT_MODEL_DIR), "")
    digest = checkpoint_digest(namespace, tokens)
    g = torch.Generator().manual_seed(0)
    shard = make_shard(0, digest, torch.randn(*layout.conv_state, generator=g),
                       torch.randn(*layout.ssm_state, generator=g),
                       torch.randn(*layout.kv_shape(len(tokens)), generator=g).to(kv_dtype),
                       torch.randn(layout.hidden_size, generator=g))
    header = CheckpointHeader(namespace, tokens, digest, "prompt", "", model, 1, 16, (layout,), kv_cache=kv_cache)
    return ExportedCheckpoint(header, (shard,))


def _expectations(kv_dtype: torch.dtype, kv_cache: str) -> ImportExpectations:
    layout = expected_shard_layout(TINY, TensorParallel.single(), "float32",
                                   kv_dtype=str(kv_dtype).removeprefix("torch."))
    return ImportExpectations(model_identity(str(DEFAULT_MODEL_DIR), "float32", "cuda"), 1, 16, (layout,),
                              TINY.vocab_size, 512, kv_cache=kv_cache)


def test_a_checkpoint_enters_only_an_engine_of_its_kv_format():
    fp8, other_scales = "fp8_e4m3:0123456789abcdef", "fp8_e4m3:fedcba9876543210"
    as_fp8 = _exported(torch.float8_e4m3fn, fp8)
    as_fp32 = _exported(torch.float32, "auto")
    assert as_fp8.shards[0].kv.dtype == torch.float8_e4m3fn
    assert as_fp8.header.layouts[0].nbytes(20) == as_fp8.nbytes  # FP8 K/V counted at one byte
    assert check_exported(as_fp8, _expectations(torch.float8_e4m3fn, fp8)) is None
    assert check_exported(as_fp32, _expectations(torch.float32, "auto")) is None
    for exported, expected in ((as_fp8, _expectations(torch.float32, "auto")),  # FP8 into a model-dtype engine
                               (as_fp32, _expectations(torch.float8_e4m3fn, fp8)),  # and the reverse
                               (as_fp8, _expectations(torch.float8_e4m3fn, other_scales))):  # other scales
        rejected = check_exported(exported, expected)
        assert rejected is not None and rejected.reason is ImportRejection.KV_CACHE, rejected
    # a header that claims the engine's format over K/V bytes of another dtype: the shard check
    lying = dataclasses.replace(as_fp32, header=dataclasses.replace(
        as_fp32.header, kv_cache=fp8, layouts=_expectations(torch.float8_e4m3fn, fp8).layouts))
    rejected = check_exported(lying, _expectations(torch.float8_e4m3fn, fp8))
    assert rejected.reason is ImportRejection.SHAPE and "kv is torch.float32" in rejected.detail
