"""Hosts as network namespaces on this machine, each joined to a bridge by a shaped link.

``NamespacedHosts(count).start()`` makes, as root:

- a bridge ``smnb<tag>`` in this (the root) network namespace, with no address: it only
  switches frames between the hosts' links;
- per host ``i``: a network namespace ``smn<tag>h<i>`` with ``lo`` up and one end of a veth
  pair, ``eth0``, at ``10.214.<net>.<11+i>/24`` (MTU 9000); the other end, ``smn<tag>v<i>``,
  is a port of the bridge. ``eth0`` is the host's only way out: what a host sends to
  another crosses its ``eth0`` and then the other host's veth, what its own processes send
  each other stays on its loopback;
- ``shape(rate)``: a ``tbf`` qdisc (token bucket: rate, burst, queue latency) on both ends
  of every host's veth pair, so the host's link is ``rate`` each way. This kernel has ``tbf``
  but no ``netem`` (``tc qdisc add ... netem`` fails with "Specified qdisc kind is
  unknown"), so no latency is added: ``netem_available()`` says whether it is there.

``spawn(i, argv)`` starts a process inside host ``i`` (``ip netns exec``), in a session of
its own. ``link_bytes(i)`` reads ``tx_bytes``/``rx_bytes`` of host ``i``'s ``eth0`` from
inside its namespace: every byte of every frame that left or entered the host, Ethernet,
IP and TCP headers included (see ``docs/runtime.md``, "Bytes on a host's link").

``stop()`` removes everything this object made, by PID and by name, and is safe to call
twice: the process groups it spawned, then every process still inside its namespaces
(``ip netns pids``), then the namespaces (which take their veth pairs with them) and the
bridge. ``start()`` records the tag and this process's PID in ``/run/smsdp-netns/<tag>``;
``remove_stale()`` removes what an earlier run whose process is gone (killed, crashed)
left behind, by those recorded names only. Use it as a context manager, or call
``stop()`` in a ``finally``; ``install_signal_handlers`` turns SIGINT/SIGTERM into an
exception so that the ``finally`` runs on Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path("/run/smsdp-netns")
SUBNET = "10.214.{net}"
MTU = 9000
INNER_IF = "eth0"
# A token bucket must hold at least one frame, and at a few Gbit/s enough to keep the link busy
# between the kernel's timer ticks: 256 KiB is both (about 1 ms at 2 Gbit/s).
BURST = "256kb"
QUEUE_LATENCY = "200ms"


class NamespacesUnavailable(RuntimeError):
    """This machine does not let us make a bridge, veth pairs, network namespaces or tbf qdiscs."""


def missing_reason() -> str | None:
    """Why namespaced hosts cannot be made here, or None (checked without making anything)."""
    if os.geteuid() != 0:
        return "namespaced hosts need root (ip netns add, veth pairs, tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"namespaced hosts need `{tool}` (iproute2)"
    return None


def _run(*argv: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    if netns is not None:
        argv = ("ip", "netns", "exec", netns, *argv)
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    index: int
    netns: str
    address: str
    root_if: str  # the bridge's end of this host's veth pair


@dataclass
class NamespacedHosts:
    count: int
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    rate: str | None = None
    started: bool = False

    def __post_init__(self) -> None:
        net = SUBNET.format(net=int(self.tag, 16) % 250 + 1)
        self.bridge = f"smnb{self.tag}"
        self.hosts = [Host(i, f"smn{self.tag}h{i}", f"{net}.{11 + i}", f"smn{self.tag}v{i}") for i in range(self.count)]

    # ------------------------------------------------------------------ start / stop

    def start(self) -> NamespacedHosts:
        reason = missing_reason()
        if reason:
            raise NamespacesUnavailable(reason)
        self._record()
        self.started = True
        try:
            self._make()
        except subprocess.CalledProcessError as exc:
            self.stop()
            raise NamespacesUnavailable(f"`{' '.join(exc.cmd)}` failed: {(exc.stderr or '').strip()}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> NamespacedHosts:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _record(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "bridge": self.bridge, "netns": [h.netns for h in self.hosts]}
        (STATE_DIR / self.tag).write_text(json.dumps(record))

    def _make(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "mtu", str(MTU))
        _run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.netns)
            # The peer is made inside the namespace: this namespace may have an eth0 of its own.
            _run(
                "ip", "link", "add", host.root_if, "mtu", str(MTU),
                "type", "veth", "peer", "name", INNER_IF, "mtu", str(MTU), "netns", host.netns,
            )  # fmt: skip
            _run("ip", "link", "set", host.root_if, "master", self.bridge)
            _run("ip", "link", "set", host.root_if, "up")
            _run("ip", "addr", "add", f"{host.address}/24", "dev", INNER_IF, netns=host.netns)
            _run("ip", "link", "set", INNER_IF, "mtu", str(MTU), "up", netns=host.netns)
            _run("ip", "link", "set", "lo", "up", netns=host.netns)
            # No IPv6 on the link: its router solicitations would add stray bytes to the counters.
            _run("sysctl", "-qw", f"net.ipv6.conf.{INNER_IF}.disable_ipv6=1", check=False, netns=host.netns)

    def stop(self) -> None:
        """Kill what was spawned and whatever is left in the namespaces, then remove them and the bridge."""
        if not self.started:
            return
        # A second Ctrl-C must not cut the cleanup short: it is noted, and raised once everything is removed.
        with _signals_deferred():
            for process in self.processes:
                kill_group(process)
            for host in self.hosts:
                for pid in netns_pids(host.netns):
                    _kill_pid(pid)
            for host in self.hosts:
                _run("ip", "netns", "del", host.netns, check=False)
                _run("ip", "link", "del", host.root_if, check=False)  # normally gone with its namespace already
            _run("ip", "link", "del", self.bridge, check=False)
            with contextlib.suppress(FileNotFoundError):
                (STATE_DIR / self.tag).unlink()
            self.started = False

    # ------------------------------------------------------------------ links

    def shape(self, rate: str | None) -> None:
        """``rate`` (tc syntax: "2gbit", "500mbit") on both ends of every host's link; None: unshaped."""
        for host in self.hosts:
            self.shape_host(host.index, rate)
        self.rate = rate

    def shape_host(self, index: int, rate: str | None) -> None:
        """``rate`` on both ends of host ``index``'s link (what it sends, and what is sent to it)."""
        host = self.hosts[index]
        for netns, dev in ((host.netns, INNER_IF), (None, host.root_if)):
            if rate is None:
                _run("tc", "qdisc", "del", "dev", dev, "root", check=False, netns=netns)
            else:
                _run(
                    "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", BURST, "latency", QUEUE_LATENCY, netns=netns,
                )  # fmt: skip

    def link_bytes(self, index: int) -> tuple[int, int]:
        """(tx, rx) bytes of host ``index``'s ``eth0``, read inside its namespace."""
        out = _run(
            "cat",
            f"/sys/class/net/{INNER_IF}/statistics/tx_bytes",
            f"/sys/class/net/{INNER_IF}/statistics/rx_bytes",
            netns=self.hosts[index].netns,
        ).stdout.split()
        return int(out[0]), int(out[1])

    # ------------------------------------------------------------------ processes

    def spawn(self, index: int, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """``argv`` inside host ``index``, in a new session (so that stop() can kill its whole group)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[index].netns, *argv],
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            **kwargs,
        )
        self.processes.append(process)
        return process

    def run(self, index: int, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[index].netns, *argv], capture_output=True, text=True, timeout=timeout
        )


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (added latency); tried on a throwaway dummy link."""
    if missing_reason():
        return False
    name = f"smnq{secrets.token_hex(2)}"
    try:
        if _run("ip", "link", "add", name, "type", "dummy", check=False).returncode:
            return False
        return _run("tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "link", "del", name, check=False)


def remove_stale() -> list[str]:
    """Remove the namespaces and bridges of earlier runs whose recording process is gone."""
    removed: list[str] = []
    if not STATE_DIR.is_dir():
        return removed
    for path in STATE_DIR.iterdir():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(record.get("pid", 0))):
            continue
        for netns in record.get("netns", []):
            for pid in netns_pids(netns):
                _kill_pid(pid)
            _run("ip", "netns", "del", netns, check=False)
        _run("ip", "link", "del", record.get("bridge", ""), check=False)
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM during the block are noted, not raised; the first is raised after it.
    (Blocking them with a signal mask would not do: Python runs its handlers in the main thread
    whichever thread the kernel delivers a signal to.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    if caught:
        raise KeyboardInterrupt(f"signal {caught[0]}")


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so that ``finally`` blocks (stop()) run. Once one
    has, later ones are ignored: a second Ctrl-C must not cut that cleanup short."""

    def already_stopping(signum, frame):
        pass

    def interrupt(signum, frame):
        signal.signal(signal.SIGINT, already_stopping)
        signal.signal(signal.SIGTERM, already_stopping)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def netns_pids(netns: str) -> list[int]:
    result = _run("ip", "netns", "pids", netns, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _kill_pid(pid: int) -> None:
    if pid <= 1 or pid == os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def wait_all(processes: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process until ``timeout`` s in all; None for those still running."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes
