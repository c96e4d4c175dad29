"""The chaos harness for one minute (`make chaos` runs it longer): workers and gateways
SIGKILLed and SIGTERMed, Redis killed and restarted, while seeded streams resume on any
error; nothing may be lost, duplicated, skipped or different from a fault-free run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.chaos import FAMILIES, Stream, check
from tests.service import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_a_minute_of_chaos_loses_duplicates_skips_and_changes_nothing() -> None:
    run = subprocess.run([sys.executable, "-m", "tests.chaos", "--minutes", "1", "--seed", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    print(run.stdout, run.stderr, sep="\n")
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(report))
    assert "error" not in report, report
    bad = {k: report[k] for k in ("lost", "duplicated_tokens", "gaps", "mismatches")}
    assert bad == dict.fromkeys(bad, 0), report
    assert report["requests"] > 0 and report["completed"] == report["requests"], report
    # No process left by itself: a live worker fenced after a Redis restart (its heartbeat lost
    # with the AOF's last second) exits with status 3, and costs its streams a restart.
    assert report["unexpected_exits"] == 0, report
    for family, kinds in FAMILIES.items():
        assert sum(report["faults"][k] for k in kinds) >= 1, f"no {family} fault: {report}"
    assert run.returncode == 0, run.returncode


def test_chunks_of_several_tokens_are_checked_token_by_token() -> None:
    """With stream_interval > 1 a resumed stream's chunk boundaries may differ from the
    reference's; its tokens, in order, may not."""
    reference = [([[1], [2, 3, 4], [5, 6]], "abcdef")]

    def counts(chunks: list[tuple[int, list[int], str]], final: str | None = "abcdef",
               by_chunk: bool = False) -> dict[str, int]:
        return check(Stream("r", 0, 0.0, chunks, final), reference, by_chunk=by_chunk)

    same = [(0, [1], "a"), (1, [2, 3], "bc"), (2, [4, 5, 6], "def")]
    assert counts(same) == {"duplicated_tokens": 0, "gaps": 0, "mismatches": 0}
    assert counts(same, by_chunk=True)["mismatches"] == 1  # by chunk, the boundaries differ
    assert counts([(0, [1], "a"), (1, [2, 9], "bc"), (2, [4, 5, 6], "def")])["mismatches"] == 1
    assert counts(same[:2] + [(1, [2, 3], "bc")] + same[2:])["duplicated_tokens"] == 2
    assert counts(same[:2], final="abc")["gaps"] == 1  # the final came before the last tokens
