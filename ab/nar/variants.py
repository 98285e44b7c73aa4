"""PROTOTYPE: variants of the engine's attention kernel, as source patches applied at import (see ab/trace/traced.py)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "arctic_rl_core/zorro/attention/triton_attention.py"

# The attention kernel lets the merge launch as soon as every program has started (not after each program's end):
# the merge's programs then sit resident, past their index loads, waiting for the kernel's completion.
EARLY_TRIGGER = [
    ("    if USE_PDL and not EARLY:\n        # Launched as a programmatic dependent",
     "    if USE_PDL:\n        gdc_launch_dependents()\n    if USE_PDL and not EARLY:\n        # Launched as a programmatic dependent"),
    ("            gdc_wait()\n        # This program is done: the merge's programs may take its place and read their indices early.\n"
     "        gdc_launch_dependents()\n",
     "            gdc_wait()\n"),
]

# The narrow tiles step NARROW_N keys at a time in launches with wide tiles (FCA plans), so a suffix unit's keys
# are all requested at once instead of one loaded-memory latency per 64-key step (plain launches keep BLOCK_N).
NARROW_STEP_KEYS = [
    ("    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,\n",
     "    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,\n"
     "    NARROW_N: tl.constexpr,\n"),
    ("NUM_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, NARROW_M, BLOCK_N, PRECISION, PREFETCH=NARROW_PREFETCH,",
     "NUM_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, NARROW_M, NARROW_N, PRECISION, PREFETCH=NARROW_PREFETCH,"),
    ("        HAS_WIDE=wide, PRECISION=",
     "        NARROW_N=NARROW_N_WITH_WIDE if wide else tiles.block_n, HAS_WIDE=wide, PRECISION="),
]

# Partials laid out by query (query * max_partials + k): the attention kernel writes each row where a per-row map
# (loaded with the unit's plan) says, and the merge reads a query's partials at computed addresses, with no index
# loads (two dependent loads fewer on the merge's path, which the next layer's attention waits for).
STRIDED_MERGE = [
    ("PART_O, PART_LSE, BLOCK_TABLES", "PART_O, PART_LSE, PART_MAP, BLOCK_TABLES", 4),
    ("    row_valid = row_query < query_count\n",
     "    row_valid = row_query < query_count\n"
     "    dest = tl.load(PART_MAP + tl.maximum(partial_row, 0) + row_query, mask=row_valid, other=0)\n"),
    ("        prow = (partial_row + row_query).to(tl.int64) * NUM_HEADS + head\n",
     "        prow = dest.to(tl.int64) * NUM_HEADS + head\n"),
    ('    plan = ("BLOCK_TABLES", ', '    plan = ("PART_MAP", "BLOCK_TABLES", '),
    ("workspace.partial_lse, block_tables, plan.wide_items,",
     "workspace.partial_lse, plan.part_map, block_tables, plan.wide_items,"),
    ("""        _merge_partials[(num_tokens, num_heads)](
            out, workspace.partial_out, workspace.partial_lse, plan.merge_offsets, plan.merge_rows,
            out.stride(0), out.stride(1),""",
     """        assert workspace.partial_lse.shape[0] >= num_tokens * plan.max_partials
        _merge_strided[(num_tokens, num_heads)](
            out, workspace.partial_out, workspace.partial_lse, plan.merge_counts, plan.max_partials,
            out.stride(0), out.stride(1),"""),
]
STRIDED_TAIL = '''

@triton.jit
def _merge_strided(
    OUT, PART_O, PART_LSE, COUNTS, MAXP, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.load(COUNTS + token)
    dims = tl.arange(0, HEAD_DIM)
    base = token.to(tl.int64) * MAXP
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for e0 in range(0, MAXP, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < MAXP
        prow = (base + e) * NUM_HEADS + head
        lse = tl.load(PART_LSE + prow, mask=inside, other=float("-inf"))
        o = tl.load(PART_O + prow[:, None] * HEAD_DIM + dims[None, :], mask=inside[:, None], other=0.0)
        valid = e < n
        lse = tl.where(valid, lse, float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse - m_shift)
        alpha = tl.exp(m - m_shift)
        total = total * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * tl.where(valid[:, None], o.to(tl.float32), 0.0), axis=0)
        m = m_new
    if n > 0:
        out = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(OUT + token * stride_ot + head * stride_oh + dims, out.to(OUT.dtype.element_ty))


import numpy as _np

_from_plan = DevicePlan.from_plan.__func__


def _from_plan_strided(cls, plan, device):
    dp = _from_plan(cls, plan, device)
    counts = _np.diff(plan.merge_offsets).astype(_np.int64)
    maxp = max(int(counts.max(initial=0)), 1)
    part_map = _np.zeros(len(plan.merge_rows) + 256, _np.int32)  # direct items read (and ignore) its start
    q = _np.repeat(_np.arange(len(counts)), counts)
    e = _np.arange(len(plan.merge_rows)) - _np.repeat(plan.merge_offsets[:-1].astype(_np.int64), counts)
    part_map[plan.merge_rows] = q * maxp + e
    dp.part_map = torch.from_numpy(part_map).to(device)
    dp.merge_counts = torch.from_numpy(counts.astype(_np.int32)).to(device)
    dp.max_partials = maxp
    return dp


DevicePlan.from_plan = classmethod(_from_plan_strided)
_allocate = Workspace.allocate.__func__
Workspace.allocate = classmethod(lambda cls, rows, *a, **k: _allocate(cls, 2 * rows, *a, **k))
'''

def prefetch_patches(level: int, dist: int):
    """The wide tiles prefetch each step's key and value rows into L``level`` ``dist`` steps before its use (one
    step before the register loads, which run one step ahead), from block ids loaded a step before that: a load
    in flight that holds no register."""
    asm = f"prefetch.global.L{level} [$1]; mov.u32 $0, 0;"
    helper = f'''
@triton.jit
def _prefetch_rows(K_CACHE, V_CACHE, blocks, kv_head, stride_kb, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    rows = blocks.to(tl.int64) * stride_kb + (tl.arange(0, BLOCK_N) % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    tl.inline_asm_elementwise("{asm}", "=r,l", [(K_CACHE + rows).to(tl.int64, bitcast=True)], dtype=tl.int32,
                              is_pure=False, pack=1)
    tl.inline_asm_elementwise("{asm}", "=r,l", [(V_CACHE + rows).to(tl.int64, bitcast=True)], dtype=tl.int32,
                              is_pure=False, pack=1)

'''
    return [
        ("\n@triton.jit\ndef _block_ids(", helper + "\n@triton.jit\ndef _block_ids("),
        ("        blocks = _block_ids(table, kv_start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)\n",
         "        blocks = _block_ids(table, kv_start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)\n"
         f"        for s in tl.static_range(2, {dist}):\n"
         "            _prefetch_rows(K_CACHE, V_CACHE, _block_ids(table, kv_start + s * BLOCK_N, kv_end, BLOCK_SIZE, "
         "BLOCK_N), kv_head, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, BLOCK_N)\n"
         f"        pblocks = _block_ids(table, kv_start + {dist} * BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)\n"),
        ("            v_step = _values(v, V_CACHE.dtype.element_ty)\n",
         "            v_step = _values(v, V_CACHE.dtype.element_ty)\n"
         "            _prefetch_rows(K_CACHE, V_CACHE, pblocks, kv_head, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, "
         "BLOCK_N)\n"
         f"            pblocks = _block_ids(table, kv0 + {dist + 1} * BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)\n"),
    ]


# The narrow (suffix) units first: their cold reads overlap the wide units' opening instead of the kernel's end.
NARROW_FIRST = [
    ("    num_wide = tl.load(COUNTS) * NUM_KV_HEADS\n    num_work = num_wide + tl.load(COUNTS + 1) * NUM_KV_HEADS\n",
     "    num_narrow = tl.load(COUNTS + 1) * NUM_KV_HEADS\n    num_work = num_narrow + tl.load(COUNTS) * NUM_KV_HEADS\n"),
    ("        if work < num_wide:\n            if HAS_WIDE:", "        if work >= num_narrow:\n            if HAS_WIDE:"),
    ("WIDE_ITEMS + (work // NUM_KV_HEADS) * 6, work % NUM_KV_HEADS,",
     "WIDE_ITEMS + ((work - num_narrow) // NUM_KV_HEADS) * 6, (work - num_narrow) % NUM_KV_HEADS,"),
    ("            unit = work - num_wide\n", "            unit = work\n"),
]

# Only the first step's keys are requested before the wait; its values after the queries, so the queries' load
# queues behind half the bytes (the values are needed only after the scores).
KEYS_FIRST = [
    ("""        k, v = _load_kv(K_WORDS, V_WORDS, blocks, kv_start, written_end, kv_head, word_kb, word_ks, word_kh, WORDS,
                        BLOCK_SIZE, BLOCK_N, INT32_OFFSETS)  # fmt: skip
        blocks = _block_ids(table, kv_start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)
""", """        first_blocks = blocks
        offsets0, valid0 = _kv_offsets(blocks, kv_start, written_end, kv_head, word_kb, word_ks, word_kh, WORDS,
                                       BLOCK_SIZE, BLOCK_N, INT32_OFFSETS)
        k = tl.load(K_WORDS + offsets0, mask=valid0, other=0)
        blocks = _block_ids(table, kv_start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)
"""),
    ("""            k, v = _load_kv(K_WORDS, V_WORDS, _block_ids(table, kv_start, kv_end, BLOCK_SIZE, BLOCK_N), kv_start,
                            kv_end, kv_head, word_kb, word_ks, word_kh, WORDS, BLOCK_SIZE, BLOCK_N,
                            INT32_OFFSETS)  # fmt: skip
""", """            offsets_r, valid_r = _kv_offsets(first_blocks, kv_start, kv_end, kv_head, word_kb, word_ks, word_kh, WORDS,
                                             BLOCK_SIZE, BLOCK_N, INT32_OFFSETS)
            k = tl.load(K_WORDS + offsets_r, mask=valid_r, other=0)
"""),
    ("""                other=0.0)  # fmt: skip
    if not MAY_OVERRUN:
""", """                other=0.0)  # fmt: skip
    if PREFETCH:
        offsets_v, valid_v = _kv_offsets(first_blocks, kv_start, kv_end, kv_head, word_kb, word_ks, word_kh, WORDS,
                                         BLOCK_SIZE, BLOCK_N, INT32_OFFSETS)
        v = tl.load(V_WORDS + offsets_v, mask=valid_v, other=0)
    if not MAY_OVERRUN:
"""),
]

# A program's first unit asks L2 for its first step's keys and values before the wait (a prefetch: no registers,
# no data back to the SM, and no need to know which keys the kernel before is writing, since L2 is coherent), then
# loads its queries and that step's keys and values after the wait.
L2_OPENING = [
    ("\n@triton.jit\ndef _block_ids(", '''
@triton.jit
def _prefetch_rows(K_CACHE, V_CACHE, blocks, kv_head, stride_kb, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    rows = blocks.to(tl.int64) * stride_kb + (tl.arange(0, BLOCK_N) % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [(K_CACHE + rows).to(tl.int64, bitcast=True)],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [(V_CACHE + rows).to(tl.int64, bitcast=True)],
                              dtype=tl.int32, is_pure=False, pack=1)

''' + "\n@triton.jit\ndef _block_ids("),
    ("""        k, v = _load_kv(K_WORDS, V_WORDS, blocks, kv_start, written_end, kv_head, word_kb, word_ks, word_kh, WORDS,
                        BLOCK_SIZE, BLOCK_N, INT32_OFFSETS)  # fmt: skip
        blocks = _block_ids(table, kv_start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)
""", """        first_blocks = blocks
        if first:
            _prefetch_rows(K_CACHE, V_CACHE, blocks, kv_head, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, BLOCK_N)
        blocks = _block_ids(table, kv_start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)
"""),
    ("""        if written_end < tl.minimum(kv_end, kv_start + BLOCK_N):  # the first step holds keys written just before
            k, v = _load_kv(K_WORDS, V_WORDS, _block_ids(table, kv_start, kv_end, BLOCK_SIZE, BLOCK_N), kv_start,
                            kv_end, kv_head, word_kb, word_ks, word_kh, WORDS, BLOCK_SIZE, BLOCK_N,
                            INT32_OFFSETS)  # fmt: skip
""", """        pass
"""),
    ("""                other=0.0)  # fmt: skip
    if not MAY_OVERRUN:
""", """                other=0.0)  # fmt: skip
    if PREFETCH:
        k, v = _load_kv(K_WORDS, V_WORDS, first_blocks, kv_start, kv_end, kv_head, word_kb, word_ks, word_kh, WORDS,
                        BLOCK_SIZE, BLOCK_N, INT32_OFFSETS)
    if not MAY_OVERRUN:
"""),
]

PATCHES = {"base": [], "l2o": L2_OPENING, "kf": KEYS_FIRST, "trig0": EARLY_TRIGGER, "nf": NARROW_FIRST, "nn": NARROW_STEP_KEYS, "sm": STRIDED_MERGE}
TAILS = {"sm": STRIDED_TAIL}
for _level in (1, 2):
    for _dist in (2, 3, 4):
        PATCHES[f"pf{_level}d{_dist}"] = prefetch_patches(_level, _dist)


def patch(text: str, edits) -> str:
    for old, new, *count in edits:
        assert text.count(old) == (count[0] if count else 1), old
        text = text.replace(old, new)
    return text


def source(name: str) -> str:
    """The engine's kernel module's source with the patches of ``name`` ("a+b": both) applied."""
    text = SRC.read_text()
    for part in name.split("+"):
        text = patch(text, PATCHES[part])
    return text + "\nNARROW_N_WITH_WIDE = 256\n" + "".join(TAILS.get(part, "") for part in name.split("+"))


def load(name: str):
    """The kernel module with the patches of ``name`` applied."""
    text = source(name)
    path = Path(__file__).parent / f"_variant_{name.replace('+', '_')}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
