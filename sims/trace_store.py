"""Where traces live: the catalogue of public traces the readers know, and the folders searched for their files.

Every catalogued file has a path relative to a traces folder (the layout of
the team's shared/traces: `azure-llm-2023/AzureLLMInferenceTrace_conv.csv`),
an upstream source (a public GitHub repository at a pinned commit), and a
size and sha256 in the shipped manifest, `sims/data/trace_files.json`
(written from a verified copy by `scripts/trace_manifest.py`).
`modelpool traces fetch` downloads into the user cache and checks them.

Folders searched for a file, first hit wins (`search_dirs`):
1. the user cache: $MODELPOOL_TRACES_CACHE, else ~/.cache/modelpool/traces;
2. $MODELPOOL_TRACES when set, else ../shared/traces beside the repository
   or the working directory (the team's machines have one).

What `simulate` and `capacity` use with no arguments ships in the package
(`SHIPPED`): the ShareGPT length pairs, so a fresh install needs no trace.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sims.workload import TraceError

SHIPPED = Path(__file__).resolve().parent / "data"
MANIFEST = SHIPPED / "trace_files.json"
CACHE_ENV, TRACES_ENV = "MODELPOOL_TRACES_CACHE", "MODELPOOL_TRACES"


@dataclass(frozen=True, slots=True)
class Origin:
    """An upstream snapshot that one local traces folder copies."""

    repo: str  # owner/name on GitHub
    commit: str
    prefix: str  # the folder in the repository that the local folder mirrors
    license: str

    def url(self, rest: str) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.prefix}/{rest}"


# Keyed by the local folder; repository, commit, path and license from each folder's SOURCE.md.
ORIGINS: dict[str, Origin] = {
    "azure-llm-2023": Origin("Azure/AzurePublicDataset", "b469a113cedca53ddc3bdea71a143dc4b7d8700c", "data",
                             "CC-BY-4.0 (cite Patel et al., Splitwise, ISCA'24)"),
    "vidur-processed-traces": Origin("microsoft/vidur", "7d47513363ec447a741ac5e47241580b47724fbf",
                                     "data/processed_traces", "MIT (splitwise_*: Azure data, CC-BY-4.0)"),
    "sharegpt-lengths": Origin("microsoft/sarathi-serve", "72339db5b120614033b317880ad3a05a5e4c9415",
                               "data/processed_traces", "Apache-2.0 (derived from user-shared ShareGPT logs)"),
    "mooncake": Origin("kvcache-ai/Mooncake", "3b5a594133958449a1feaf1c9e0fc1b553e34a28", "FAST25-release/traces",
                       "Apache-2.0"),
    "azure-functions-2019-invitro-sample": Origin(
        "vhive-serverless/invitro", "cb0077f3a4af0142e521d47cddfd81e41a1ce170", "data/traces/10-1000-10",
        "MIT (Azure Functions 2019 data, CC-BY-4.0; cite Shahrad et al., ATC'20)"),
    "servegen": Origin("alibaba/ServeGen", "f891d1189eb32b3868dfc443800c4150548c282a", "data",
                       "Apache-2.0 (cite Xiang et al., arXiv:2505.09999)"),
    "alibaba-genai-2026": Origin("alibaba/clusterdata", "7a6c496e4f4b6ce6150be8f881cb051bf2abff42",
                                 "cluster-trace-v2026-GenAI", "research or study use (program README); "
                                 "cite Lin et al., SoCC'25"),
}


@dataclass(frozen=True, slots=True)
class TraceFile:
    path: str  # relative to a traces folder
    num_bytes: int
    sha256: str

    @property
    def origin(self) -> Origin:
        return ORIGINS[self.path.split("/", 1)[0]]

    @property
    def url(self) -> str:
        return self.origin.url(self.path.split("/", 1)[1])


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace as specs name it (`--trace NAME`, `lengths=NAME`), and the files its reader needs."""

    name: str
    description: str
    paths: tuple[str, ...]  # files, or folders ending in '/' (every manifest file under them)
    shipped: str | None = None  # a package-data file that stands in for the download

    @property
    def files(self) -> tuple[TraceFile, ...]:
        manifest = _manifest()
        return tuple(manifest[key] for key in sorted(manifest)
                     if any(key == path or (path.endswith("/") and key.startswith(path)) for path in self.paths))

    @property
    def origin(self) -> Origin:
        return ORIGINS[self.paths[0].split("/", 1)[0]]

    @property
    def num_bytes(self) -> int:
        return sum(file.num_bytes for file in self.files)


_AZURE = "azure-llm-2023/AzureLLMInferenceTrace_"
_SERVEGEN = {"language/m-large": "ServeGen language model 'm-large': 162 clients' arrival models, 14 days",
             "language/m-mid": "ServeGen language model 'm-mid': 109 clients' arrival models, 14 days",
             "language/m-small": "ServeGen language model 'm-small': 43 clients' arrival models, 14 days",
             "reason/deepseek-r1": "ServeGen DeepSeek-R1: 73 clients' arrival models, 1 day",
             "multimodal/mm-image": "ServeGen Qwen-VL: 35 clients' arrival models, 1 day"}

CATALOGUE: dict[str, Trace] = {t.name: t for t in (
    Trace("sharegpt", "ShareGPT (prompt, output) length pairs, 30.7k, Llama-2 tokenizer: the default lengths",
          ("sharegpt-lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",), shipped="sharegpt_lengths.csv.gz"),
    Trace("arxiv", "arxiv-summarization length pairs, 28k, Llama-2 tokenizer (lengths=arxiv)",
          ("vidur-processed-traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",)),
    Trace("azure-conv", "Azure LLM 2023 conversation service: 19.4k requests in 58 min", (f"{_AZURE}conv.csv",)),
    Trace("azure-code", "Azure LLM 2023 code service: 8.8k requests in 57 min", (f"{_AZURE}code.csv",)),
    Trace("azure-llm", "Azure LLM 2023, both services as two models", (f"{_AZURE}conv.csv", f"{_AZURE}code.csv")),
    Trace("vidur-conv", "Vidur's copy of azure-conv, re-based to t=0", ("vidur-processed-traces/splitwise_conv.csv",)),
    Trace("vidur-code", "Vidur's copy of azure-code, re-based to t=0", ("vidur-processed-traces/splitwise_code.csv",)),
    Trace("mooncake", "Mooncake (Kimi) conversation trace: 12k requests in 59 min",
          ("mooncake/conversation_trace.jsonl",)),
    Trace("mooncake-synthetic", "Mooncake synthetic trace: 4k Poisson requests in 17 min",
          ("mooncake/synthetic_trace.jsonl",)),
    Trace("azure-functions", "Azure Functions 2019, 1000-function sample: per-minute invocations over 24 h",
          ("azure-functions-2019-invitro-sample/1000_inv.csv",)),
    Trace("alibaba-genai", "Alibaba GenAI 2026 (Stable Diffusion): 26.8k requests over 87 base models, 23 days",
          ("alibaba-genai-2026/lora_request_trace.csv",)),
    *(Trace(f"servegen:{model}", text, (f"servegen/{model}/",)) for model, text in _SERVEGEN.items()),
)}


@cache
def _manifest() -> dict[str, TraceFile]:
    data = json.loads(MANIFEST.read_text())
    return {path: TraceFile(path, num_bytes, sha256) for path, (num_bytes, sha256) in data["files"].items()}


def cache_dir() -> Path:
    """Where `modelpool traces fetch` writes: $MODELPOOL_TRACES_CACHE, else ~/.cache/modelpool/traces."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "modelpool" / "traces"


def search_dirs(root: Path | None = None) -> list[Path]:
    """The folders a trace file is looked for in, in order; only `root` when one is given."""
    if root is not None:
        return [root]
    env = os.environ.get(TRACES_ENV)
    team = [Path(env).expanduser()] if env else [Path(__file__).resolve().parents[1] / "../shared/traces",
                                                 Path.cwd() / "../shared/traces"]
    return list(dict.fromkeys(path.resolve() for path in [cache_dir(), *team]))


def locate(relative: str, root: Path | None = None) -> Path:
    """The first copy of `relative` (a file or folder path under a traces folder); a TraceError naming the fix."""
    dirs = search_dirs(root)
    for folder in dirs:
        if (folder / relative).exists():
            return folder / relative
    owner = next((t.name for t in CATALOGUE.values() if any(relative.startswith(p) or p.startswith(relative + "/")
                                                            for p in t.paths)), None)
    fetch = f"`modelpool traces fetch {owner}` downloads it; " if owner and root is None else ""
    raise TraceError(f"trace file not found: {relative} (looked in {', '.join(map(str, dirs))}); "
                     f"{fetch}{TRACES_ENV} names a folder that has it")


def where(trace: Trace, root: Path | None = None) -> tuple[Path | None, int]:
    """The first folder holding the most of `trace`'s files, and how many it holds."""
    if trace.shipped:
        return SHIPPED / trace.shipped, len(trace.files)
    best: tuple[Path | None, int] = (None, 0)
    for folder in search_dirs(root):
        count = sum((folder / file.path).is_file() for file in trace.files)
        if count > best[1]:
            best = (folder, count)
    return best


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(root: Path) -> dict:
    """Sizes and sha256 of every catalogued file under `root` (a verified copy of the upstream files)."""
    files: dict[str, list[int | str]] = {}
    for trace in CATALOGUE.values():
        for path in trace.paths:
            found = sorted(p for p in (root / path).rglob("*") if p.is_file()) if path.endswith("/") else [root / path]
            for file in found:
                key = file.relative_to(root).as_posix()
                files[key] = [file.stat().st_size, sha256_of(file)]
    return {"note": "written by scripts/trace_manifest.py: [bytes, sha256] of each upstream file", "files": files}
