import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from spes_cli.join import spes_join
from spes_cli.main import TRAIN_DEFAULTS, spes
from spes_cli.options import SettingOption

from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS
from spes_p2p.train.accounting import KEYS

HEAVY = ("torch", "hivemind", "bitsandbytes", "libp2p", "numpy")


@pytest.mark.slow  # a fresh interpreter
def test_help_does_not_import_the_heavy_stack():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from spes_cli.main import spes\n"
        "from spes_cli.join import spes_join\n"
        "commands = [(spes, []), (spes_join, [])] + [(spes, [c]) for c in ('status', 'dashboard', 'train')]\n"
        "commands += [(spes, ['data']), (spes, ['data', 'prepare'])]\n"
        "for cmd, args in commands:\n"
        "    assert CliRunner().invoke(cmd, [*args, '--help']).exit_code == 0\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # the installed console scripts
def test_console_scripts_are_installed():
    bindir = Path(sys.executable).parent
    for script in ("spes", "spes-join"):
        out = subprocess.run([str(bindir / script), "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "Usage:" in out.stdout


def setting_options(command) -> dict[str, SettingOption]:
    return {p.opts[0]: p for p in command.params if isinstance(p, SettingOption)}


def test_a_setting_has_the_same_flag_help_and_default_in_every_command():
    commands = {name: spes.commands[name] for name in ("train", "memory", "simulate", "status", "dashboard")}
    commands["spes-join"] = spes_join
    own_defaults = {  # each documented in --help
        "simulate": LOCAL_SWARM_DEFAULTS,
        "train": TRAIN_DEFAULTS,
        "dashboard": {"dashboard.port": 8080, "dashboard.host": "127.0.0.1"},  # (--port, --host)
    }
    seen: dict[str, tuple] = {}
    for name, command in commands.items():
        for flag, option in setting_options(command).items():
            if option.key in own_defaults.get(name, {}):
                continue
            seen.setdefault(option.key, (flag, option.help, option.default))
            assert seen[option.key] == (flag, option.help, option.default), (name, flag)
    assert {"sync.codec", "model.preset", "model.shards", "train.lr"} <= set(seen)
    assert {"--port", "--host", "--peers"} <= set(setting_options(commands["dashboard"]))
    assert {"--dashboard", "--dashboard-host"} <= set(setting_options(spes_join))
    for name in ("train", "simulate", "spes-join"):  # what a run of a model needs, everywhere
        assert {"--config", "--corpus", "--lr", "--optimizer", "--seed", "--tokenizer"} <= {
            o for p in commands[name].params for o in p.opts
        }, name


def test_memory_json_counts_what_is_allocated():
    result = CliRunner().invoke(
        spes,
        [
            "memory",
            "--preset",
            "tiny",
            "--shards",
            "4",
            "--capacity",
            "1",
            "--optimizer",
            "adamw",
            "--dense-blocks",
            "1",
            "--frozen-experts",
            "full",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    for key in KEYS:
        assert key in report and key in report["full"] and key in report["diloco"]
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
    # the outer state: the round's start weights of what it trains, and the last version of its shard
    assert report["outer_bytes"] == 4 * report["trainable_params"] + 4 * 2 * 2 * per_expert
    held = ("weights_bytes", "grads_bytes", "optimizer_bytes", "outer_bytes")
    assert report["total_bytes"] == sum(report[k] for k in held)
    diloco = report["diloco"]  # trains everything, with its start weights and Nesterov momentum
    assert {k: diloco[k] for k in held[:3]} == {k: full[k] for k in held[:3]}
    assert diloco["outer_bytes"] == 8 * full["total_params"] and full["outer_bytes"] == 0
    assert report["ratio_vs_diloco"] == report["total_bytes"] / diloco["total_bytes"] < 1
    assert report["preflight"]["fits"] and report["preflight"]["device"] == "cpu"


def test_memory_8bit_state_is_smaller():
    runner = CliRunner()
    args = ["memory", "--preset", "tiny", "--capacity", "1", "--json", "--optimizer"]
    eight = json.loads(runner.invoke(spes, [*args, "adamw8bit"]).output)
    fp32 = json.loads(runner.invoke(spes, [*args, "adamw"]).output)
    assert eight["optimizer_bytes"] < 0.5 * fp32["optimizer_bytes"]
    assert eight["grads_bytes"] == fp32["grads_bytes"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["memory", "--preset", "huge"], 2, "'huge' is not one of 'tiny', 'small', '1b', '2b', '7b'"),
        (
            ["memory", "--shards", "3"],
            1,
            "--shards: model.shards (3) must divide the number of experts (8)",
        ),
        (["memory", "--capacity", "5"], 1, "capacity must be between 1 and the shards (4)"),
        (["train", "--owned-shards", "4", "--out", "{tmp}"], 1, "run.owned_shards names shard 4"),
        (["train", "--corpus", "/nonexistent/corpus", "--out", "{tmp}"], 1, "does not exist"),
        (["train", "--resume", "--out", "{tmp}"], 1, "nothing to resume"),
        (["simulate", "--join", "-1@2", "--backend", "memory"], 1, "sim.joins take at least one newcomer"),
        (["simulate", "--kill", "x@2"], 1, "--kill: sim.kills take NUMBER@ROUND"),
        (["dashboard", "--port", "70000"], 1, "--port: dashboard.port must be a TCP port, 0 to 65535"),
    ],
)
def test_bad_input_gets_one_clear_line(args, code, message, tmp_path, cache_dir):
    """1: our own error, one red line; 2: a usage error that click catches itself. Never a traceback."""
    args = [a.replace("{tmp}", str(tmp_path / "run")) for a in args]
    if args[0] == "train":
        args += ["--max-corpus-mb", "1", "--cache-dir", cache_dir]
    result = CliRunner().invoke(spes, args)
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit)  # not an exception that escaped
    assert message in " ".join(result.stderr.split())
    assert len(result.stderr.strip().splitlines()) <= 4  # (click's usage error adds its usage lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--out", "{file}"], "is a file, not a folder"),
        (["train", "--out", "{file}/run"], "cannot write there (Not a directory)"),
        (["simulate", "--backend", "memory", "--out", "{file}"], "is a file, not a folder"),
    ],
)
def test_an_out_folder_that_cannot_be_written_is_one_clear_line(args, message, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    result = CliRunner().invoke(spes, [a.replace("{file}", str(file)) for a in args])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert message in " ".join(result.stderr.split())
    assert file.read_text() == "not a folder"  # nothing lost


def test_spes_join_checks_its_folders_before_starting(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    for flag, target, message in (
        ("--out", f"{file}/sub", f"--out {file}/sub: cannot write there"),
        ("--identity", f"{file}/identity.key", f"the folder of --identity {file} is a file, not a folder"),
    ):
        result = CliRunner().invoke(spes_join, ["--new-swarm", flag, target])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert message in " ".join(result.stderr.split())


def test_a_model_too_big_for_this_machine_is_refused_before_it_is_built(monkeypatch, tmp_path):
    import psutil

    class Memory:
        available = 2 * 2**30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    result = CliRunner().invoke(spes, ["train", "--preset", "1b", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    line = " ".join(result.stderr.split())
    assert "1b needs about" in line and "2.0 GiB free" in line and "Presets that fit: tiny, small" in line


def test_netns_without_root_says_what_is_missing_in_one_line_and_keeps_the_last_run(monkeypatch, tmp_path):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    earlier = tmp_path / "peers" / "peer0" / "metrics.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("{}\n")
    for args in (["--netns", "--out", str(tmp_path)], ["--cleanup"]):
        result = CliRunner().invoke(spes, ["simulate", *args])
        assert result.exit_code != 0
        assert "needs root" in result.output and "Traceback" not in result.output, result.output
    assert earlier.exists(), "an earlier run's results are still there"
