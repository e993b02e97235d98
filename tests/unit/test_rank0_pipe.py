"""engine/execution/multiprocess_executor.py's rank-0 loop under async scheduling: the engine sends step
k+1 while step k runs, before it reads step k's answer. When that message and the answer
both outgrow the pipe's buffer, the loop must still take the message while it works, or each
end blocks in send() on the other."""

from __future__ import annotations

import multiprocessing
import threading
import time

from engine.execution.multiprocess_executor import lead

BIG = 4_000_000  # bytes: far beyond a socket pair's buffer


class SlowBulkyRank:
    """Stands in for a RankWorker: each step takes a while and answers with a large output."""

    def execute(self, scheduler_output):
        time.sleep(0.3)
        return b"x" * BIG

    def stop(self) -> None:
        pass


def _rank0(conn) -> None:
    lead(SlowBulkyRank(), conn)


def test_a_large_step_sent_while_a_large_answer_comes_back_does_not_deadlock():
    context = multiprocessing.get_context("fork")
    engine_end, rank_end = context.Pipe()
    process = context.Process(target=_rank0, args=(rank_end,), daemon=True)
    process.start()
    try:
        engine_end.send(("execute", "step 1"))
        answers = []

        def engine() -> None:
            engine_end.send(("execute", b"y" * BIG))  # step 2, while step 1 runs
            answers.append(engine_end.recv())  # step 1's answer
            answers.append(engine_end.recv())  # step 2's

        thread = threading.Thread(target=engine, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the engine and rank 0 block each other in send()"
        assert [(status, len(payload)) for status, payload in answers] == [("ok", BIG)] * 2
        engine_end.send(("stop", None))
        process.join(timeout=10)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
