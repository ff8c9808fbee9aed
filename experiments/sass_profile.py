"""The Mosaic GPU kernels' machine code, without a GPU: registers, spills and instructions a
weight, from a deviceless compile for an H100.

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

It also lists the kernels each compiled call launches (the kernel and the XLA operations
around it: x's planes, the split-K sums), and those of ``hq.matmul(..., "pallas")`` (Triton's
kernels today) at batch 1-64: at a GEMV's 10-50 us, each launch's microsecond or two counts.

Needs (not the project's dependencies: a GPU toolchain on a CPU machine):
``pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
nvidia-cuda-nvdisasm``, and a ``ptxas`` of CUDA >= 13 (jaxlib's LLVM writes PTX 9.0):
``--ptxas``, ``--nvdisasm`` or both on ``PATH``.

Writes ``results/sass_profile.json`` and the table in ``docs/kernels.md``.

Usage: ``python experiments/sass_profile.py`` (``--report``: the table from the saved JSON)
"""

from __future__ import annotations

import argparse
import collections
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


def _compiled(fn, cfg, n: int, batch: int):
    """``fn(x, codes)`` compiled for an H100 without a device: bfloat16 x ``[batch, n]``, the
    row codes of an ``n x n`` weight."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.topologies import get_topology_desc

    import hnlq_jax as hq

    dev = get_topology_desc("h100", "cuda", target_config=H100, topology="1x1x1").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
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
    from jax._src.pallas.triton import gpu_info  # jax's own table; no GPU to ask

    import hnlq_jax as hq
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)

    def fused(x, c):
        return hq.matmul(x, c, implementation="pallas", interpret=False)

    return [{"lattice": lattice, "batch": batch,
             "launches": launches(_compiled(fused, hq.HNLQConfig(lattice, 4, 2), N, batch))}
            for lattice in ("D4", "E8") for batch in (1, 4, 16, 64)]


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
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    p.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
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
        pathlib.Path(args.variants).write_text(json.dumps(
            {"variants": compile_variants(), "front_door": front_door_launches()}))
        return 0
    if not args.nvdisasm:
        sys.exit("sass_profile: no nvdisasm (pip install nvidia-cuda-nvdisasm; --nvdisasm)")
    rows = []
    for kernel, batch, params in CASES:
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "MOSAIC_GPU_DUMP_TO": d, "MOSAIC_GPU_DUMP_PTX": "1",
                   "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu",
                   "PYTHONPATH": str(ROOT)}
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
           "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, __file__, "--variants", f"{d}/v.json"], env=env,
                       check=True, capture_output=True)
        child = json.loads(pathlib.Path(f"{d}/v.json").read_text())
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
