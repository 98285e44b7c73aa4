"""PROTOTYPE (not for the repo): the engine's attention kernel with per-program timestamps.

The production module's source is patched at import: ``_attend_items`` takes ``TRACE`` (int64, per program
``2 * MAXU + 6`` slots) and records %globaltimer and %clock64 at its start, the clock at each work unit's start
and end, and both at its end, plus its SM. Everything else is the kernel the engine runs.
"""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "arctic_rl_core/zorro/attention/triton_attention.py"

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

'''


def _patch(text: str) -> str:
    def once(old, new):
        nonlocal text
        assert text.count(old) == 1, old
        text = text.replace(old, new)

    once("\n@triton.jit\ndef _block_ids(", HELPERS + "\n@triton.jit\ndef _block_ids(")
    once("    INT32_OFFSETS: tl.constexpr,\n):  # fmt: skip\n    \"\"\"Persistent over",
         "    INT32_OFFSETS: tl.constexpr, TRACE, MAXU: tl.constexpr,\n):  # fmt: skip\n    \"\"\"Persistent over")
    once("    if USE_PDL and not EARLY:\n",
         "    _tb = TRACE + tl.program_id(0) * (2 * MAXU + 6)\n"
         "    tl.store(_tb, _gtimer())\n    tl.store(_tb + 1, _clock())\n    tl.store(_tb + 2, _smid().to(tl.int64))\n"
         "    _u = 0\n"
         "    if USE_PDL and not EARLY:\n")
    once("        if work < num_wide:\n            if HAS_WIDE:",
         "        tl.store(_tb + 3 + 2 * _u, _clock(), mask=_u < MAXU)\n"
         "        if work < num_wide:\n            if HAS_WIDE:")
    once("    if USE_PDL:\n        if EARLY:\n",
         "        tl.store(_tb + 4 + 2 * _u, _clock(), mask=_u < MAXU)\n        _u += 1\n"
         "    if USE_PDL:\n        if EARLY:\n")
    once("        gdc_launch_dependents()\n\n\n@triton.jit\ndef _merge_partials(",
         "        gdc_launch_dependents()\n"
         "    tl.store(_tb + 3 + 2 * MAXU, _clock())\n    tl.store(_tb + 4 + 2 * MAXU, _gtimer())\n"
         "    tl.store(_tb + 5 + 2 * MAXU, _u.to(tl.int64))\n"
         "\n\n@triton.jit\ndef _merge_partials(")
    # paged_attention passes the trace buffer through (module global set by the driver).
    once("    _attend_items[(programs,)](*args, **options,",
         "    _attend_items[(programs,)](*args, TRACE=TRACE_BUF[0], MAXU=MAXU_, **options,")
    once("        compiled = _attend_items.warmup(*args, grid=(1,), **options)",
         "        compiled = _attend_items.warmup(*args, TRACE=TRACE_BUF[0], MAXU=MAXU_, grid=(1,), **options)")
    return text + "\n\nTRACE_BUF = [None]\nMAXU_ = 4\n"


def load():
    path = Path(__file__).parent / "_traced_attention.py"
    path.write_text(_patch(SRC.read_text()))
    spec = importlib.util.spec_from_file_location("_traced_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_traced_attention"] = module
    spec.loader.exec_module(module)
    return module
