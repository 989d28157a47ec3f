"""The package as a volunteer installs it: a wheel that holds every module, and that runs from a fresh
environment."""

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # builds a wheel, starts processes


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (path,) = out.glob("spes_p2p-*.whl")
    return path


def test_the_wheel_holds_every_module_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "spes_p2p").rglob("*.py")}
    tree |= {"spes_cli/" + p.name for p in (ROOT / "cli").glob("*.py")}
    assert tree <= names, sorted(tree - names)
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    assert (
        "spes = spes_cli.main:spes" in entry_points and "spes-join = spes_cli.join:spes_join" in entry_points
    )


def test_the_installed_wheel_runs_a_simulation(wheel, tmp_path, cache_dir):
    """A fresh environment with the wheel alone (its dependencies borrowed from this one, not our tree)."""
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, timeout=120)
    (site / "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = "import spes_p2p.sim, spes_cli; print(spes_p2p.__file__)"
    where = subprocess.check_output(
        [python, "-c", code], text=True, cwd=tmp_path
    )  # (not in the tree's folder)
    assert where.startswith(str(env_dir)), where  # the wheel's copy, not the tree's
    for script in ("spes", "spes-join"):
        version = subprocess.run(
            [env_dir / "bin" / script, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert version.returncode == 0 and "0.1.0" in version.stdout
    out = tmp_path / "sim"
    args = "simulate --backend memory --num-peers 2 --shards 2 --rounds 1 --steps-per-round 2 --batch-size 2"
    args += f" --seq-len 32 --max-corpus-mb 1 --cache-dir {cache_dir} --out {out}"
    result = subprocess.run(
        [env_dir / "bin" / "spes", *args.split()], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 1 and not summary["failures"]
