"""PROTOTYPE (not for the repo): the engine's attention kernel with per-program and per-unit timestamps.

The production module's source is patched at import. ``_attend_items`` takes ``TRACE`` (int64, per program
``SLOTS`` slots) and records %globaltimer and %clock64 at its start, its SM, and per work unit (``UNIT_SLOTS``
each, at most ``MAXU`` units): the clock at the unit's start, once its item fields, query tokens, positions,
queries and (wide tiles) first keys are in registers, after its step loop, and at its end. Each stamp takes its
input as an asm operand, so it waits for that value as the code after it would. Then the clock and the global
timer at the program's end, and how many units it ran.
"""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "arctic_rl_core/zorro/attention/triton_attention.py"
MAXU = 4
UNIT_SLOTS = 8  # start, item, token, position, q, first keys, loop end, end
SLOTS = 3 + UNIT_SLOTS * MAXU + 3
STAMPS = ("item", "token", "position", "q", "keys", "loop")

HELPERS = '''

@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gtimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _clock_after(x):
    """The clock once ``x`` (any shape) is in registers, per element."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [bits], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp0(ptr, x):
    tl.store(ptr, _clock_after(x))


@triton.jit
def _stamp1(ptr, x):
    c = _clock_after(x)
    tl.store(ptr + c * 0, c, mask=tl.arange(0, c.shape[0]) == 0)


@triton.jit
def _stamp2(ptr, x):
    c = _clock_after(x)
    first = (tl.arange(0, c.shape[0])[:, None] == 0) & (tl.arange(0, c.shape[1])[None, :] == 0)
    tl.store(ptr + c * 0, c, mask=first)

'''


def _patch(text: str) -> str:
    def once(old, new):
        nonlocal text
        assert text.count(old) == 1, old
        text = text.replace(old, new)

    once("\n@triton.jit\ndef _block_ids(", HELPERS + "\n@triton.jit\ndef _block_ids(")
    # _attend_item: a unit's trace slots, and the stamps.
    once("    INT32_OFFSETS: tl.constexpr,\n):  # fmt: skip\n    \"\"\"One work unit:",
         "    INT32_OFFSETS: tl.constexpr, TR,\n):  # fmt: skip\n    \"\"\"One work unit:")
    once("    partial_row = tl.load(item + 5)\n",
         "    partial_row = tl.load(item + 5)\n    _stamp0(TR + 1, partial_row + kv_end + kv_start + query_count)\n")
    once("    position = tl.load(QUERY_POS + token, mask=row_valid, other=-1)\n",
         "    _stamp1(TR + 2, token)\n    position = tl.load(QUERY_POS + token, mask=row_valid, other=-1)\n"
         "    _stamp1(TR + 3, position)\n")
    once("                other=0.0)  # fmt: skip\n    if not MAY_OVERRUN:",
         "                other=0.0)  # fmt: skip\n    _stamp2(TR + 4, q)\n    if not MAY_OVERRUN:")
    once("    m_i = tl.full([BLOCK_M], float(\"-inf\"), tl.float32)\n",
         "    if PREFETCH:\n        _stamp2(TR + 5, k)\n    m_i = tl.full([BLOCK_M], float(\"-inf\"), tl.float32)\n")
    once("    seen = l_i > 0.0\n", "    _stamp1(TR + 6, l_i)\n    seen = l_i > 0.0\n")
    # _attend_items: the program's slots, and each unit's start and end.
    once("    INT32_OFFSETS: tl.constexpr,\n):  # fmt: skip\n    \"\"\"Persistent over",
         "    INT32_OFFSETS: tl.constexpr, TRACE, MAXU: tl.constexpr, UNIT_SLOTS: tl.constexpr,\n"
         "):  # fmt: skip\n    \"\"\"Persistent over")
    once("    if USE_PDL and not EARLY:\n",
         "    _tb = TRACE + tl.program_id(0) * (3 + UNIT_SLOTS * MAXU + 3)\n"
         "    tl.store(_tb, _gtimer())\n    tl.store(_tb + 1, _clock())\n    tl.store(_tb + 2, _smid().to(tl.int64))\n"
         "    _u = 0\n"
         "    if USE_PDL and not EARLY:\n")
    once("        if work < num_wide:\n            if HAS_WIDE:",
         "        _tr = _tb + 3 + UNIT_SLOTS * tl.minimum(_u, MAXU - 1)\n"
         "        tl.store(_tr, _clock())\n"
         "        if work < num_wide:\n            if HAS_WIDE:")
    once("first=first, WAIT=USE_PDL, DECODE=DECODE, MAY_OVERRUN=False, INT32_OFFSETS=INT32_OFFSETS,\n",
         "first=first, WAIT=USE_PDL, DECODE=DECODE, MAY_OVERRUN=False, INT32_OFFSETS=INT32_OFFSETS, TR=_tr,\n")
    once("first=first, WAIT=USE_PDL, DECODE=DECODE, MAY_OVERRUN=True, INT32_OFFSETS=INT32_OFFSETS,\n",
         "first=first, WAIT=USE_PDL, DECODE=DECODE, MAY_OVERRUN=True, INT32_OFFSETS=INT32_OFFSETS, TR=_tr,\n")
    once("    if USE_PDL:\n        if EARLY:\n",
         "        tl.store(_tr + UNIT_SLOTS - 1, _clock())\n        _u += 1\n"
         "    if USE_PDL:\n        if EARLY:\n")
    once("\n\n\n@triton.jit\ndef _merge_partials(",
         "\n"
         "    _te = _tb + 3 + UNIT_SLOTS * MAXU\n"
         "    tl.store(_te, _clock())\n    tl.store(_te + 1, _gtimer())\n    tl.store(_te + 2, _u.to(tl.int64))\n"
         "\n\n@triton.jit\ndef _merge_partials(")
    # paged_attention passes the trace buffer through (a module global the driver sets).
    once("    _attend_items[(programs,)](*args, **options,",
         "    _attend_items[(programs,)](*args, TRACE=TRACE_BUF[0], MAXU=MAXU_, UNIT_SLOTS=UNIT_SLOTS_, **options,")
    once("        compiled = _attend_items.warmup(*args, grid=(1,), **options)",
         "        compiled = _attend_items.warmup(*args, TRACE=TRACE_BUF[0], MAXU=MAXU_, UNIT_SLOTS=UNIT_SLOTS_, "
         "grid=(1,), **options)")
    return text + f"\n\nTRACE_BUF = [None]\nMAXU_ = {MAXU}\nUNIT_SLOTS_ = {UNIT_SLOTS}\n"


def load(text=None):
    path = Path(__file__).parent / "_traced_attention.py"
    path.write_text(_patch(SRC.read_text() if text is None else text))
    spec = importlib.util.spec_from_file_location("_traced_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_traced_attention"] = module
    spec.loader.exec_module(module)
    return module
