"""The generated docs match their sources: docs/configuration.md the parsers, docs/performance.md
and README.md's headline block the recorded benchmark runs (benchmarks/results/*.json)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.results import make_record, target, write_record
from docs.gen_config import env_mismatches, render_configuration
from docs.gen_perf import (
    BEGIN,
    END,
    HEADLINES,
    RESULTS_DIRECTIVE,
    fmt,
    load_results,
    render_performance,
    update_readme,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
TEMPLATE = (ROOT / "docs" / "performance.in.md").read_text()
CITED = re.compile(r"benchmarks/results/([a-z0-9_]+)\.json")


def assert_up_to_date(path: Path, expected: str) -> None:
    actual = path.read_text() if path.exists() else ""
    if actual != expected:
        differ = next((i for i, (a, b) in enumerate(zip(actual.splitlines(), expected.splitlines(),
                                                         strict=False), 1) if a != b), None)
        pytest.fail(f"{path.relative_to(ROOT)} is out of date (first differing line: {differ}): "
                    "run make docs")


def table_rows(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in markdown.splitlines() if line.startswith("| ")]


def test_configuration_md_is_up_to_date() -> None:
    assert_up_to_date(ROOT / "docs" / "configuration.md", render_configuration())


def test_configuration_does_not_show_this_machines_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = render_configuration()
    monkeypatch.setenv("TOKENRELAY_MAX_QUEUE_DEPTH", "7")
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:1/2")
    monkeypatch.setenv("TOKENRELAY_PREFIX_CACHING", "0")
    assert render_configuration() == before


def test_configuration_lists_every_flag_with_the_variable_its_default_reads() -> None:
    text = render_configuration()
    worker = text[text.index("## tokenrelay-worker"):text.index("## tokenrelay up")]
    rows = {r[0]: r for r in table_rows(worker)}
    assert rows["`--max-num-seqs`"][1:3] == ["`TOKENRELAY_MAX_NUM_SEQS`", "`128`"]
    assert rows["`--prefix-caching` / `--no-prefix-caching`"][1:3] == [
        "`TOKENRELAY_PREFIX_CACHING=0` to disable", "on"]
    assert "`auto`, `none`, `q8_0`, `q4_0`" in rows["`--quantization`"][3]
    assert "### tokenrelay-gateway: limits" in text and "### tokenrelay-gateway: security" in text
    assert "| `TOKENRELAY_MAX_QUEUE_DEPTH` | tokenrelay-gateway `--max-queue-depth` |" in text


def test_every_env_note_in_a_help_text_names_the_variable_the_code_reads() -> None:
    assert env_mismatches() == []


def test_performance_md_is_up_to_date() -> None:
    expected = render_performance(TEMPLATE, load_results(RESULTS_DIR))
    assert_up_to_date(ROOT / "docs" / "performance.md", expected)


def test_readme_headline_is_up_to_date() -> None:
    readme = ROOT / "README.md"
    if BEGIN not in readme.read_text():
        pytest.skip("README.md has no headline markers")
    assert_up_to_date(readme, update_readme(readme.read_text(), load_results(RESULTS_DIR)))


def test_every_results_file_parses_and_every_cited_one_exists() -> None:
    results = load_results(RESULTS_DIR)  # raises naming a file that does not parse
    for name, record in results.items():
        assert set(record["payload"].get("targets", {})), f"{name}.json states no targets"
    for path in (ROOT / "docs" / "performance.md", ROOT / "README.md"):
        for name in CITED.findall(path.read_text()):
            assert (RESULTS_DIR / f"{name}.json").exists(), f"{path.name} cites results/{name}.json"
    for name in RESULTS_DIRECTIVE.findall(TEMPLATE):
        assert (ROOT / "benchmarks" / f"{name}.py").exists(), f"the template renders a benchmark {name!r}"


# -- the renderer, on synthetic results -------------------------------------------------------------

def payload(**targets: dict[str, Any]) -> dict[str, Any]:
    return {"decode_tps_b1": 200.5, "hf_decode_tps_b1": 100.25, "decode_ratio": 2.0, "runs": 3,
            "per_run": {"tps": [1.5, 2.5]}, "points": [{"streams": 64, "tok_s": 2454.4}],
            "targets": targets}


def record_in(tmp_path: Path, name: str, data: dict[str, Any]) -> None:
    write_record({**make_record(name, data, ["benchmarks/x.py", "--record"]),
                  "date": "2030-01-02T03:04:05+00:00",
                  "git": {"commit": "0123456789abcdef", "dirty": True},
                  "cpu": {"model": "Test CPU 9000", "isa": {"avx2": True, "avx512f": False}, "cores": 2}},
                 tmp_path)


def test_every_target_is_rendered_next_to_its_value_with_its_verdict(tmp_path: Path) -> None:
    targets = {"decode_ratio": target(2.0, ">=", 1.0), "redis_cmds_per_token": target(0.46, "<=", 0.2),
               "added_itl_p99_ms": target(None, "<=", 20), "is_correct": target(True, "==", True)}
    record_in(tmp_path, "engine", payload(**targets))
    text = render_performance(TEMPLATE, load_results(tmp_path))
    rows = table_rows(text)
    for metric, t in targets.items():
        verdict = {True: "met", False: "**NOT MET**", None: "not measured"}[t["met"]]
        assert [f"`{metric}`", fmt(t["value"]), t["target"].replace(">", "&gt;").replace("<", "&lt;"),
                verdict] in rows, metric
    assert ["2030-01-02T03:04:05+00:00", "Test CPU 9000 (avx2)", "2", "`0123456789` + uncommitted changes",
            "`python benchmarks/x.py --record`", "[engine.json](../benchmarks/results/engine.json)"] in rows
    assert ["`per_run.tps`", "1.5, 2.5"] in rows and ["64", "2,454"] in rows


def test_a_benchmark_without_results_says_how_to_record_it_and_shows_no_number() -> None:
    text = render_performance(TEMPLATE, {})
    for name in RESULTS_DIRECTIVE.findall(TEMPLATE):
        assert f"_Not recorded yet: run `make bench-{name.replace('_', '-')}`._" in text
    headline = update_readme(f"a\n{BEGIN}\nold\n{END}\nb\n", {}, TEMPLATE)
    rows = table_rows(headline)[1:]
    assert len(rows) == len(HEADLINES) and all("not recorded yet" in r[1] for r in rows)


def test_headline_block_is_replaced_between_its_markers_only(tmp_path: Path) -> None:
    record_in(tmp_path, "engine", payload(decode_ratio=target(2.0, ">=", 1.0)))
    results = load_results(tmp_path)
    readme = f"# title\n\nbefore\n\n{BEGIN}\nstale numbers\n{END}\n\nafter\n"
    updated = update_readme(readme, results, TEMPLATE)
    assert updated.startswith("# title\n\nbefore\n\n" + BEGIN) and updated.endswith(f"{END}\n\nafter\n")
    assert "stale numbers" not in updated
    assert update_readme(updated, results, TEMPLATE) == updated  # regenerating changes nothing
    row = next(r for r in table_rows(updated) if "fp32 engine vs transformers" in r[0])
    assert row[0].startswith("[batch-1 decode") and "(docs/performance.md#engine-vs-transformers" in row[0]
    assert row[1:6] == ["200.5", "transformers fp32 100.2", "2×", "&gt;= 1: met", "2030-01-02"]
    assert row[7] == "`python benchmarks/x.py --record`"
    assert update_readme("no markers\n", results, TEMPLATE) == "no markers\n"


def test_changed_results_change_the_rendered_page(tmp_path: Path) -> None:
    record_in(tmp_path, "engine", payload(decode_ratio=target(2.0, ">=", 1.0)))
    first = render_performance(TEMPLATE, load_results(tmp_path))
    record_in(tmp_path, "engine", payload(decode_ratio=target(0.9, ">=", 1.0)))
    second = render_performance(TEMPLATE, load_results(tmp_path))
    assert first != second and "**NOT MET**" in second


def test_a_broken_results_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "kv.json").write_text("{not json")
    with pytest.raises(ValueError, match="kv.json: not JSON"):
        load_results(tmp_path)
    (tmp_path / "kv.json").write_text('{"benchmark": "kv"}')
    with pytest.raises(ValueError, match="kv.json: no date, git, cpu, command, payload"):
        load_results(tmp_path)
