from pathlib import Path

import pytest

from spes_p2p.errors import ConfigError
from spes_p2p.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"


def test_repo_peers_toml_lists_the_defaults():
    assert load_settings(ROOT / "peers.toml") == Settings()


def test_file_values_and_flag_overrides(tmp_path):
    path = tmp_path / "peers.toml"
    path.write_text(f'[swarm]\nrun_id = "my-run"\ninitial_peers = ["{PEER}"]\n[model]\nshards = 2\n')
    s = load_settings(path)
    assert s.swarm.run_id == "my-run" and s.swarm.initial_peers == (PEER,) and s.model.shards == 2
    o = s.override(model__shards=4, swarm__run_id=None, network__listen=("/ip4/127.0.0.1/tcp/0",))
    assert (
        o.model.shards == 4 and o.swarm.run_id == "my-run" and o.network.listen == ("/ip4/127.0.0.1/tcp/0",)
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[model]\nshards = 'four'\n", r"peers.toml:2: \[model\] shards must be int"),
        ("[model]\n\nbogus = 1\n", r"peers.toml:3: \[model\] bogus is not a setting"),
        ("[modle]\nshards = 2\n", r"unknown section \[modle\]"),
        (
            "[swarm]\ninitial_peers = ['/ip4/1.2.3.4/tcp/notaport']\n",
            r"peers.toml:2: \[swarm\] initial_peers has a malformed multiaddr",
        ),
        ("[swarm]\ninitial_peers = ['/ip4/1.2.3.4/tcp/5']\n", "lacks its /p2p/<peer id> part"),
        (
            "[method]\ncodec = 'zip'\n",
            r"peers.toml:2: \[method\] codec must be one of none, fp16, int8, nf4, topk",
        ),
        (
            "[swarm]\nheartbeat_seconds = 10.0\nrecord_ttl_seconds = 5\n",
            "record_ttl_seconds must exceed twice",
        ),
        ("[swarm\nrun_id = 'x'\n", "not valid TOML"),
        ("[network]\nclient_mode = 1\n", r"client_mode must be bool"),
    ],
)
def test_bad_files_name_the_field_and_line(tmp_path, text, message):
    path = tmp_path / "peers.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(path)


def test_bad_override_names_the_field():
    with pytest.raises(ConfigError, match="listen has a malformed multiaddr"):
        Settings().override(network__listen=("nonsense",))
    with pytest.raises(ConfigError, match="capacity must be at least 1"):
        Settings().override(peer__capacity=0)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.toml")
