"""The images (deploy/docker/*.Dockerfile, the build context's .dockerignore), read by a Dockerfile
parser (dockerfile-parse) and checked against the repository, without a Docker daemon.

- each is multi-stage and its final stage runs as a non-root user;
- every COPY from the context names something the context has: it exists in the repository and
  .dockerignore (matched by the Docker SDK's own implementation of its rules) keeps it, and the C
  sources setup.py compiles for the copied packages are in it too;
- the router image installs the router's extra only and takes no torch; the replica image
  takes CUDA torch on the CUDA runtime base, flash-attn behind a build argument, and a CPU
  variant on slim Python;
- each entrypoint runs (``--help``) in this virtualenv; the router's imports no torch.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
IMAGES = ("router", "replica")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)


def stages(image: str, **build_args: str) -> list[Stage]:
    """The stages of ``deploy/docker/{image}.Dockerfile`` with ``build_args`` applied to FROM lines."""
    parser = DockerfileParser(str(DOCKER / f"{image}.Dockerfile"), build_args=build_args)
    bases = iter(parser.parent_images)  # FROM images with the ARGs resolved, in order
    out: list[Stage] = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            words = ins["value"].split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            out.append(Stage(next(bases), name))
        elif out:
            out[-1].instructions.append((ins["instruction"], ins["value"]))
    return out


def final_base(all_stages: list[Stage]) -> str:
    """The image the final stage ends up on, following stage names (``FROM run-cuda`` -> its base)."""
    by_name = {s.name: s for s in all_stages if s.name}
    base = all_stages[-1].base
    while base in by_name:
        base = by_name[base].base
    return base


def copy_sources(all_stages: list[Stage]) -> list[str]:
    """The context paths of every COPY / ADD that reads the build context (not ``--from``)."""
    out = []
    for stage in all_stages:
        for instruction, value in stage.instructions:
            if instruction not in ("COPY", "ADD"):
                continue
            words = json.loads(value) if value.lstrip().startswith("[") else shlex.split(value)
            flags = [w for w in words if w.startswith("--")]
            if any(f.startswith("--from=") for f in flags):
                continue
            paths = [w for w in words if not w.startswith("--")]
            assert len(paths) >= 2, f"COPY {value!r}: a source and a destination"
            out += paths[:-1]
    return out


def entrypoint(all_stages: list[Stage]) -> list[str]:
    """The final stage's ENTRYPOINT + CMD (exec form required: signals reach the process)."""
    argv: list[str] = []
    for instruction, value in all_stages[-1].instructions:
        if instruction in ("ENTRYPOINT", "CMD"):
            assert value.lstrip().startswith("["), f"{instruction} {value}: use the exec (JSON) form"
            argv += json.loads(value)
    return argv


@pytest.fixture(scope="module")
def context() -> set[str]:
    """What `docker build` would send from the repository root: every path .dockerignore keeps."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return set(exclude_paths(str(ROOT), patterns))


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_is_multi_stage_and_runs_as_a_non_root_user(image):
    all_stages = stages(image)
    assert len(all_stages) >= 2
    users = [v for i, v in all_stages[-1].instructions if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    final_runs = [v for i, v in all_stages[-1].instructions if i == "RUN"]
    assert not [v for v in final_runs if "pip install" in v or "gcc" in v]  # built in an earlier stage


@pytest.mark.parametrize("image", IMAGES)
def test_every_copy_source_is_in_the_build_context(image, context):
    sources = copy_sources(stages(image))
    assert sources
    for src in sources:
        path = src.rstrip("/")
        assert (ROOT / path).exists(), f"{image}: COPY {src}: not in the repository"
        assert path in context, f"{image}: COPY {src}: excluded by .dockerignore"
        if (ROOT / path).is_dir():
            assert any(p.startswith(path + "/") and p.endswith(".py") for p in context), f"{image}: {src} is empty"
    copied = {s.rstrip("/") for s in sources}
    c_sources = re.findall(r'sources=\["([^"]+)"\]', (ROOT / "setup.py").read_text())
    for c in c_sources:
        if c.split("/")[0] in copied:
            assert c in context, f"{image}: setup.py compiles {c}, which the context lacks"


def test_the_build_context_leaves_out_the_repository_s_other_parts(context):
    assert not {".venv", ".git", "tests", "deploy", "bench"} & context
    assert not [p for p in context if p.endswith((".so", ".pyc")) or "__pycache__" in p]
    assert not list(DOCKER.glob("*.dockerignore"))  # one ignore file, at the context's root


def test_the_router_image_installs_the_router_and_bridge_extras_and_no_torch():
    all_stages = stages("router")
    assert final_base(all_stages).endswith("-slim")
    runs = " ".join(v for s in all_stages for i, v in s.instructions if i == "RUN")
    assert re.search(r'pip install "\.\[router,bridge\]"', runs)
    assert "torch" not in runs
    # Of replica/, only what `kvroute bridge` runs (the package marker, the bridge, the Redis
    # publisher) and the default model's generator the chart's router init container runs
    # (`resolve_model --tokenizer-only`, torch-free: tests/router/test_no_torch.py).
    assert sorted(c for c in copy_sources(all_stages) if c.startswith("replica")) == [
        "replica/__init__.py", "replica/bridge/", "replica/model/", "replica/publisher/"]


def test_the_replica_image_is_cuda_torch_on_the_cuda_runtime_with_flash_attn_as_a_build_argument():
    cuda = stages("replica")  # VARIANT=cuda by default
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", final_base(cuda))
    build = next(s for s in cuda if s.name == "build")
    args = {v.split("=")[0] for i, v in build.instructions if i == "ARG"}
    assert {"FLASH_ATTN", "TORCH_VERSION", "VARIANT"} <= args
    runs = " ".join(v for i, v in build.instructions if i == "RUN")
    assert 'pip install ".[replica]"' in runs and "flash-attn==" in runs
    # the torch pin the CPU install uses too (the Makefile's), so both variants run the tested torch
    makefile_torch = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"TORCH_VERSION={makefile_torch}" in {v for i, v in build.instructions if i == "ARG"}
    cpu = stages("replica", VARIANT="cpu")
    assert final_base(cpu) == final_base(stages("router"))  # the CPU variant: slim Python


@pytest.mark.parametrize("image", IMAGES)
def test_the_entrypoint_runs_here(image):
    argv = entrypoint(stages(image))
    assert argv[:2] == ["python", "-m"], argv
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv[1:], "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m " + argv[2])
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert argv[2] in imported
    if image == "router":
        assert not imported & {"torch", "replica", "matplotlib", "transformers"}
