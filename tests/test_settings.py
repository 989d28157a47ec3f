"""Settings: one field per setting, layered from defaults, a command's defaults, the method's, a file and
flags; errors that say where; and the repository's peers.toml generated from the fields."""

import dataclasses
from pathlib import Path

import pytest

from spes_p2p.errors import ConfigError
from spes_p2p.fields import flag_of
from spes_p2p.model.config import PRESETS
from spes_p2p.settings import (
    SECTIONS,
    Settings,
    load_settings,
    read_toml,
    reference_markdown,
    reference_toml,
)
from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"


def test_repo_peers_toml_is_generated_from_the_fields_and_changes_nothing():
    assert (ROOT / "peers.toml").read_text() == reference_toml(), "regenerate: python -m spes_p2p.settings"
    assert load_settings(ROOT / "peers.toml") == Settings()


def test_the_settings_reference_in_the_docs_is_generated_from_the_fields():
    text = (ROOT / "docs" / "settings.md").read_text()
    regenerate = "python -m spes_p2p.settings --markdown > docs/settings.md"
    assert text == reference_markdown(), f"regenerate: {regenerate}"
    keys = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert all(f"`{key}`" in text for key in keys)


def test_layers_win_in_order(tmp_path):
    path = tmp_path / "peers.toml"
    path.write_text(f'[swarm]\nrun_id = "my-run"\ninitial_peers = ["{PEER}"]\n[model]\nshards = 2\n')
    s = load_settings(path, {"model.shards": 4, "swarm.run_id": None}, defaults=LOCAL_SWARM_DEFAULTS)
    assert s.swarm.run_id == "my-run" and s.swarm.initial_peers == (
        PEER,
    )  # the file over the command's default
    assert s.model.shards == 4  # a flag over the file
    assert s.swarm.heartbeat_seconds == 1.0  # the command's default over the section's
    assert s.method.steps_per_round == 20 and Settings().method.steps_per_round == 100


def test_a_method_brings_its_defaults_unless_a_file_or_flag_sets_them(tmp_path):
    diloco = load_settings(None, {"method.mode": "diloco"})
    assert (diloco.sync.outer, diloco.sync.outer_lr, diloco.merge.enabled) == ("nesterov", 0.7, False)
    path = tmp_path / "peers.toml"
    path.write_text('[method]\nmode = "diloco"\n[sync]\nouter = "fedavg"\n')
    mixed = load_settings(path)
    assert (mixed.sync.outer, mixed.sync.outer_lr, mixed.merge.enabled) == ("fedavg", 0.7, False)
    assert Settings().override({"method.mode": "diloco"}).sync.outer == "nesterov"


def test_toml_written_by_the_library_reads_back_to_the_same_settings(tmp_path):
    s = Settings().override(
        {"swarm.initial_peers": (PEER,), "sync.codec": "nf4", "run.out": 'a "quoted" path'}
    )
    path = tmp_path / "written.toml"
    path.write_text(s.to_toml())
    assert load_settings(path) == s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[model]\nshards = 'four'\n", r"peers.toml:2: model\.shards must be int"),
        ("[model]\n\nbogus = 1\n", r"peers.toml:3: model\.bogus is not a setting"),
        (
            "[model]\nrope_theta = -1.0\n",
            r"peers.toml:2: model\.rope_theta must be 0 \(the preset's\) or more",
        ),
        ("[modle]\nshards = 2\n", r"unknown section \[modle\]"),
        (
            "[model]\nshards = 3\n",
            r"peers.toml:2: model\.shards \(3\) must divide the number of experts \(8\)",
        ),
        (
            "[swarm]\ninitial_peers = ['/ip4/1.2.3.4/tcp/notaport']\n",
            r"peers.toml:2: swarm\.initial_peers has a malformed multiaddr",
        ),
        ("[swarm]\ninitial_peers = ['/ip4/1.2.3.4/tcp/5']\n", "lacks its /p2p/<peer id> part"),
        (
            "[sync]\ncodec = 'zip'\n",
            r"peers.toml:2: sync\.codec must be one of none, fp16, int8, nf4, topk",
        ),
        (
            "[swarm]\nheartbeat_seconds = 10.0\nrecord_ttl_seconds = 5\n",
            r"peers.toml:3: swarm\.record_ttl_seconds must exceed twice",
        ),
        ("[swarm\nrun_id = 'x'\n", "not valid TOML"),
        ("[network]\nclient_mode = 1\n", r"client_mode must be bool"),
        # checks across sections name the field to change, where it was set
        (
            "[model]\ndense_blocks = 2\n[peer]\nactive_blocks = 3\n",
            r"peers.toml:4: peer\.active_blocks must be at most",
        ),
        (
            "[model]\ndense_blocks = 2\n[method]\nmode = 'diloco'\n",
            r"peers.toml:2: model\.dense_blocks must be 1",
        ),
        (
            "[train]\nseq_len = 4096\n",
            r"peers.toml:2: train\.seq_len \(4096\) exceeds the model's max_seq_len",
        ),
        ("[sim]\njoins = ['-1@2']\n", r"peers.toml:2: sim\.joins take at least one newcomer"),
        ("[sim]\nkills = ['9@2']\n", r"peers.toml:2: sim\.kills name no peer 9"),
        ("[sim]\ndrop = 0.1\n", r"swarm\.backend must be memory"),
        ("[run]\nowned_shards = '7'\n", r"peers.toml:2: run\.owned_shards names shard 7"),
        (
            "[swarm]\nallowlist = ['/p2p/Qm1']\n",
            r"swarm\.allowlist has '/p2p/Qm1', which is not a peer id",
        ),
        ("[sim]\nbyzantine = ['1:evil']\n", r"sim\.byzantine has '1:evil'; write I:MODE"),
        (
            "[train]\nbatch_size = 8\nseq_len = 128\n[sync]\nmax_round_tokens = 1000\n",
            r"train\.batch_size x seq_len x steps_per_round \(102400\) is over sync\.max_round_tokens",
        ),
    ],
)
def test_bad_files_name_the_line_section_and_field(tmp_path, text, message):
    path = tmp_path / "peers.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(path)


def test_bad_flags_name_the_flag():
    with pytest.raises(ConfigError, match=r"^--listen: network\.listen has a malformed multiaddr"):
        load_settings(None, {"network.listen": ("nonsense",)})
    with pytest.raises(ConfigError, match=r"^--active-blocks: peer\.active_blocks must be at most"):
        load_settings(None, {"peer.active_blocks": 3})
    with pytest.raises(ConfigError, match=r"^--capacity: peer\.capacity must be at least 0"):
        load_settings(None, {"peer.capacity": -1})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_toml(tmp_path / "nope.toml")


def test_every_setting_has_help_and_one_flag():
    flags = {}
    for section, cls in SECTIONS.items():
        assert cls.__doc__.startswith(f"[{section}]: "), section
        for f in dataclasses.fields(cls):
            assert f.metadata["help"], (section, f.name)
            flags.setdefault(flag_of(f), []).append(f"{section}.{f.name}")
    shared = {flag: owners for flag, owners in flags.items() if len(owners) > 1}
    assert shared == {}  # (--peers is always addresses; a simulation's peer count is --num-peers)


def test_swarm_wide_settings_are_those_that_must_match():
    wide = Settings().swarm_wide()
    assert {"model.shards", "sync.codec", "method.steps_per_round", "merge.enabled"} <= set(wide)
    assert not {k for k in wide if k.split(".")[0] in ("train", "data", "network", "peer", "run", "sim")}
    assert "sync.deadline_max" not in wide  # a peer's own patience


def test_a_simulated_peer_gets_its_own_values():
    sim = load_settings(
        None,
        {"sim.peers": 3, "sim.peer_settings": ("0:peer.capacity=0", "2:train.device=cpu")},
        defaults=LOCAL_SWARM_DEFAULTS,
    ).sim
    assert sim.overrides == {0: {"peer.capacity": 0}, 2: {"train.device": "cpu"}}
    for bad, message in (("0:capacity=0", "I:SECTION.FIELD=VALUE"), ("5:peer.capacity=0", "names no peer 5")):
        with pytest.raises(ConfigError, match=message):
            load_settings(None, {"sim.peers": 3, "sim.peer_settings": (bad,)}, defaults=LOCAL_SWARM_DEFAULTS)


def test_the_vocabulary_rope_theta_and_epsilon_override_the_presets_and_zero_keeps_them():
    model = (
        Settings()
        .override({"model.vocab_size": 151_665, "model.rope_theta": 5e5, "model.norm_eps": 1e-6})
        .model
    )
    config = model.architecture()
    assert (config.vocab_size, config.rope_theta, config.norm_eps) == (151_665, 5e5, 1e-6)
    assert config.d_model == Settings().model.architecture().d_model  # the rest is the preset's
    assert Settings().model.architecture() == PRESETS["tiny"]
