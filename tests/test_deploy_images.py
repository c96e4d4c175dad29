"""deploy/Dockerfile.*, read statically (no Docker engine here or in CI): each image is built from
the wheel, as a user installs it. A build stage runs `pip wheel --no-deps .`; the image's own stage
copies nothing but that wheel, pip-installs it and runs from a folder that holds no source, so the
installed package (tests/test_wheel.py runs one) is what runs, never a source tree shadowing it."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "deploy").glob("Dockerfile.*"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def stages(dockerfile: Path) -> list[Stage]:
    """The file's stages in order; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in dockerfile.read_text().splitlines()
                                          if not ln.lstrip().startswith("#")))
    found: list[Stage] = []
    for line in filter(str.strip, text.splitlines()):
        keyword, _, args = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            image, _, name = args.partition(" AS ")
            found.append(Stage(name.strip() or image.strip()))
        found[-1].instructions.append((keyword.upper(), args.strip()))
    return found


def copy_sources(args: str) -> tuple[list[str], str]:
    """COPY [--from=...] src... dest -> (flags and sources, dest)."""
    *sources, dest = shlex.split(args)
    return sources, dest


def the_wheel_stage(dockerfile: Path) -> Stage:
    builds = [s for s in stages(dockerfile)[:-1] if any("pip wheel" in r for r in s.args("RUN"))]
    assert len(builds) == 1, f"{dockerfile.name}: not one build stage that runs `pip wheel`"
    return builds[0]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_a_build_stage_builds_the_wheel_from_the_files_its_build_needs(dockerfile: Path) -> None:
    build = the_wheel_stage(dockerfile)
    (run,) = [r for r in build.args("RUN") if "pip wheel" in r]
    assert "--no-deps" in run.split() and "--wheel-dir /wheels" in run and run.endswith(" .")
    copied = {src.rstrip("/") for args in build.args("COPY") for src in copy_sources(args)[0]}
    # what setuptools reads: the project file, its readme, and every package it finds
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert copied == {"pyproject.toml", PYPROJECT["project"]["readme"], *packages}
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not copied & set(ignored)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_installs_only_the_wheel_and_runs_outside_any_source(dockerfile: Path) -> None:
    build, image = the_wheel_stage(dockerfile), stages(dockerfile)[-1]
    assert image.args("ADD") == []
    for args in image.args("COPY"):  # nothing from the build context: only the built wheel
        flags, dest = copy_sources(args)
        assert flags == [f"--from={build.name}", "/wheels"] and dest == "/wheels", args
    installs = [r for r in image.args("RUN") if re.search(r"pip install [^&]*/wheels/tokenrelay-\*\.whl", r)]
    assert len(installs) == 1 and "--no-deps /wheels" not in installs[0]
    assert "rm -rf /wheels" in installs[0]
    (entrypoint,) = image.args("ENTRYPOINT")
    script = entrypoint.strip('[]"')
    assert script in PYPROJECT["project"]["scripts"]
    assert ("tokenrelay-*.whl)[worker]" in installs[0]) == (script == "tokenrelay-worker")
    (source,) = build.args("WORKDIR")
    (workdir,) = image.args("WORKDIR")  # set after the install, a folder of its own
    assert workdir not in ("/", source) and not workdir.startswith(f"{source}/")
    assert image.args("USER") == ["65534"]
