"""The package outside the repository: the wheel alone runs the demo from any folder (its recipe and rows are
built-ins shipped inside it), and nothing at the repository's top level can stand in for one of its subpackages
when Python runs from the clone's parent folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import REPO

import lowmem_dpo

PACKAGE_NAMES = {p.name.removesuffix(".py") for p in Path(lowmem_dpo.__file__).parent.iterdir()
                 if p.suffix == ".py" or (p / "__init__.py").is_file()}


def test_nothing_at_the_top_of_the_repository_is_named_as_a_part_of_the_package():
    """From the clone's parent folder, the clone (named lowmem_dpo) is a namespace portion of the package: a
    top-level data/ was imported as lowmem_dpo.data."""
    top = {p.name.removesuffix(".py") for p in REPO.iterdir() if not p.name.startswith(".")}
    assert top & PACKAGE_NAMES == set()
    assert {"data", "config", "model", "training", "plan"} <= PACKAGE_NAMES  # the check sees the package's names


def test_the_package_imports_from_the_clones_parent_folder(tmp_path):
    """As the user ran it: a folder holding the clone under the name lowmem_dpo, Python started there."""
    (tmp_path / "lowmem_dpo").symlink_to(REPO, target_is_directory=True)
    code = "import lowmem_dpo.data.cache, lowmem_dpo.plan, lowmem_dpo.config.recipe; print(lowmem_dpo.data.cache.__file__)"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().endswith(os.path.join("lowmem_dpo", "data", "cache.py"))


def test_the_wheel_runs_the_demo_from_another_folder(tmp_path):
    """The wheel built from this tree, installed (no dependencies: they are this venv's, seen through a path file
    that does not run its editable hook) into a fresh venv; precompute and train of the built-in recipe run from
    an empty folder, with the package's own copy, and write there."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "lowmem_dpo", src / "lowmem_dpo", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("lowmem_dpo-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch & co. (a path, not its .pth)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                              str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import lowmem_dpo; print(lowmem_dpo.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=300)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    keys = ["max_steps=2", "eval_steps=2", "save_steps=2", "eval_generations=1", "max_new_tokens=4"]
    for stage in ("precompute", "train"):
        p = subprocess.run([str(python), "-m", f"lowmem_dpo.{stage}", "lowmem_dpo:tiny-cpu", *keys], cwd=work,
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    assert (work / "runs" / "tiny" / "adapter_model.safetensors").is_file()
    assert (work / "runs" / "tiny-ref-cache" / "index.sqlite").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["runs"]
