import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from spes_cli.main import PRESET_NAMES, spes

from spes_p2p.model import PRESETS

HEAVY = ("torch", "hivemind", "bitsandbytes", "libp2p", "numpy")


def test_help_does_not_import_the_heavy_stack():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from spes_cli.main import spes\n"
        "from spes_cli.join import spes_join\n"
        "for cmd, args in ((spes, []), (spes, ['status']), (spes, ['train']), (spes_join, [])):\n"
        "    assert CliRunner().invoke(cmd, [*args, '--help']).exit_code == 0\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_console_scripts_are_installed():
    bindir = Path(sys.executable).parent
    for script in ("spes", "spes-join"):
        out = subprocess.run([str(bindir / script), "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "Usage:" in out.stdout


def test_preset_names_mirror_the_model_presets():
    assert tuple(PRESETS) == PRESET_NAMES


def test_memory_json_counts_what_is_allocated():
    result = CliRunner().invoke(
        spes,
        [
            "memory",
            "--preset",
            "tiny",
            "--shards",
            "4",
            "--owned-shards",
            "1",
            "--optimizer",
            "adamw",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    keys = (
        "total_params",
        "trainable_params",
        "weights_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "total_bytes",
    )
    for key in keys:
        assert key in report and key in report["full"]
    full = report["full"]
    assert report["total_params"] == full["total_params"] == full["trainable_params"]
    assert report["weights_bytes"] == 4 * report["total_params"]
    assert report["grads_bytes"] == 4 * report["trainable_params"]
    # torch AdamW: two fp32 moments per trainable element, plus one 4-byte step counter per tensor
    n_tensors = (report["optimizer_bytes"] - 8 * report["trainable_params"]) // 4
    assert report["optimizer_bytes"] == 8 * report["trainable_params"] + 4 * n_tensors and 0 < n_tensors < 100
    per_expert = 3 * 64 * 128
    assert (
        full["trainable_params"] - report["trainable_params"] == 3 * 2 * 2 * per_expert
    )  # 3 shards x 2 layers x 2
    assert (
        report["total_bytes"] == report["weights_bytes"] + report["grads_bytes"] + report["optimizer_bytes"]
    )
    assert report["total_bytes"] < full["total_bytes"]


def test_memory_8bit_state_is_smaller():
    runner = CliRunner()
    args = ["memory", "--preset", "tiny", "--owned-shards", "1", "--json", "--optimizer"]
    eight = json.loads(runner.invoke(spes, [*args, "adamw8bit"]).output)
    fp32 = json.loads(runner.invoke(spes, [*args, "adamw"]).output)
    assert eight["optimizer_bytes"] < 0.5 * fp32["optimizer_bytes"]
    assert eight["grads_bytes"] == fp32["grads_bytes"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["memory", "--preset", "huge"], "unknown preset 'huge'; choose one of: tiny, small, 1b, 2b, 7b"),
        (["memory", "--preset", "tiny", "--shards", "3"], "shards (3) must divide the number of experts (8)"),
        (["memory", "--preset", "tiny", "--owned-shards", "4"], "owned shard 4 is out of range"),
        (["train", "--corpus", "/nonexistent/corpus", "--out", "{tmp}"], "does not exist"),
        (["train", "--resume", "--out", "{tmp}"], "nothing to resume"),
    ],
)
def test_bad_input_gets_one_clear_line(args, message, tmp_path, cache_dir):
    args = [a.replace("{tmp}", str(tmp_path / "run")) for a in args]
    if args[0] == "train":
        args += ["--max-corpus-mb", "1", "--cache-dir", cache_dir]
    out = subprocess.run(
        [sys.executable, "-m", "spes_cli", *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert message in " ".join(out.stderr.split())
