"""The compiled CPU decode route: a step whose every chunk is one decode token runs the model's
forward, LM head and argmax compiled by torch.compile (inductor, C++ on the CPU), the CPU's
counterpart of the decode CUDA graphs (engine/routes/decode_graphs.py). On with
EngineConfig.cpu_compile_decode, for one rank on the CPU.

Why it exists: on the embedded tiny model a decode step is a few hundred small PyTorch ops, each
costing a few microseconds of dispatch whatever its size; inductor fuses the elementwise ones
into a few C++ loops (the linears stay MKL's), about half the forward's time.

How the pass stays correct and cheap: a traced pass must not write the caches, since
torch.compile copies every cache tensor it sees written (the cost of a whole cache a layer).
The pass runs with deferred writes (engine/interfaces/decode_rows.py DeferredWrites): the
recurrent layers gather their slots and record their new states, the attention layers record
their tokens' K/V and attend to them in place of the cache's; this route writes them after the
pass. The writes, the gathers and the eager path are the same functions, so the pass computes
the eager pass's function; inductor's fused loops round differently (fp32 logits within about
1e-6 relative of the eager pass's on the embedded model; tests/engine/test_cpu_decode.py).

Compile time is paid once, at start, on a thread of its own (start_warm_up), while the engine
already serves every step eagerly: one graph for 2..max_num_seqs rows (dynamic shapes: the row
count and the key width vary), then one for a single row, if the first took less than the
budget. The route takes steps only once the warm-up has ended (its graphs are published
together, at the end), so no step of this engine meets a compile in progress. Then a step of a
size without a graph runs eagerly, and so does any step whose inputs would need another compile
(torch.compiler's "eager_on_recompile" stance): nothing compiles while serving. A failed
compile leaves the route off, with one log line, and the eager pass takes every step.

The stance is process-wide: two engines in one process, one stepping through its graphs while
the other's warm-up runs, can leave the second's graphs uncompiled (its steps then run the same
function eagerly: slower, never different).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from engine.interfaces.decode_rows import DecodeKeys, DecodeRows, DeferredWrites
from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.interfaces.step_io import CaptureOp, ScheduledChunk
from engine.kernels.attention_reference import write_kv
from engine.routes.forward_routes import EagerPass, RouteOutput, SampledTokens

logger = logging.getLogger(__name__)

# Warm-up compiles the batch-1 graph only if the graph of 2+ rows took less than this.
WARM_UP_BUDGET_S = 300.0


class CompiledDecodePass:
    """A forward route (engine/routes/forward_routes.py) over `model` and `caches` for steps of
    1..max_batch one-token chunks, none of them a verification chunk or a reset row; warm_up()
    (or start_warm_up(), on a thread) compiles it, and until that has ended (or after a failed
    compile) it accepts nothing."""

    def __init__(self, model, caches: ModelCaches, eager: EagerPass, max_batch: int) -> None:
        self.model, self.caches, self.eager = model, caches, eager
        self.max_batch = max_batch
        self.block_size = caches.block_size
        # every attention layer's cache has the same KV heads (None: no attention layer)
        self.kv_heads = next((k.shape[2] for k in caches.key_cache.values()), None)
        # static shapes but the step inputs' dimensions warm_up marks dynamic (the row count,
        # the key width): the weights' and caches' stay constants of the compiled code
        self._compiled = torch.compile(self._forward, fullgraph=True)
        # "one", "many": the graphs compiled, published when the warm-up ends (one assignment)
        self._sizes: frozenset[str] = frozenset()
        self.compile_seconds = 0.0  # wall time of warm_up
        self.steps = 0  # steps this route served (for tests and benchmarks)
        self._warm_up_thread: threading.Thread | None = None
        self._warm_up_done = threading.Event()

    @property
    def warming_up(self) -> bool:
        """A warm-up has started and not ended (the route accepts nothing meanwhile)."""
        return self._warm_up_thread is not None and not self._warm_up_done.is_set()

    def start_warm_up(self, budget_s: float | None = None) -> None:
        """warm_up() on a daemon thread of its own; returns at once. wait_warm_up() waits for
        it."""
        self._warm_up_thread = threading.Thread(target=self.warm_up, args=(budget_s,),
                                                name="cpu-decode-compile", daemon=True)
        self._warm_up_thread.start()

    def wait_warm_up(self, timeout_s: float | None = None) -> bool:
        """Wait up to timeout_s (None: for ever) for the warm-up to end, compiled or failed;
        True when it has (or none was started)."""
        if self._warm_up_thread is None:
            return True
        return self._warm_up_done.wait(timeout_s)

    def warm_up(self, budget_s: float | None = None) -> None:
        """Compile the graph of 2+ rows, then the one of a single row if the first took less
        than budget_s (None: WARM_UP_BUDGET_S), on inputs that read the caches and write
        nothing (the pass's writes are deferred and dropped here). A failure logs one line and
        leaves the route off."""
        budget_s = WARM_UP_BUDGET_S if budget_s is None else budget_s
        logger.info("compiled CPU decode: compiling the decode step (cpu_compile_decode; about 40 s on a "
                    "first start of the embedded model, less from inductor's cache on disk)")
        started = time.perf_counter()
        sizes: set[str] = set()
        try:
            self._mark_block_count_dynamic()
            with torch.inference_mode():
                for size, name in ((min(3, self.max_batch), "many"), (1, "one")):
                    if name == "many" and size < 2:
                        continue
                    if name == "one" and time.perf_counter() - started > budget_s:
                        logger.warning("compiled CPU decode: the batch-1 graph skipped (warm-up past %.0f s); "
                                       "batch-1 decode steps run eagerly", budget_s)
                        break
                    inputs = self._warm_up_inputs(size)
                    for tensor in (*inputs[:4], inputs[6]) if size > 1 else ():  # the rows
                        torch._dynamo.mark_dynamic(tensor, 0)
                    torch._dynamo.mark_dynamic(inputs[4], 0)  # key rows, n * Hkv * S
                    torch._dynamo.mark_dynamic(inputs[5], 3)  # padding (n, 1, 1, S)
                    if size > 1:
                        torch._dynamo.mark_dynamic(inputs[5], 0)
                    self._compiled(*inputs)
                    sizes.add(name)
        except Exception as exc:  # any failure of the compiler: the eager pass serves
            sizes.clear()
            logger.warning("compiled CPU decode is off, its compile failed (%s: %s); every step runs eagerly",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        finally:
            self.compile_seconds = time.perf_counter() - started
            self._sizes = frozenset(sizes)
            self._warm_up_done.set()
        if self._sizes:
            logger.info("compiled CPU decode ready in %.1f s (graphs: %s)", self.compile_seconds, sorted(self._sizes))

    def _mark_block_count_dynamic(self) -> None:
        """The KV caches' block count is a symbol of the graphs, not a constant: a budget taken
        from the memory free at start gives another count at each start, and a graph
        specialised on it would miss inductor's cache on disk (about 21 s of compiling again
        on the 2-core VM, against 5 s)."""
        for tensor in (*self.caches.key_cache.values(), *self.caches.value_cache.values()):
            torch._dynamo.mark_dynamic(tensor, 0)

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        """A compiled graph serves the step: 1..max_batch chunks, each one token, none a
        verification chunk or a reset row (a reset row's slot is read as zeros: the eager
        pass's)."""
        if not 0 < len(chunks) <= self.max_batch or ("one" if len(chunks) == 1 else "many") not in self._sizes:
            return False
        return all(len(c.token_ids) == 1 and not c.num_draft_tokens and not c.reset_state for c in chunks)

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        """The step through the compiled pass, its rows in state-slot order (so that the
        deferred state writes of slots that form one run are plain copies), then its deferred
        cache writes; returns the hidden rows, logits and argmax with row i = chunk i. Inputs
        the graphs do not cover (a guard failing) run the same function eagerly."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].state_slot)
        batch = self.eager.batch([chunks[i] for i in order], sampled)  # pending tokens fed
        decode = batch.decode  # in slot order already: rows 0..n-1
        keys = self._keys(decode)
        with torch.compiler.set_stance("eager_on_recompile"):
            hidden, logits, argmax, states, kv = self._compiled(
                batch.input_ids, batch.positions, batch.slot_mapping, decode.state_slots, *keys)
        apply_deferred_writes(self.caches, decode, batch.slot_mapping, states, kv)
        self.steps += 1
        if order != sorted(order):  # back to chunk order
            inverse = torch.empty(len(order), dtype=torch.int64)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            hidden, logits, argmax = (t.index_select(0, inverse) for t in (hidden, logits, argmax))
        return RouteOutput(hidden, range(len(chunks)), logits, argmax)

    def _keys(self, decode: DecodeRows) -> tuple[torch.Tensor, ...]:
        """(key rows, padding, last) of DecodeKeys, or empty tensors for a model without
        attention layers."""
        if self.kv_heads is None:
            empty = decode.state_slots.new_empty(0)
            return empty, empty.bool(), empty
        keys = decode.keys(self.block_size, self.kv_heads)
        return keys.rows, keys.padding, keys.last

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        state_slots: torch.Tensor, key_rows: torch.Tensor, padding: torch.Tensor, last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """What the graphs compute: the model's forward over n decode rows (row i = chunk i,
        state slot state_slots[i]) with deferred writes, the LM head and the argmax. Returns
        hidden (n, D), logits (n, V) fp32, argmax (n,), the new states in the order the layers
        recorded them and each attention layer's (key, value) (n, Hkv, Dh)."""
        deferred = DeferredWrites()
        key_layouts = {}
        if self.kv_heads is not None:
            key_layouts[(self.block_size, self.kv_heads)] = DecodeKeys(key_rows, padding, padding.shape[-1], last)
        rows = DecodeRows(
            chunk_indices=(), rows=state_slots, identity=True, state_slots=state_slots, slot_start=None,
            resets=None, first_key_zero=True, positions=(), block_tables=(), deferred=deferred,
            _keys=key_layouts,
        )
        batch = ForwardBatch(input_ids, positions, slot_mapping, chunks=(), cu_seqlens=(), decode_rows=rows)
        hidden = self.model(batch, self.caches)
        logits = self.model.compute_logits(hidden)
        return (hidden, logits, torch.argmax(logits, dim=-1), [values for _, values in deferred.states],
                [(key, value) for _, _, key, value in deferred.kv])

    def _warm_up_inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        """Inputs of `size` rows in slots 0.., each at position 2 * block_size of blocks 0, 1,
        2 (read only). Each is its own tensor, as a step's are (the compiled code is
        specialised on which inputs alias), and the row count (3) differs from the key width
        (48 with 16-token blocks): dynamic sizes equal when traced would share one symbol."""
        rows = DecodeRows(
            chunk_indices=tuple(range(size)), rows=torch.arange(size), identity=True,
            state_slots=torch.arange(size), slot_start=None, resets=None, first_key_zero=True,
            positions=(2 * self.block_size,) * size, block_tables=((0, 1, 2),) * size,
        )
        return (*(torch.zeros(size, dtype=torch.int64) for _ in range(3)), rows.state_slots, *self._keys(rows))


def apply_deferred_writes(
    caches: ModelCaches, decode: DecodeRows, slot_mapping: torch.Tensor,
    states: list[torch.Tensor], kv: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Write what a pass with deferred writes recorded (DeferredWrites, returned as tensors):
    states[2 j], states[2 j + 1] the new conv and recurrent states of the j-th recurrent layer
    (increasing layer order, as the layers record them) into decode's slots (one copy into a
    view where they are one run, DecodeRows.slot_start: several times cheaper than a scatter);
    kv[j] the K/V of the j-th attention layer at slot_mapping."""
    recurrent = sorted(caches.conv_state)
    targets = [t for layer in recurrent for t in (caches.conv_state[layer], caches.ssm_state[layer])]
    if len(targets) != len(states) or len(kv) != len(caches.key_cache):
        raise RuntimeError(f"deferred writes of {len(states)} states and {len(kv)} K/V pairs do not match "
                           f"the caches' {len(targets)} and {len(caches.key_cache)}")
    start = decode.slot_start
    for target, values in zip(targets, states):
        if start is not None:
            target[start : start + values.shape[0]].copy_(values)
        else:
            target.index_copy_(0, decode.state_slots, values.to(target.dtype))
    for layer, (key, value) in zip(sorted(caches.key_cache), kv):
        write_kv(caches.key_cache[layer], caches.value_cache[layer], slot_mapping, key, value)
