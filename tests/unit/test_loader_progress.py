"""Model loading shows a progress bar over the shard files' bytes and logs what it loaded and
how long it took (issue 21 point 6)."""

from __future__ import annotations

import logging

from engine.engine_config import EngineConfig
from engine.execution.loader import load_model


def test_loading_shows_progress_and_logs_its_time(capsys, caplog):
    model_dir = EngineConfig().model_dir
    with caplog.at_level(logging.INFO, logger="engine.execution.loader"):
        load_model(model_dir)
    bar = capsys.readouterr().err
    assert "loading tiny-granite-hybrid (1 shards)" in bar and "100%" in bar
    [record] = [r for r in caplog.records if r.name == "engine.execution.loader"]
    message = record.getMessage()
    assert "tensors from 1 shard file(s)" in message and message.endswith(" s")
    assert "unsharded" in message
