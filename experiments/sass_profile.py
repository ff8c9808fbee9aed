"""The GPU kernels' machine code, without a GPU: registers, spills and instructions a weight,
from a deviceless compile for an H100.

A GPU lease is short; what the kernels cost in instructions is a property of their code, and
the code can be compiled without one. Each case compiles ``kernels.mosaic_gpu.gemv`` or
``decode_matmul`` at 8192^2 for an H100 (sm_90a) through jax's CUDA plugin with no device (a
compile-only topology from a target description), Mosaic GPU dumping the PTX; ``ptxas`` then
assembles it (registers, spills) and ``nvdisasm`` disassembles it. The pipeline step's loop,
the innermost loop of more than 50 instructions, is the kernel's hot loop: its instructions
divided by the index words a thread decodes a step are the cost of a word (8 weights of D4
q=4 M=2). A memory-bound kernel must stay under the GPU's issue rate: an H100 issues about
33·10^12 thread instructions a second against 3.35·10^12 bytes of HBM, so ~10 instructions a
byte of codes (5/8 byte a weight: ~6 a weight) is where a kernel stops being memory-bound.

Triton's ``gemv`` and ``decode_matmul`` (what ``hq.matmul`` runs on an H100 today) are read
the same way from the binaries in XLA's serialized executable (:func:`cubins`; ``cuobjdump``
for their registers; :data:`TRITON_CASES`): the H100 timed the gemv at 11.9 instructions a
weight (51.7 us, 128 registers) before the words, the sums kept per tile column, the fused
multiply-adds and the ``prmt`` fields.

It also lists the kernels each compiled call launches (the kernel and the XLA operations
around it: x's planes, the split-K sums), and those of ``hq.matmul(..., "pallas")`` (Triton's
kernels today) at batch 1-64: at a GEMV's 10-50 us, each launch's microsecond or two counts.
And it counts the encoder's instructions a block (:func:`analyse_encode`): at ~33·10^12
instructions a second, a block's 16 bytes of float32 input and ~2.5 of codes move at a
quarter of the HBM peak only below ~750 instructions a block, all its attempts included.

Needs (not the project's dependencies: a GPU toolchain on a CPU machine):
``pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
nvidia-cuda-nvdisasm``, and a ``ptxas`` and ``cuobjdump`` of CUDA >= 13 (jaxlib's LLVM
writes PTX 9.0): ``--ptxas``, ``--nvdisasm``, ``--cuobjdump`` or on ``PATH``.

Writes ``results/sass_profile.json`` and the table in ``docs/kernels.md``.

Usage: ``python experiments/sass_profile.py`` (``--report``: the table from the saved JSON)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from report import DOCS, RESULTS, add_report_flag, load_results, markdown_table, \
    write_between_markers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# An H100 SXM as XLA's GPU compiler describes it (the compile-only topology's device)
H100 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version: { major: 12 minor: 8 patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

N = 8192
# (kernel, rows of x, launch parameters over the tuning table's): the defaults, and the
# variants the sweep chooses between
CASES = [("gemv", 1, {}), ("gemv", 8, {}),
         ("decode_matmul", 1, {}), ("decode_matmul", 16, {}),
         ("decode_matmul", 16, {"a_registers": False}),
         ("decode_matmul", 16, {"block_n": 128}), ("decode_matmul", 16, {"block_w": 64}),
         ("decode_matmul", 64, {"a_registers": False, "stages": 3})]

# Triton's kernels (what hq.matmul runs on an H100 today) at 8192^2: (kernel, lattice, rows
# of x, launch parameters over the tuning table's): the entry block by block and as words,
# gemv at 128 blocks a step and at 4 rows, decode_matmul with float16 operands
TRITON_CASES = [("gemv", "D4", 1, {"words": False}), ("gemv", "D4", 1, {}),
                ("gemv", "D4", 1, {"block_n": 16, "block_k": 128}), ("gemv", "D4", 4, {}),
                ("gemv", "E8", 1, {"words": False}), ("gemv", "E8", 1, {}),
                ("decode_matmul", "D4", 16, {"words": False}), ("decode_matmul", "D4", 16, {}),
                ("decode_matmul", "D4", 16, {"f16": True}), ("decode_matmul", "E8", 16, {}),
                ("decode_matmul", "E8", 16, {"f16": True})]

# Every other variant the kernels' code takes (T views, corrupt-index masks, the dither's
# planes, other codebooks, one block a word, A's two paths), compiled at 1024^2 to check that
# each assembles: (lattice, q, M, max_T, dither, kernel, rows of x, launch parameters)
VARIANTS = [("D4", 4, 2, 20, False, "gemv", 2, {}),
            ("D4", 4, 2, 20, False, "decode_matmul", 16, {}),
            ("D4", 3, 2, 14, False, "gemv", 1, {}),
            ("D4", 3, 2, 14, False, "decode_matmul", 32, {"a_registers": True}),
            ("D4", 4, 2, 14, True, "gemv", 8, {}),
            ("D4", 4, 2, 14, True, "decode_matmul", 5, {"a_registers": False}),
            ("D4", 4, 2, 14, True, "decode_matmul", 12, {"a_registers": True}),
            ("D4", 2, 4, 20, True, "decode_matmul", 16, {"a_registers": True}),
            ("A2", 8, 2, 14, False, "gemv", 1, {}),
            ("A2", 8, 2, 14, False, "decode_matmul", 16, {}),
            ("Z2", 8, 2, 14, False, "decode_matmul", 64, {"a_registers": False})]


def _h100():
    """The sharding of an H100 without a device (a compile-only topology). Triton's lowering
    asks the device for its generation: jax's own table answers for it."""
    import jax
    from jax._src.pallas.triton import gpu_info
    from jax.experimental.topologies import get_topology_desc

    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    dev = get_topology_desc("h100", "cuda", target_config=H100, topology="1x1x1").devices[0]
    return jax.sharding.SingleDeviceSharding(dev)


def _compiled(fn, cfg, n: int, batch: int):
    """``fn(x, codes)`` compiled for an H100 without a device: bfloat16 x ``[batch, n]``, the
    row codes of an ``n x n`` weight."""
    import jax
    import jax.numpy as jnp

    import hnlq_jax as hq

    sharding = _h100()
    codes = jax.eval_shape(lambda: hq.encode_rows(jnp.zeros((n, n), jnp.float32), cfg))
    codes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                         codes)
    x = jax.ShapeDtypeStruct((batch, n), jnp.bfloat16, sharding=sharding)
    return jax.jit(fn).trace(x, codes).lower().compile()


def _compile(kernel: str, cfg, n: int, batch: int, params: dict):
    """A deviceless compile of one kernel call for the H100: its launch parameters and the
    compiled program."""
    import jax.numpy as jnp

    from hnlq_jax.kernels import mosaic_gpu

    fn = getattr(mosaic_gpu, kernel)
    compiled = _compiled(lambda x, c: fn(x, c, jnp.bfloat16, interpret=False, **params), cfg, n,
                         batch)
    return {**mosaic_gpu.launch_params(kernel, cfg, n, n // cfg.d, batch), **params}, compiled


# What the compiled program's entry holds without launching anything
_NO_LAUNCH = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def launches(compiled) -> list:
    """The kernels a compiled program launches, in order: its entry computation's instructions
    that run on the device (fusions, custom calls such as the Mosaic GPU kernel, copies), as
    ``name: shape``. Each costs a launch and at least a microsecond or two of device time
    however little it computes."""
    text = compiled.as_text()
    out = []
    for line in text[text.index("\nENTRY"):].splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)", line)
        if not m:
            continue
        rest, depth = m.group(2), 0
        for i, ch in enumerate(rest):  # the shape (a tuple's has spaces), then the opcode
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == " " and depth == 0:
                break
        shape = re.sub(r"\{[^}]*\}", "", rest[:i])  # layouts dropped
        opcode = re.match(r"([a-z-]+)\(", rest[i + 1:])
        if opcode and opcode.group(1) not in _NO_LAUNCH:
            out.append(f"{m.group(1)}: {shape}")
    return out


def compile_case(kernel: str, batch: int, params: dict, dump: pathlib.Path):
    """Compiles one case at 8192^2 (run in a fresh process: Mosaic GPU reads its dump
    settings once); the PTX lands in ``dump``."""
    import hnlq_jax as hq
    t, compiled = _compile(kernel, hq.HNLQConfig("D4", 4, 2), N, batch, params)
    (dump / "params.json").write_text(json.dumps({**t, "launches": launches(compiled)}))


def compile_variants() -> list:
    """:data:`VARIANTS`, each compiled: ``"ok"`` or the error."""
    import hnlq_jax as hq
    out = []
    for lattice, q, M, max_t, dither, kernel, batch, params in VARIANTS:
        cfg = hq.HNLQConfig(lattice, q, M, max_T=max_t,  # (the dither's variants are D4's)
                            dither=(0.1, -0.2, 0.05, 0.3) if dither else None)
        try:
            _compile(kernel, cfg, 1024, batch, params)
            result = "ok"
        except Exception as e:  # noqa: BLE001  (reported)
            result = f"{type(e).__name__}: {e}"[:300]
        out.append({"config": f"{lattice} q={q} M={M} max_T={max_t}"
                    + (" dither" if dither else ""),
                    "kernel": kernel, "batch": batch, "params": params, "result": result})
    return out


def front_door_launches() -> list:
    """The kernels a call of ``hq.matmul(x, codes, implementation="pallas")`` launches at
    8192^2 (bfloat16 x, the tuning table's choices: Triton's kernels on an H100 today), D4
    and E8 q=4 M=2, batch 1-64, from deviceless compiles."""
    import hnlq_jax as hq

    def fused(x, c):
        return hq.matmul(x, c, implementation="pallas", interpret=False)

    return [{"lattice": lattice, "batch": batch,
             "launches": launches(_compiled(fused, hq.HNLQConfig(lattice, 4, 2), N, batch))}
            for lattice in ("D4", "E8") for batch in (1, 4, 16, 64)]


def _varint(b: bytes, i: int) -> tuple:
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return v, i


def _unsnappy(b: bytes, i: int) -> bytes:
    """The raw snappy stream at ``b[i:]`` (its length, then literals and back references)."""
    n, i = _varint(b, i)
    out = bytearray()
    while len(out) < n:
        tag = b[i]
        i += 1
        if tag & 3 == 0:  # a literal of tag >> 2 + 1 bytes, or the length in 1-4 more bytes
            size = tag >> 2
            if size >= 60:
                size, i = int.from_bytes(b[i:i + size - 59], "little"), i + size - 59
            out += b[i:i + size + 1]
            i += size + 1
            continue
        if tag & 3 == 1:
            size, back, i = 4 + ((tag >> 2) & 7), ((tag >> 5) << 8) | b[i], i + 1
        else:
            w = 2 if tag & 3 == 2 else 4
            size, back, i = (tag >> 2) + 1, int.from_bytes(b[i:i + w], "little"), i + w
        if not 0 < back <= len(out):
            raise ValueError("not a snappy stream")
        for _ in range(size):
            out.append(out[-back])
    return bytes(out)


# The first bytes of a Riegeli file (its first block header)
_RIEGELI = bytes.fromhex("83af70d10d884a3f")


def _inner_stream(b: bytes) -> bytes:
    """The record in the Riegeli file in ``b``, snappy-compressed: the file's 24-byte block
    headers at each 64 KiB taken out, then the first snappy stream (its length written twice:
    Riegeli's, then the stream's own)."""
    f = b.find(_RIEGELI)
    if f >= 0:
        b = b[:f] + b[f:f + 65536] + b"".join(b[a + 24:a + 65536]
                                               for a in range(f + 65536, len(b), 65536))
    for i in range(len(b) - 16):
        n, j = _varint(b, i)
        if n > 1024 and j - i > 1 and b[j:2 * j - i] == b[i:j]:
            try:
                return _unsnappy(b, j)
            except IndexError:
                raise ValueError("not a snappy stream: it runs past the bytes") from None
    raise ValueError("no snappy stream found")


def cubins(compiled) -> list:
    """The CUDA binaries (ELF images) of a compiled program: XLA's serialized executable holds
    them as a Riegeli record of snappy-compressed bytes, twice over (the executable, then its
    binaries). Found by taking the format apart: no API gives them without a device."""
    inner = _inner_stream(_inner_stream(compiled.runtime_executable().serialize()))
    starts = [m.start() for m in re.finditer(rb"\x7fELF", inner)] + [len(inner)]
    return [inner[a:b] for a, b in zip(starts, starts[1:])]


def compile_triton(dump: pathlib.Path) -> list:
    """:data:`TRITON_CASES` compiled for the H100: each case's launch parameters and
    launches, its kernels' binaries in ``dump``."""
    import jax.numpy as jnp

    import hnlq_jax as hq
    from hnlq_jax import kernels
    out = []
    for i, (kernel, lattice, batch, params) in enumerate(TRITON_CASES):
        cfg = hq.HNLQConfig(lattice, 4, 2)
        fn = functools.partial(kernels.gemv, out_dtype=jnp.bfloat16) if kernel == "gemv" else \
            functools.partial(kernels.decode_matmul, compute_dtype=jnp.bfloat16,
                              out_dtype=jnp.bfloat16)
        compiled = _compiled(lambda x, c, fn=fn, params=params: fn(
            x, c, interpret=False, **params), cfg, N, batch)
        t = kernels.pallas.launch_params(kernel, cfg, N, N // cfg.d, batch, {
            **kernels.pallas.tuning_entry(kernel, cfg, batch, "sm90"), **params})
        t["words"] = kernels.pallas.reads_words(cfg, N // cfg.d, t)
        files = []
        for j, elf in enumerate(cubins(compiled)):
            files.append(str(dump / f"triton{i}_{j}.cubin"))
            pathlib.Path(files[-1]).write_bytes(elf)
        out.append({"kernel": kernel, "lattice": lattice, "batch": batch, "params": t,
                    "launches": launches(compiled), "cubins": files})
    return out


def analyse_triton(case: dict, cuobjdump: str, nvdisasm: str) -> dict:
    """The case's kernel among its binaries: registers and local (spilled) bytes from
    ``cuobjdump``, the hot loop from ``nvdisasm``; a thread's weights a step are the tile's
    (``block_n x block_k`` blocks of d) over its ``32 num_warps`` threads."""
    name = f"_{case['kernel']}_kernel"
    for path in case["cubins"]:
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                               text=True).stdout
        m = re.search(rf"Function {name}:\s*REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)",
                      usage)
        if m:
            break
    else:
        raise RuntimeError(f"no {name} among the binaries")
    sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                          check=True).stdout
    ops = hot_loop(sass)
    t = case["params"]
    d = 8 if case["lattice"] == "E8" else 4
    weights = t["block_n"] * t["block_k"] * d / (32 * t["num_warps"])
    total = sum(ops.values())
    return {"params": t, "launches": case["launches"], "registers": int(m.group(1)),
            "spill_bytes": int(m.group(2)), "loop_instructions": total,
            "per_word": 8 * total / weights, "per_weight": total / weights,
            "mix": dict(ops.most_common(12))}


def compile_encode(dump: pathlib.Path) -> dict:
    """``hq.encode(x, config, implementation="pallas")`` under ``jit`` for 10^8 D4 q=4 M=2
    blocks (float32), compiled for the H100: the kernels it launches, its binaries in
    ``dump``."""
    import jax
    import jax.numpy as jnp

    import hnlq_jax as hq
    x = jax.ShapeDtypeStruct((10**8, 4), jnp.float32, sharding=_h100())
    cfg = hq.HNLQConfig("D4", 4, 2)
    compiled = jax.jit(lambda x: hq.encode(x, cfg, implementation="pallas",
                                           interpret=False)).trace(x).lower().compile()
    files = []
    for j, elf in enumerate(cubins(compiled)):
        files.append(str(dump / f"encode_{j}.cubin"))
        pathlib.Path(files[-1]).write_bytes(elf)
    return {"launches": launches(compiled), "cubins": files, "M": cfg.M,
            "blocks_per_thread": 256 // (32 * 4)}  # kernels.encode's tiles and 4 warps


def analyse_encode(case: dict, cuobjdump: str, nvdisasm: str) -> list:
    """The encoder's two kernels' instructions a block: the first pass's (one attempt: the
    kernel's own code, out-of-line subroutines such as the division's slow path left out,
    its loop over the M levels counted M times) and those of an attempt of the second
    pass's loop over the blocks left (the loop around the level loop)."""
    out = []
    for name in ("_encode_kernel", "_encode_left_kernel"):
        for path in case["cubins"]:
            usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                                   text=True).stdout
            m = re.search(rf"Function {name}:\s*REG:(\d+)", usage)
            if m:
                break
        else:
            raise RuntimeError(f"no {name} among the binaries")
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                              check=True).stdout
        own = re.split(r"\n\s*\.weak\s", sass)[0]  # the subroutines follow the kernel
        loops, instrs = _loops(own)
        spans = sorted((b - a, a, b) for a, b in loops if b - a > 50)
        level = spans[0]
        count = sum(1 for i, _ in instrs if level[1] <= i <= level[2])
        if name == "_encode_kernel":
            body = len(instrs)
        else:  # the innermost loop around the level loop: an attempt
            outer = next(s for s in spans[1:] if s[1] <= level[1] and level[2] <= s[2])
            body = sum(1 for i, _ in instrs if outer[1] <= i <= outer[2])
        executed = body + (case["M"] - 1) * count
        out.append({"kernel": name, "registers": int(m.group(1)),
                    "per_block": executed / case["blocks_per_thread"]})
    return out


def _loops(sass: str) -> list:
    """``(start, end)`` line ranges of the loops (a branch back to an earlier label) and the
    instructions ``[(line, text)]``."""
    lines = sass.splitlines()
    labels, instrs = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append((i, m.group(1)))
    loops = []
    for i, text in instrs:
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    return loops, instrs


def _opcode(text: str) -> str:
    words = [w for w in text.split() if not w.startswith("@")]
    return words[0].split(".")[0]


def hot_loop(sass: str) -> collections.Counter:
    """The opcodes of the pipeline step's loop: the innermost (shortest) loop of more than 50
    instructions."""
    loops, instrs = _loops(sass)
    best = None
    for a, b in loops:
        ops = collections.Counter(_opcode(t) for i, t in instrs if a <= i <= b)
        if sum(ops.values()) > 50 and (best is None or sum(ops.values()) < sum(best.values())):
            best = ops
    return best or collections.Counter()


def analyse(dump: pathlib.Path, ptxas: str, nvdisasm: str) -> dict:
    ptx = next(dump.glob("*.ptx"))
    cubin = dump / "kernel.cubin"
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", str(cubin), str(ptx)],
                       capture_output=True, text=True, check=True)
    info = r.stdout + r.stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ops = hot_loop(sass)
    t = json.loads((dump / "params.json").read_text())
    calls = t.pop("launches")
    words = t["block_n"] * t["block_w"] // 128  # a warpgroup's 128 threads share the tile
    total = sum(ops.values())
    return {"params": t, "launches": calls, "registers": regs, "spill_bytes": sum(spills),
            "loop_instructions": total, "words_per_thread": words,
            "per_word": total / words, "per_weight": total / words / 8,
            "mix": dict(ops.most_common(12))}


def markdown(out: dict) -> str:
    rows = []
    for r in out["rows"]:
        t = {k: v for k, v in r["params"].items() if k not in ("splits", "programs")}
        mix = ", ".join(f"{k} {v}" for k, v in list(r["mix"].items())[:6])
        rows.append([r["kernel"], r["batch"], f"`{t}`", len(r.get("launches", [])) or "n/a",
                     r["registers"], r["spill_bytes"], r["loop_instructions"],
                     f"{r['per_word']:.1f}", f"{r['per_weight']:.2f}", mix])
    table = markdown_table(["kernel", "rows of x", "launch parameters", "kernels a call",
                            "registers", "spilled bytes", "step loop (instructions a thread)",
                            "a word (8 weights)", "a weight", "most frequent"], rows)
    bad = [v for v in out["variants"] if v["result"] != "ok"]
    checked = (f"The other variants of the kernels' code ({len(out['variants'])}: 8-bit T, "
               "q=3 with its corrupt-index mask, the dither, one block a word, A2, Z2, A's "
               "two paths) compiled "
               "for sm_90a at 1024²: "
               + ("all assembled." if not bad else
                  "failed: " + "; ".join(f"{v['config']} {v['kernel']} {v['batch']} rows: "
                                          f"`{v['result'][:120]}`" for v in bad) + "."))
    text = (f"{out['target']}, jax {out['jax']}, weight {out['n']}², D4 q=4 M=2 "
            "(`experiments/sass_profile.py`):\n\n" + table + "\n\n" + checked)
    if out.get("front_door"):
        doors = [[r["lattice"], r["batch"], len(r["launches"]),
                  ", ".join(f"`{k}`" for k in r["launches"])] for r in out["front_door"]]
        text += ("\n\nThe kernels a call of `hq.matmul(x, codes, implementation=\"pallas\")` "
                 f"launches at {out['n']}² (bfloat16 x; the tuning table's kernels):\n\n"
                 + markdown_table(["lattice", "rows of x", "kernels", "launches"], doors))
    if out.get("encode"):
        first, left = out["encode"]["kernels"]
        text += ("\n\nThe kernels `hq.encode(x, config, implementation=\"pallas\")` launches "
                 f"under `jit` for 10⁸ D4 blocks: {len(out['encode']['launches'])} ("
                 + ", ".join(f"`{k}`" for k in out["encode"]["launches"]) + "). Its first "
                 f"pass takes {first['per_block']:.0f} instructions a block (one attempt, "
                 f"{first['registers']} registers), the loop over the blocks left "
                 f"{left['per_block']:.0f} a block and attempt ({left['registers']} "
                 "registers).")
    return text


def _pythonpath() -> str:
    """The repository, then the caller's ``PYTHONPATH`` (where a CUDA plugin may be)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    p.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    p.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    p.add_argument("--variants", help=argparse.SUPPRESS)  # VARIANTS, in a child process
    add_report_flag(p)
    args = p.parse_args(argv)
    if args.report:
        write_between_markers(DOCS / "kernels.md", "sass_profile",
                              markdown(load_results("sass_profile")))
        return 0
    if args.case:
        kernel, batch, params, dump = json.loads(args.case)
        compile_case(kernel, batch, params, pathlib.Path(dump))
        return 0
    if args.variants:
        dump = pathlib.Path(args.variants)
        (dump / "v.json").write_text(json.dumps(
            {"variants": compile_variants(), "front_door": front_door_launches(),
             "encode": compile_encode(dump), "triton": compile_triton(dump)}))
        return 0
    if not args.nvdisasm:
        sys.exit("sass_profile: no nvdisasm (pip install nvidia-cuda-nvdisasm; --nvdisasm)")
    rows = []
    for kernel, batch, params in CASES:
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "MOSAIC_GPU_DUMP_TO": d, "MOSAIC_GPU_DUMP_PTX": "1",
                   "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu",
                   "PYTHONPATH": _pythonpath()}
            subprocess.run([sys.executable, __file__, "--case",
                            json.dumps([kernel, batch, params, d])], env=env, check=True,
                           capture_output=True)
            row = {"kernel": kernel, "batch": batch,
                   **analyse(pathlib.Path(d), args.ptxas, args.nvdisasm)}
        rows.append(row)
        print(f"{kernel} rows={batch} {params}: {row['registers']} registers, "
              f"{row['spill_bytes']} B spilled, {row['per_word']:.1f} instructions a word",
              flush=True)
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": _pythonpath()}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, __file__, "--variants", d], env=env, check=True,
                       capture_output=True)
        child = json.loads(pathlib.Path(f"{d}/v.json").read_text())
        child["encode"] = {"launches": child["encode"]["launches"],
                           "kernels": analyse_encode(child["encode"], args.cuobjdump,
                                                     args.nvdisasm)}
        for case in child.pop("triton"):
            rows.append({"kernel": f"{case['kernel']} (Triton, {case['lattice']})",
                         "batch": case["batch"],
                         **analyse_triton(case, args.cuobjdump, args.nvdisasm)})
    import jax
    out = {"jax": jax.__version__, "target": "H100 (sm_90a), compiled without a device",
           "n": N, "rows": rows, **child}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sass_profile.json").write_text(json.dumps(out, indent=1))
    write_between_markers(DOCS / "kernels.md", "sass_profile", markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
