"""Build the prototype for sm_90a with no GPU: PYTHONPATH=. <python with triton 3.6> ab/gluon/build.py [ROWS [MAXNREG]]."""
import sys, re
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parent)]
from wide_decode import attend_wide_decode as fn
from arctic_rl_core.triton_aot import register_use

types = {n: "*bf16" for n in ("Q", "K_CACHE", "V_CACHE", "OUT", "PART_O")}
types.update({n: "*i32" for n in ("BLOCK_TABLES", "ITEMS", "QUERY_INDEX")}, PART_LSE="*fp32", scale_log2="fp32")
M = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ST = int(sys.argv[3]) if len(sys.argv) > 3 else 3
consts = dict(NUM_HEADS=14, NUM_KV_HEADS=2, GROUP=7, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_M=M, BLOCK_N=int(sys.argv[4]) if len(sys.argv) > 4 else 64, WARPS=M // 16, STAGES=ST)
names = fn.arg_names
sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
aligned = [n for n in names if n in types and n != "scale_log2"] + ["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_ot", "stride_oh"]
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
src = GluonASTSource(fn, sig, {(names.index(n),): v for n, v in consts.items()}, attrs)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=M // 16, **({"maxnreg": int(sys.argv[2])} if len(sys.argv) > 2 and int(sys.argv[2]) else {})))
u = register_use(c)
print("registers", u.registers, "spills", u.spill_stores, u.spill_loads, "shared", c.metadata.shared)
sass_waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", c.asm["ptx"])
print("ptx wgmma waits", sass_waits, "wgmma", len(re.findall(r"wgmma.mma_async", c.asm["ptx"])))
ptx = c.asm["ptx"]
for op in ("cp.async.cg", "cp.async.ca", "st.shared", "ld.shared", "bar.sync", "fence.proxy.async", "ex2.approx", "ld.global", "cp.async.wait_group", "shfl.sync"):
    print(op, ptx.count(op))
import collections
from arctic_rl_core.triton_aot import loop_opcodes
for taken in (False, True):
    ops = collections.Counter(loop_opcodes(c, "HGMMA", branches_taken=taken))
    print("step loop", sum(ops.values()), "instructions", "(branches taken)" if taken else "", " ".join(f"{k} {v}" for k, v in ops.most_common()))
