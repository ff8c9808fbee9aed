"""Tile configurations of the GPU kernels, by GPU generation (compute capability major).

``experiments/gpu_check.py --sweep`` times each candidate on the device and writes the
winners here (``--write-tiles``); a generation or lattice without an entry takes
:data:`DEFAULT`. ``waves``: the ``gemv`` kernel splits each row's blocks across programs
(split-K) until about ``waves`` programs per multiprocessor run.
"""

DEFAULT = {"gemv": {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 1, "waves": 4}}

# {generation: {op: {lattice: {"batch<=B": params}}}}
TILES: dict = {}
