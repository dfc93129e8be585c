"""Test hosts on one machine: Linux network namespaces joined by a bridge.

Each host is a namespace `<prefix>-hN` with one veth into a switch namespace `<prefix>-sw` that holds the bridge,
so nothing is added to the root namespace and every address lives only inside namespaces this test created.
Addresses come from 198.18.0.0/15, the range reserved for network benchmark tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid

SUBNET = "198.18.{net}.{host}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def can_create_namespaces() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"dpns-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', b'').decode(errors='replace').strip() or e}"
    _ip("netns", "del", name)
    return None


class Hosts:
    def __init__(self, num_hosts: int, net: int = 0):
        self.prefix = f"dp{uuid.uuid4().hex[:5]}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-h{i}" for i in range(num_hosts)]
        self.ips = [SUBNET.format(net=net, host=i + 1) for i in range(num_hosts)]

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, ip) in enumerate(zip(self.names, self.ips)):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            # Create the pair inside the host namespace, then move the peer into the switch.
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
            _ip("-n", name, "link", "set", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")

    def stop_processes(self, grace_s: float = 10.0) -> list[int]:
        """SIGTERM every process inside the host namespaces (`ip netns pids`), SIGKILL what is left after
        `grace_s`; returns the pids that had to be killed. Only these namespaces' processes: `ray stop` would
        also stop every other Ray instance on the machine (another test worker's)."""
        import os
        import signal
        import time

        def pids() -> set[int]:
            found = set()
            for name in self.names:
                out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
                found.update(int(p) for p in out.stdout.split() if p.isdigit())
            return found

        def signal_all(targets, sig) -> None:
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

        signal_all(pids(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while (left := pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_all(left, signal.SIGKILL)
        return sorted(left)

    def destroy(self) -> None:
        for name in [*self.names, self.switch]:
            # Deleting a namespace does not kill processes in it; callers stop theirs first.
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    def cmd(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]


@contextlib.contextmanager
def hosts(num_hosts: int):
    h = Hosts(num_hosts)
    try:
        h.create()
        yield h
    finally:
        h.destroy()
