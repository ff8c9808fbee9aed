"""Tile configurations of the GPU kernels, by GPU generation (compute capability major).

``experiments/gpu_check.py`` times each candidate of its sweep on the device; its
``--write-tiles`` writes the winners here. A generation, op or lattice without an entry takes
:data:`DEFAULT`. ``waves``: the kernels split each row's blocks across programs (split-K)
until about ``waves`` programs per multiprocessor run.
"""

# words: the index and T read as words of several blocks where the codes allow
# (kernels.pallas.code_words), else block by block; f16: decode_matmul's float16 operands for
# bfloat16 x (kernels.pallas.f16_fits), else the reference's decoded weights in bfloat16
DEFAULT = {"gemv": {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 1, "waves": 4,
                    "words": True},
           "decode_matmul": {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 1,
                             "waves": 1, "words": True, "f16": False},
           # kernels.mosaic_gpu.gemv: block_w index words a pipeline step, stages in flight,
           # resident persistent programs a multiprocessor. waves=1: about one work item a
           # multiprocessor, as each item fills its own pipeline (8192²: 256 items of 16
           # steps for 264 programs)
           "gemv_mosaic": {"block_n": 64, "block_w": 32, "stages": 4, "waves": 1,
                           "resident": 2},
           # kernels.mosaic_gpu.decode_matmul, as gemv_mosaic; a_registers: the decoded
           # planes go to the wgmma from registers, not through shared memory (then block_w
           # holds x's padded rows: up to 32 here). Two programs a multiprocessor (2 stages
           # each: 8 warps, not the 4 of one program of 4 stages); stages None: 2, and as
           # many as one program holds where x's rows leave room for one program only
           # (kernels.mosaic_gpu.launch_params)
           "decode_matmul_mosaic": {"block_n": 64, "block_w": 32, "stages": None, "waves": 1,
                                    "resident": 2, "a_registers": True}}

# {generation: {op: {lattice: {"batch<=B": params}}}}, op: "gemv" or "decode_matmul"
TILES: dict = {'sm90': {'decode_matmul': {'D4': {'batch<=16': {'block_k': 64,
                                                 'block_n': 64,
                                                 'num_stages': 1,
                                                 'num_warps': 4,
                                                 'waves': 2}},
                            'E8': {'batch<=16': {'block_k': 32,
                                                 'block_n': 64,
                                                 'num_stages': 1,
                                                 'num_warps': 4,
                                                 'waves': 2}}},
          'gemv': {'D4': {'batch<=1': {'block_k': 256,
                                       'block_n': 16,
                                       'num_stages': 2,
                                       'num_warps': 4,
                                       'waves': 4},
                          'batch<=8': {'backend': 'triton_mma',
                                       'block_k': 64,
                                       'block_n': 16,
                                       'num_stages': 1,
                                       'num_warps': 4,
                                       'waves': 4}},
                   'E8': {'batch<=1': {'block_k': 256,
                                       'block_n': 8,
                                       'num_stages': 1,
                                       'num_warps': 4,
                                       'waves': 8},
                          'batch<=8': {'backend': 'triton_mma',
                                       'block_k': 64,
                                       'block_n': 16,
                                       'num_stages': 1,
                                       'num_warps': 4,
                                       'waves': 4}}}}}
