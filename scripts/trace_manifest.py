"""Write sims/data/trace_files.json (sizes and sha256 of the catalogued trace files) from a verified copy.

Usage: .venv/bin/python scripts/trace_manifest.py [TRACES_FOLDER]   (default ../shared/traces, byte for byte
the upstream files: each folder's SOURCE.md says so). Run it after adding a trace to sims.trace_store.CATALOGUE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sims.trace_store import MANIFEST, build_manifest  # noqa: E402

if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "../shared/traces").resolve()
    manifest = build_manifest(source)
    lines = [f" {json.dumps(path)}: {json.dumps(entry)}" for path, entry in sorted(manifest["files"].items())]
    MANIFEST.write_text(f'{{"note": {json.dumps(manifest["note"])},\n"files": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"{MANIFEST}: {len(manifest['files'])} files from {source}")
