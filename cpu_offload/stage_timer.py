"""Timing the host decode step part by part (pjinfer.measure.bench.host_stages): ``repeat`` runs one part of
host_decode's step over every layer, as its handler runs it."""
from __future__ import annotations

from . import activation, attention, blocks, ffi, host_decode, int8, kernels, q4, quants, tables, team, vector_ir
from .ffi import NOJIT, load_i64, lock, store_i64, unlock
from .host_decode import H_NLAYERS, H_RUNTIME, H_TASK, K_LAYER, ST_ATTN, ST_HEAD, attend, run_head, run_layer, run_stage

from numba import njit  # noqa: E402

ffi.purge_stale_cache("stage_timer", activation, attention, blocks, ffi, host_decode, int8, kernels, q4, quants, tables,
                      team, vector_ir)

# What `repeat` times besides the team's stages (ST_*): the whole layer, and a hand-off of an empty stage.
PART_LAYER, PART_HANDOFF = 100, 101


@njit(**NOJIT)
def repeat(header, part, reps, pos, k_ptrs, v_ptrs, x, logits):
    """For timing a decode step part by part (pjinfer.measure.bench.stages): `reps` times over every layer, one
    part, under the ffi lock in the team's floating-point environment, as the handler runs it. part: a team stage
    (ST_QKV, ST_O, ST_GATE_UP, ST_DOWN on the scratch as it stands; ST_ATTN as ``attend``: the cache write, the
    stage and the merge, at pos of layer l's caches at k_ptrs[l], v_ptrs[l]), ST_HEAD (once a round, into logits
    [vocab]), PART_LAYER (run_layer on x), or PART_HANDOFF (the team runs an empty stage)."""
    runtime = load_i64(header + 8 * H_RUNTIME)
    lock(runtime)
    env = team.enter()
    task = load_i64(header + 8 * H_TASK)
    for _ in range(reps):
        if part == ST_HEAD:
            run_head(header, x, logits.ctypes.data)
            continue
        for layer in range(load_i64(header + 8 * H_NLAYERS)):
            store_i64(task + 8 * K_LAYER, layer)
            if part == PART_LAYER:
                run_layer(header, layer, pos, x, k_ptrs[layer], v_ptrs[layer])
            elif part == ST_ATTN:
                attend(header, pos, k_ptrs[layer], v_ptrs[layer])
            else:
                run_stage(header, part)
    team.leave(env)
    unlock(runtime)
