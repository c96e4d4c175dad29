"""`make docs`: regenerate docs/configuration.md, docs/performance.md and README.md's headline.

    python docs/gen.py            write the three
    python docs/gen.py --check    exit 1, naming the files, if any of them is out of date

configuration.md comes from the processes' own argparse parsers; performance.md from the
hand-written docs/performance.in.md plus the recorded benchmark runs in benchmarks/results/
(`make bench-*`); the README's block between `<!-- BEGIN generated: headline -->` and
`<!-- END generated: headline -->` from the same results. tests/test_docs.py fails when a
committed file differs from what this script would write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python docs/gen.py`: the repository's packages
    sys.path.insert(0, str(ROOT))

from docs.gen_config import render_configuration  # noqa: E402
from docs.gen_perf import load_results, render_performance, update_readme  # noqa: E402

CONFIGURATION = ROOT / "docs" / "configuration.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
TEMPLATE = ROOT / "docs" / "performance.in.md"
README = ROOT / "README.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"


def expected_files(results_dir: Path = RESULTS_DIR) -> dict[Path, str]:
    """What each generated file should hold now."""
    results = load_results(results_dir)
    files = {CONFIGURATION: render_configuration(),
             PERFORMANCE: render_performance(TEMPLATE.read_text(), results)}
    if README.exists():
        files[README] = update_readme(README.read_text(), results)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = ap.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}: run make docs", file=sys.stderr)
        return 1
    print(("updated: " + ", ".join(map(str, stale))) if stale else "docs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
