from spes_p2p.swarm.reachability import assess

PID = "/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"


def test_public_address_is_reachable():
    r = assess(
        [f"/ip4/10.0.0.5/tcp/31337{PID}", f"/ip4/93.184.216.34/tcp/31337{PID}"],
        client_mode=False,
        announced=True,
        relay=False,
    )
    assert r.reachable and "93.184.216.34" in r.message


def test_private_only_names_the_flags_that_fix_it():
    r = assess([f"/ip4/192.168.1.20/tcp/4001{PID}"], client_mode=False, announced=False, relay=False)
    assert not r.reachable
    assert "--announce" in r.message and "--use-relay" in r.message and "--client-mode" in r.message


def test_loopback_client_and_relay():
    assert (
        "loopback"
        in assess([f"/ip4/127.0.0.1/tcp/1{PID}"], client_mode=False, announced=False, relay=False).message
    )
    assert not assess([], client_mode=True, announced=False, relay=False).reachable
    assert assess(
        [f"/ip4/192.168.1.20/tcp/4001{PID}"], client_mode=False, announced=False, relay=True
    ).reachable
