"""The cluster key: where it is read from, what is refused, what never shows; ZAP's decision; the refusal log."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import zmq
from zmq.utils import z85

from dpserve_shared.zmq_security import (
    CLUSTER_KEY_ENV,
    ClusterKeyError,
    RefusalLog,
    ZmqSecurity,
    add_security_flags,
    new_cluster_key,
    security_from_args,
    zap_reply,
)

KEY = "0123456789abcdef" * 4


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_security_flags(parser)
    return parser.parse_args(list(argv))


def test_one_key_gives_every_process_the_same_keypair_and_no_repr_shows_it():
    a, b = ZmqSecurity.from_cluster_key(KEY), ZmqSecurity.from_cluster_key(KEY + "\n")  # a file's newline
    assert a == b and a.is_secure
    assert a.public_key == zmq.curve_public(a.secret_key)
    assert ZmqSecurity.from_cluster_key(new_cluster_key()).public_key != a.public_key
    for shown in (repr(a), str(a), a.describe()):
        assert KEY not in shown and a.secret_key.decode() not in shown and a.public_key.decode() not in shown
    assert a.fingerprint in a.describe()


@pytest.mark.parametrize("bad", ["short", "x" * 31, "x" * 20 + " " + "x" * 20])
def test_a_weak_key_is_refused_naming_how_to_make_one(bad):
    with pytest.raises(ClusterKeyError, match="openssl rand -hex 32"):
        ZmqSecurity.from_cluster_key(bad)


def test_without_a_key_a_service_refuses_naming_the_three_ways():
    with pytest.raises(ClusterKeyError) as e:
        security_from_args(_args(), "dpserve-engine", environ={})
    for way in ("dpserve-engine", CLUSTER_KEY_ENV, "--cluster-key-file", "--insecure-zmq"):
        assert way in str(e.value)


def test_the_key_comes_from_the_environment_the_file_or_is_made(tmp_path):
    assert security_from_args(_args(), "x", environ={CLUSTER_KEY_ENV: KEY}) == ZmqSecurity.from_cluster_key(KEY)
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    from_file = security_from_args(_args("--cluster-key-file", str(path)), "x", environ={CLUSTER_KEY_ENV: "y" * 40})
    assert from_file == ZmqSecurity.from_cluster_key(KEY)  # the flag wins over the environment
    made = security_from_args(_args(), "dpserve serve", environ={}, make_one=True)
    assert made.is_secure and made != security_from_args(_args(), "dpserve serve", environ={}, make_one=True)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_file_others_may_read_is_refused_naming_chmod_600(tmp_path, mode):
    path = tmp_path / "key"
    path.write_text(KEY)
    path.chmod(mode)
    with pytest.raises(ClusterKeyError, match=f"chmod 600 {path}"):
        security_from_args(_args("--cluster-key-file", str(path)), "x", environ={})


def test_a_missing_key_file_is_named(tmp_path):
    with pytest.raises(ClusterKeyError, match="--cluster-key-file .*/nope"):
        security_from_args(_args("--cluster-key-file", str(tmp_path / "nope")), "x", environ={})


def test_insecure_zmq_wins_over_the_environment_and_contradicts_a_key_file(tmp_path):
    insecure = security_from_args(_args("--insecure-zmq"), "x", environ={CLUSTER_KEY_ENV: KEY})
    assert not insecure.is_secure and insecure.child_argv() == ["--insecure-zmq"]
    with pytest.raises(ClusterKeyError, match="contradict"):
        security_from_args(_args("--insecure-zmq", "--cluster-key-file", str(tmp_path)), "x", environ={})


def test_children_get_the_key_in_their_environment_only():
    secure = ZmqSecurity.from_cluster_key(KEY)
    assert secure.child_env({"PATH": "/bin"}) == {"PATH": "/bin", CLUSTER_KEY_ENV: KEY}
    assert secure.child_argv() == []
    # An insecure deployment's children get no key, even one inherited from the parent's environment.
    assert ZmqSecurity.insecure().child_env({CLUSTER_KEY_ENV: KEY, "PATH": "/bin"}) == {"PATH": "/bin"}


def test_the_settings_default_follows_the_environment(monkeypatch):
    monkeypatch.setenv(CLUSTER_KEY_ENV, KEY)
    assert ZmqSecurity.from_environment() == ZmqSecurity.from_cluster_key(KEY)
    monkeypatch.delenv(CLUSTER_KEY_ENV)
    assert not ZmqSecurity.from_environment().is_secure


def _zap(domain: bytes, mechanism: bytes, *credentials: bytes) -> list[bytes]:
    return zap_reply([b"1.0", b"7", domain, b"10.0.0.9", b"", mechanism, *credentials])


def test_zap_admits_only_the_domains_own_public_key():
    mine = ZmqSecurity.from_cluster_key(KEY)
    other = ZmqSecurity.from_cluster_key(new_cluster_key())
    assert _zap(mine.public_key, b"CURVE", z85.decode(mine.public_key))[2] == b"200"
    assert _zap(mine.public_key, b"CURVE", z85.decode(other.public_key))[2] == b"400"
    assert _zap(mine.public_key, b"NULL")[2] == b"400"
    assert _zap(mine.public_key, b"PLAIN", b"user", b"pass")[2] == b"400"
    assert _zap(mine.public_key, b"CURVE", z85.decode(mine.public_key))[:2] == [b"1.0", b"7"]


def test_refusals_are_logged_once_per_peer_and_rate_limited(caplog):
    now = [0.0]
    refusals = RefusalLog(logging.getLogger("test.refusals"), max_lines=2, window_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.refusals"):
        assert refusals.refused("control socket", "10.0.0.1", "no CURVE")
        assert not refusals.refused("control socket", "10.0.0.1", "no CURVE")  # the same peer again
        assert refusals.refused("engine socket", "10.0.0.2", "another key")
        assert not refusals.refused("control socket", "10.0.0.3", "no CURVE")  # over the limit this minute
        now[0] = 61.0
        assert refusals.refused("control socket", "10.0.0.4", "no CURVE")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "from 10.0.0.1: no CURVE" in lines[0] and "engine socket from 10.0.0.2" in lines[1]
    assert "(2 earlier refusals not logged)" in lines[2]
    assert refusals.num_refused == 5 and refusals.num_unlogged == 2


def test_new_keys_are_random_hex():
    key = new_cluster_key()
    assert len(key) == 64 and int(key, 16) >= 0 and key != new_cluster_key()
    assert os.environ.get(CLUSTER_KEY_ENV), "tests/conftest.py gives the session a key"
