"""Build the Debian-docs English corpus (scripts/debdocs.py) as JSONL, ready for prepare_data.py.

    python scripts/build_corpus.py --out data/debdocs.jsonl            # downloads ~73 MB once (cached)
    python scripts/prepare_data.py --input data/debdocs.jsonl --vocab-size 32000 \
        --output-prefix data/debdocs --workers 2

Packages are pinned by sha256 (see scripts/debdocs.py); the JSONL is byte-identical across rebuilds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # debdocs beside it (also when run in-process)

from debdocs import PACKAGES, iter_documents  # noqa: E402 - corpus building is no part of the agoq package

from agoq.train.data import default_cache_dir  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output .jsonl path")
    parser.add_argument("--cache-dir", default=None, help="where the .deb files are kept (default: agoq cache)")
    args = parser.parse_args(argv)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir() / "debdocs"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, docs, chars = time.time(), Counter(), Counter()
    digest = hashlib.sha256()
    with open(out, "w", encoding="utf-8") as f:
        for record in iter_documents(cache):
            line = json.dumps(record, ensure_ascii=False) + "\n"
            f.write(line)
            digest.update(line.encode("utf-8"))
            pkg = record["source"].split(":", 1)[0]
            docs[pkg] += 1
            chars[pkg] += len(record["text"])
    for pkg in PACKAGES:
        print(f"{pkg.name:16s} {docs[pkg.name]:7d} documents {chars[pkg.name] / 1e6:8.1f} M chars")
    size_mib = out.stat().st_size / 2**20
    print(f"wrote {out} ({size_mib:.1f} MiB, sha256 {digest.hexdigest()[:16]}) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
