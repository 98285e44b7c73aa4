"""Build Triton kernels for a named NVIDIA GPU with no GPU present, and read what the build costs.

Triton compiles for a target it is told about, down to a cubin, through the
``ptxas`` it bundles. So this CPU machine can check that a kernel (or a
variant of one) builds for Hopper, how many registers and spill bytes each
thread needs (the numbers that decide how many programs fit on an SM), and
what a loop's machine code holds. Used by
``tests/unit/test_triton_kernels_compile.py`` and ``scripts/kernel_registers.py``.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for(
    fn, types: dict[str, str], constants: dict, aligned: Iterable[str] = (), target: GPUTarget = HOPPER, **options
):  # fmt: skip
    """``fn`` built for ``target``: ``types`` names the pointer and float arguments (the rest are int32).

    ``aligned`` names the arguments whose values are multiples of 16 (pointers'
    addresses, strides). At run time Triton's JIT specializes on exactly that,
    and it decides whether loads are vectorized, so the build here must say it
    too to match what the GPU runs.
    """
    names = fn.arg_names
    unknown = (set(constants) | set(types) | set(aligned)) - set(names)
    if unknown:
        raise ValueError(f"{fn.__name__} has no argument(s) {sorted(unknown)}; its arguments are {names}")
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return triton.compile(source, target=target, options=options)


@dataclass(frozen=True)
class RegisterUse:
    """Per thread, as ``ptxas -v`` reports it."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes


def register_use(compiled, target: GPUTarget = HOPPER) -> RegisterUse:
    """Assemble ``compiled``'s PTX again with ``-v`` (Triton discards that log) and parse its usage line."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        done = subprocess.run(
            [get_ptxas(target.arch).path, "-v", f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp) / "kernel.o")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    log = done.stderr + done.stdout
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register usage:\n{log}")
    return RegisterUse(int(registers.group(1)), int(spills.group(1)), int(spills.group(2)))


def loop_opcodes(compiled, marker: str, target: GPUTarget = HOPPER, branches_taken: bool = False) -> list[str]:
    """The opcodes (``LDG``, ``HGMMA``, ...) of the loop that holds the last instruction containing ``marker``.

    Read from ``nvdisasm``'s listing of the cubin: the loop runs from the
    label that the first backward branch after that instruction jumps to,
    down to that branch. What the listing shows is what each iteration
    issues, so instruction diets are checked here, with no GPU. With
    ``branches_taken``, what the loop's forward branches jump over is left
    out: the path of an iteration that takes each of them (in the attention
    kernel's step loop, a whole step, with no masks to apply).
    """
    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = Path(get_ptxas(target.arch).path).with_name("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        listing = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = listing.splitlines()
    # Instruction lines carry their address as /*0a30*/; labels stand alone as .L_x_N:
    instruction = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
    branch_to = re.compile(r"BRA `?\((\.L_x_\d+)\)")  # a branch and the label it jumps to
    marked = max(i for i, line in enumerate(lines) if instruction.search(line) and marker in line)
    for i in range(marked, len(lines)):
        branch = branch_to.search(lines[i])
        if branch and f"{branch.group(1)}:" in lines[:marked]:
            start = lines.index(f"{branch.group(1)}:")
            break
    else:
        raise ValueError(f"no loop holds the last instruction containing {marker!r}")
    loop = lines[start : i + 1]
    skipped = set()
    if branches_taken:
        for j, line in enumerate(loop):
            branch = branch_to.search(line)
            if branch and f"{branch.group(1)}:" in loop[j:]:
                skipped.update(range(j + 1, loop.index(f"{branch.group(1)}:", j)))
    opcodes = []
    for j, line in enumerate(loop):
        found = instruction.search(line)
        if found and j not in skipped:
            words = found.group(1).split()
            opcode = words[1] if words[0].startswith("@") else words[0]  # skip a predicate guard
            opcodes.append(opcode.split(".")[0])
    return opcodes
