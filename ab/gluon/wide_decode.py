"""PROTOTYPE (not in the repo): the FCA wide decode tiles in Gluon, with the next step's Q.K^T in flight
on the tensor cores while the current step's softmax runs (FlashAttention-3's intra-warpgroup overlap),
and keys and values copied to a 3-stage shared-memory ring by cp.async (paged: one pointer per 16 bytes).

Triton 3.6's own pipeliner waits for every Q.K^T right after issuing it (warp_group_dot_wait pendings=0,
checked in its TTGIR for the lookahead form too), so that overlap needs Gluon.

Same plan format as arctic_rl_core.zorro.attention.triton_attention (items of 6 int32 fields: query offset,
query count, block-table row, kv start, kv end, partial row). Wide decode items only: every key of an item
is before every query's position, so only the range end is masked.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait



@gluon.jit
def _block_ids(table, kv0, kv_end, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LOAD: gl.constexpr):
    """(32-bit cache offsets: the prototype assumes a cache of under 2**31 values.) The cache block of each position ``kv0 + [0, BLOCK_N)``, one per row of the copy layout."""
    pos = kv0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    return gl.load(table + pos // BLOCK_SIZE, mask=pos < kv_end, other=0)


@gluon.jit
def _issue_kv(K_CACHE, V_CACHE, k_ring, v_ring, stage, block, kv0, kv_end, kv_head, stride_kb, stride_ks, stride_kh,
              HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LOAD: gl.constexpr):
    """cp.async of keys and values ``kv0 + [0, BLOCK_N)`` (in cache blocks ``block``) into ring stage ``stage``,
    zeros past ``kv_end``."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    pos = kv0 + rows
    valid = pos < kv_end
    row_off = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    offsets = gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(valid, 1)
    async_copy.async_copy_global_to_shared(k_ring.index(stage), K_CACHE + offsets, mask=mask)
    async_copy.async_copy_global_to_shared(v_ring.index(stage), V_CACHE + offsets, mask=mask)
    async_copy.commit_group()


@gluon.jit
def attend_wide_decode(
    Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE, BLOCK_TABLES, ITEMS, num_items, QUERY_INDEX, scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr = 3,
):
    # One warpgroup per 64 rows: 64-row tiles run 4 warps, 128-row ones 8.
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # 16 bytes per thread per row piece
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    OMMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, HEAD_DIM, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OMMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    OROW: gl.constexpr = gl.SliceLayout(1, OMMA)
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    RING: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = K_CACHE.dtype.element_ty

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], SMEM)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], RING)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], RING)

    for work in range(gl.program_id(0), num_items * NUM_KV_HEADS, gl.num_programs(0)):
        item = ITEMS + (work // NUM_KV_HEADS) * 6
        kv_head = work % NUM_KV_HEADS
        query_offset = gl.load(item)
        query_count = gl.load(item + 1)
        table = BLOCK_TABLES + gl.load(item + 2).to(gl.int64) * stride_bt
        kv_start = gl.load(item + 3)
        kv_end = gl.load(item + 4)
        partial_row = gl.load(item + 5)
        steps = gl.cdiv(kv_end - kv_start, BLOCK_N)

        gl.thread_barrier()  # every warp is past the last unit's products before its buffers are overwritten
        # The first STAGES - 1 steps' keys and values start on their way before the queries are read.
        for stage in gl.static_range(STAGES - 1):
            blocks = _block_ids(table, kv_start + stage * BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N, LOAD)
            _issue_kv(K_CACHE, V_CACHE, k_ring, v_ring, stage, blocks, kv_start + stage * BLOCK_N, kv_end, kv_head,
                      stride_kb, stride_ks, stride_kh, HEAD_DIM, BLOCK_SIZE, BLOCK_N, LOAD)
        # Block ids run a step ahead of the copies, so their load's latency hides behind a step's work.
        blocks = _block_ids(table, kv_start + (STAGES - 1) * BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N, LOAD)

        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
        row_valid = rows // GROUP < query_count
        token = gl.load(QUERY_INDEX + query_offset + rows // GROUP, mask=row_valid, other=0).to(gl.int64)
        head = kv_head * GROUP + rows % GROUP
        q = gl.load(Q + gl.expand_dims(token * stride_qt + head * stride_qh, 1) + gl.expand_dims(dims, 0),
                    mask=gl.expand_dims(row_valid, 1), other=0.0)
        q_smem.store(q)
        fence_async_shared()  # the generic proxy's writes, before the tensor cores' (async proxy) reads

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, ROW)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, OMMA)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)

        async_copy.wait_group(STAGES - 2)  # step 0 is in shared memory
        fence_async_shared()
        gl.thread_barrier()
        s_tok = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        for i in range(steps):
            kv0 = kv_start + i * BLOCK_N
            # Step i + STAGES - 1's copies replace step i - 1's, whose products finished at the end of the last step.
            gl.thread_barrier()
            _issue_kv(K_CACHE, V_CACHE, k_ring, v_ring, (i + STAGES - 1) % STAGES, blocks, kv0 + (STAGES - 1) * BLOCK_N,
                      kv_end, kv_head, stride_kb, stride_ks, stride_kh, HEAD_DIM, BLOCK_SIZE, BLOCK_N, LOAD)
            blocks = _block_ids(table, kv0 + STAGES * BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N, LOAD)
            async_copy.wait_group(STAGES - 2)  # step i + 1 is in shared memory (copies complete in order)
            fence_async_shared()
            gl.thread_barrier()
            # Step i + 1's scores on the tensor cores while this step's softmax runs.
            s_next_tok = warpgroup_mma(q_smem, k_ring.index((i + 1) % STAGES).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
            keys = kv0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
            s = gl.where(gl.expand_dims(keys < kv_end, 0), s, float("-inf"))  # (masked only on the last step:
            # 397 instead of 424 instructions per step, but 154 registers, 3 programs per SM instead of 4)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
            m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_shift)
            p = gl.exp2(s * scale_log2 - gl.expand_dims(m_shift, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, OROW), 1)
            p_op = gl.convert_layout(p.to(dtype), P_OP)
            acc_tok = warpgroup_mma(p_op, v_ring.index(i % STAGES), acc, is_async=True)
            s, acc = warpgroup_mma_wait(0, deps=[s_next_tok, acc_tok])
        async_copy.wait_group(0)

        out_rows = gl.arange(0, BLOCK_M, layout=OROW)
        out_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, OMMA))
        l_o = gl.convert_layout(l_i, OROW)
        m_o = gl.convert_layout(m_i, OROW)
        seen = l_o > 0.0
        out = acc / gl.expand_dims(gl.where(seen, l_o, 1.0), 1)
        o_valid = out_rows // GROUP < query_count
        o_head = kv_head * GROUP + out_rows % GROUP
        if partial_row < 0:
            o_token = gl.load(QUERY_INDEX + query_offset + out_rows // GROUP, mask=o_valid, other=0).to(gl.int64)
            gl.store(OUT + gl.expand_dims(o_token * stride_ot + o_head * stride_oh, 1) + gl.expand_dims(out_dims, 0),
                     out.to(OUT.dtype.element_ty), mask=gl.expand_dims(o_valid, 1))
        else:
            prow = (partial_row + out_rows // GROUP).to(gl.int64) * NUM_HEADS + o_head
            gl.store(PART_O + gl.expand_dims(prow * HEAD_DIM, 1) + gl.expand_dims(out_dims, 0),
                     out.to(PART_O.dtype.element_ty), mask=gl.expand_dims(o_valid, 1))
            lse = gl.where(seen, (m_o + gl.log2(gl.where(seen, l_o, 1.0))) / 1.4426950408889634, float("-inf"))
            gl.store(PART_LSE + prow, lse, mask=o_valid)
