"""The container image (no Docker here, so it is not built): its Dockerfile installs a wheel that holds every
package, its entry point is the `cacheflow` command, and the chart and operator name the same image and user."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import yaml

from cacheflow_operator.manifests.common import RUN_AS
from cacheflow_operator.spec import DEFAULT_IMAGE
from tests.k8s.checks import CHART, REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_the_entry_point_is_the_cacheflow_command():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert re.search(r'^ENTRYPOINT \["cacheflow"\]$', DOCKERFILE, re.M)
    assert pyproject["project"]["scripts"]["cacheflow"] == "cacheflow_services.cli:main"
    assert re.search(r"^FROM python:3\.11-slim$", DOCKERFILE, re.M)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", DOCKERFILE, re.M)
    assert re.search(r'pip install "\.\[services,model,operator\]"', DOCKERFILE)
    assert re.search(rf"^USER {RUN_AS}$", DOCKERFILE, re.M), "the pods run as this uid (runAsNonRoot)"
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"] == DEFAULT_IMAGE


def test_the_image_can_make_and_check_grants():
    """The operator makes the internal Secret's Ed25519 keys, the coordinator signs grants and workers verify them:
    every extra the Dockerfile installs for them must bring `cryptography`."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (installed,) = re.findall(r'pip install "\.\[([a-z,]+)\]"', DOCKERFILE)
    for extra in ("operator", "services"):
        assert extra in installed.split(",")
        assert any(re.match(r"cryptography\b", dep) for dep in extras[extra]), extra


def test_the_dockerfile_installs_every_package(tmp_path: Path):
    """Build the wheel from exactly what the Dockerfile copies: a package left out of pyproject's list (or
    a folder the Dockerfile forgets) would be missing from the image."""
    src = tmp_path / "src"
    src.mkdir()
    for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M):
        *sources, dest = line.split()
        for name in sources:
            target = src / (dest if dest not in ("./", ".") else name)
            copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
            copy(REPO / name, target)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("cacheflow-*.whl")
    packed = {Path(n).parent.as_posix() for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/__init__.py")}
    wanted = set()  # every package in the tree, by import path: each folder holds cacheflow_* packages
    for root in ("cacheflow_common", "services", "operator", "bench"):
        for init in (REPO / root).rglob("__init__.py"):
            parts = init.relative_to(REPO).parts[:-1]
            top = next(i for i, part in enumerate(parts) if part.startswith("cacheflow_"))
            wanted.add("/".join(parts[top:]))
    assert wanted - packed == set(), "packages missing from the image's wheel"


def test_the_operator_command_needs_a_scope():
    run = subprocess.run([sys.executable, "-m", "cacheflow_services.cli", "operator", "--liveness-port", "0"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2 and "--namespace NS (repeatable) or --all-namespaces" in run.stderr
