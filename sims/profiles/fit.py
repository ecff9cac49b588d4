"""Fit the shipped calibration profiles to the H200 measurements in ANCHORS.md.

The fits themselves are `sims.profiles.fitting`'s (the same ones `modelpool
calibrate` runs on its own measurements); this module holds ANCHORS.md's
figures and the provenance of each shipped number. Two model shapes cannot
separate a per-layer decode term from the per-step one, so the whole decode
intercept goes to decode_fixed_s; the eager 7B decode (11.1 ms) gives the host
launch floor.

The benchmark's models are the catalogue shapes with ONE vocab x hidden matrix
(14.1 GB for the 7B shape = 15.2 GB catalogue weights less the 1.09 GB input
table; 28.0 GB for 14B likewise), so anchors use the catalogue arch with tied
embeddings. Decode and prefill costs are the same either way (an untied input
table is gathered, not streamed).

    python -m sims.profiles.fit           # print the error table of the shipped profiles
    python -m sims.profiles.fit --write   # regenerate sims/profiles/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scheduler.fleet import ARCHS, GPUS, Arch
from sims.profiles import CalibrationProfile, ProfileTerms, Provenance, load_profile
from sims.profiles.fitting import Anchor, Check, fit, predict, sig

__all__ = ["Anchor", "Check", "DECODE", "EAGER_DECODE", "PREFILL", "SWAP", "benchmark_arch", "build_profiles",
           "error_table", "fit_terms"]

ANCHORS = "ANCHORS.md, 'Measured here (H200, PCIe Gen5 x16)'"
GPU = "h200"

DECODE = tuple(Anchor("decode", arch, ms * 1e-3, batch, 512) for arch, values in
               (("qwen2.5-7b", (4.56, 4.68, 4.87)), ("qwen3-32b", (17.8, 18.4, 19.2)))
               for batch, ms in zip((1, 8, 32), values))
EAGER_DECODE = Anchor("decode", "qwen2.5-7b", 11.1e-3, 1, 512, cuda_graphs=False)
PREFILL = tuple(Anchor("prefill", arch, ms * 1e-3, 1, tokens) for arch, tokens, ms in
                (("qwen2.5-7b", 512, 12.0), ("qwen2.5-7b", 4096, 90.9), ("qwen2.5-14b", 512, 22.6), ("qwen2.5-14b", 4096, 176.0)))
SWAP = (Anchor("swap", "qwen2.5-7b", 0.257, swap_bytes=14.1e9), Anchor("swap", "qwen2.5-14b", 0.511, swap_bytes=28.0e9))


def benchmark_arch(key: str) -> Arch:
    """The measured shape: the catalogue arch with tied embeddings and parameters counted from the shape."""
    return Arch.model_validate({**ARCHS[key], "tie_embeddings": True, "total_params": None})


_FITTED = ("eff_compute", "eff_mem", "eff_kv", "eff_pcie", "decode_fixed_s", "prefill_fixed_s", "prefill_layer_s",
           "switch_fixed_s", "launch_s_per_layer")


def fit_terms() -> dict[str, float]:
    """The measured terms, rounded to 4 significant digits (the shipped numbers)."""
    fitted = fit(DECODE + PREFILL + SWAP + (EAGER_DECODE,), GPUS[GPU], benchmark_arch).terms
    return {term: float(fitted[term]) for term in _FITTED}


_SOURCES = {
    "eff_compute": f"fitted to prefill of the 7B and 14B shapes at 512 and 4096 tokens ({ANCHORS})",
    "prefill_fixed_s": f"fitted to prefill of the 7B and 14B shapes at 512 and 4096 tokens ({ANCHORS})",
    "prefill_layer_s": f"fitted to prefill of the 7B and 14B shapes at 512 and 4096 tokens ({ANCHORS})",
    "eff_mem": f"fitted to CUDA-graph decode of the 7B and Qwen3-32B shapes, batch 1/8/32, context 512 ({ANCHORS})",
    "eff_kv": f"fitted to CUDA-graph decode of the 7B and Qwen3-32B shapes, batch 1/8/32, context 512 ({ANCHORS})",
    "decode_fixed_s": f"fitted to CUDA-graph decode of the 7B and Qwen3-32B shapes (whole intercept; {ANCHORS})",
    "eff_pcie": f"fitted to whole-model swap-in from pinned memory, 14.1 GB in 0.257 s and 28.0 GB in 0.511 s; "
                f"agrees with the 54-55 GB/s pinned copy ({ANCHORS})",
    "switch_fixed_s": f"fitted to the same swaps (intercept; {ANCHORS})",
    "launch_s_per_layer": f"7B decode without CUDA graphs took 11.1 ms: (11.1 ms - decode_fixed_s) / 28 layers ({ANCHORS})",
}
# What the TP terms multiply is checked against the torch engine's TP ranks on CPU (benchmarks/gpu_tp.py --tiny,
# BENCHMARKS.md, "Tensor parallelism in the torch engine, on CPU"): 2 all-reduces a layer of hidden x dtype
# bytes a token, weights and KV heads split by tp. Their NVLink rates are not measured (that needs two GPUs;
# gloo over loopback says nothing of NVLink).
_TP_CHECKED = ("; the count it multiplies (2 all-reduces a layer, hidden x dtype bytes a token) is the torch engine's "
               "at tp 2 on CPU (benchmarks/gpu_tp.py)")
_ESTIMATES = {
    "eff_nvlink": (0.5, "assumed: ring all-reduce bus bandwidth about half the bidirectional NVLink figure; not measured "
                        "here" + _TP_CHECKED),
    "allreduce_latency_s": (1e-5, "assumed: ~10 us per small all-reduce over NVLink (one-shot kernels are faster, NCCL slower); "
                                  "not measured here" + _TP_CHECKED),
}


def build_profiles() -> dict[str, CalibrationProfile]:
    """The shipped profiles, computed from the anchors."""
    fitted = fit_terms()
    held = " (the unconstrained fit was negative; held at 0)"
    provenance = {term: Provenance(status="measured", source=source + (held if fitted[term] == 0 else ""), gpus=(GPU,))
                  for term, source in _SOURCES.items()}
    provenance |= {term: Provenance(status="estimated", source=source) for term, (_, source) in _ESTIMATES.items()}
    graphs = {"decode_cuda_graphs": "measured setting: the decode anchors replay CUDA graphs",
              "prefill_cuda_graphs": "measured setting: the prefill anchors ran eagerly"}
    terms = {**fitted, **{term: value for term, (value, _) in _ESTIMATES.items()},
             "decode_cuda_graphs": True, "prefill_cuda_graphs": False}
    provenance |= {term: Provenance(status="measured", source=source, gpus=(GPU,)) for term, source in graphs.items()}
    cudagraph = CalibrationProfile(
        name="h200-cudagraph", terms=ProfileTerms.model_validate(terms), provenance=provenance,
        description="H200 measured here: decode replays CUDA graphs, prefill runs eagerly. Generated by "
                    "`python -m sims.profiles.fit --write`; on other GPUs its numbers are extrapolations.")
    eager_terms = cudagraph.terms.model_copy(update={"decode_cuda_graphs": False})
    eager_provenance = provenance | {"decode_cuda_graphs": Provenance(
        status="measured", source="measured setting: the 11.1 ms eager decode anchor", gpus=(GPU,))}
    eager = CalibrationProfile(
        name="h200-eager", terms=eager_terms, provenance=eager_provenance,
        description="As h200-cudagraph, but decode launches kernels eagerly (as the Aegaeon artifact does): "
                    "small models are launch bound. Generated by `python -m sims.profiles.fit --write`.")
    h100_pcie = sig(54.8 / GPUS["h100"].h2d_gb_s)
    default = CalibrationProfile(
        name="default", terms=cudagraph.terms, gpu_overrides={"h100": {"eff_pcie": h100_pcie}},
        provenance=provenance | {"h100.eff_pcie": Provenance(
            status="measured", gpus=("h100",), source="54.8 GB/s pinned H2D on H100 SXM5, public benchmark quoted in ANCHORS.md")},
        description="Datasheet-carried: the H200 figures of ANCHORS.md on every GPU type. On any other GPU (H20, "
                    "H100, A100 ...) each efficiency is carried by that GPU's datasheet ratio and each time carried "
                    "over unchanged; none was measured there (the H100 host-link rate excepted, from a public "
                    "benchmark). `modelpool calibrate` on the GPU itself replaces them. Generated by `python -m "
                    "sims.profiles.fit --write`.")
    return {profile.name: profile for profile in (default, cudagraph, eager)}


def error_table(profile: CalibrationProfile) -> list[Check]:
    """Every H200 anchor that applies to `profile` (decode anchors of its graph mode), predicted."""
    anchors = DECODE + PREFILL + SWAP + (EAGER_DECODE,)
    anchors = tuple(a for a in anchors if a.kind != "decode" or a.cuda_graphs == profile.terms_for(GPU).decode_cuda_graphs)
    return predict(profile, anchors, GPU, GPU, benchmark_arch)


def main(argv: list[str]) -> None:
    profiles = build_profiles()
    if "--write" in argv:
        for name, profile in profiles.items():
            path = Path(__file__).with_name(f"{name}.json")
            path.write_text(json.dumps(profile.model_dump(mode="json"), indent=2) + "\n")
            print(f"wrote {path}")
    for name in profiles:
        print(f"\n{name}")
        for check in error_table(load_profile(name) if "--write" not in argv else profiles[name]):
            print(f"  {check.label:44s} measured {check.measured_s * 1e3:8.2f} ms  "
                  f"predicted {check.predicted_s * 1e3:8.2f} ms  {check.error:+6.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
