"""A real two-node Slurm cluster on this machine, for the Slurm backend's tests.

``SlurmTestCluster.start()`` brings up:

- a bridge in this network namespace holding the controller's address, and one
  network namespace per node joined to it by a veth pair (``eth0`` inside), so
  each node has an address of its own in a private subnet;
- ``munged`` with a fresh key (socket, key, pid, log under the temp dir);
- ``slurmctld``, and one ``slurmd`` per node, each in its own network, UTS
  (hostname) and mount namespace; a private ``/etc/hosts`` is bind-mounted
  there so the node names resolve to the nodes' addresses;
- a generated ``slurm.conf`` (private ports; state, spool, pid and log files
  under the temp dir; ``proctrack/linuxproc``; ``select/cons_tres``).

Commands on this side (``sbatch``, ``squeue``, ``scancel``) reach the
controller through ``SLURM_CONF``. ``stop()`` kills every daemon and every
process left in the nodes' namespaces, then removes namespaces and bridge.
``start()`` first records what it will make in ``/run/smsdp-slurm/<tag>.json`` (with this
process's PID), and ``remove_stale()``, called by every ``start()``, removes what a session
killed before its ``stop()`` (SIGKILL, a CI timeout) left behind: its daemons, the processes
in its namespaces, the namespaces, the bridge and the temp dir.
Needs root and Debian's ``slurm-wlm`` and ``munge`` (``scripts/bootstrap``
installs them when the test extras are requested).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.proc_scan import live_pids

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "srun")
SUBNET = "10.213.{net}"
CONTROLLER = "smsdpctl"
PARTITION = "smsdp"
START_TIMEOUT_S = 60.0
STATE_DIR = Path("/run/smsdp-slurm")


class NamespacesUnavailable(RuntimeError):
    """This machine does not let us make a bridge, veth pairs or network namespaces."""


def missing_reason() -> str | None:
    """Why a test cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, munged, slurmd)"
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing:
        return (
            f"Slurm is not installed (missing {', '.join(missing)}): run `bash scripts/bootstrap dev` "
            "as root, which installs Debian's slurm-wlm and munge"
        )
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the Slurm test cluster needs `ip` (iproute2) and `unshare` (util-linux)"
    return None


def _run(*argv: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    if netns is not None:
        argv = ("ip", "netns", "exec", netns, *argv)
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unused_net() -> int:
    """A third octet for ``SUBNET`` that no address in this network namespace uses yet.

    The controller's address sits on a bridge in this (the root) namespace: a second cluster
    on the same /24 (a test's own cluster beside the session's) would add a second route to
    it, and the replies to its nodes would leave by the first cluster's bridge, so its
    slurmd could never register."""
    shown = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
    prefix = SUBNET.format(net="")
    used = {int(word[len(prefix) :].split(".")[0]) for word in shown.split() if word.startswith(prefix)}
    free = [net for net in range(100, 200) if net not in used]
    if not free:
        raise NamespacesUnavailable(f"every {SUBNET.format(net='N')}.0/24 for N in 100..199 is in use")
    return secrets.choice(free)


@dataclass
class Node:
    name: str
    address: str
    netns: str
    host_if: str
    process: subprocess.Popen | None = None


@dataclass
class SlurmTestCluster:
    nodes_count: int = 2
    cpus_per_node: int = field(default_factory=lambda: os.cpu_count() or 1)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="smsdp-slurm-")))
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: list[Node] = field(default_factory=list)
    daemons: list[subprocess.Popen] = field(default_factory=list)
    started_s: float | None = None

    def __post_init__(self) -> None:
        net = SUBNET.format(net=_unused_net())
        self.bridge = f"smsdpb{self.tag}"
        self.controller_address = f"{net}.1"
        self.nodes = [
            Node(f"node{i + 1}", f"{net}.{11 + i}", f"smsdp{self.tag}n{i + 1}", f"smsdp{self.tag}h{i + 1}")
            for i in range(self.nodes_count)
        ]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge.sock"

    # ---------------------------------------------------------------- start

    @property
    def env(self) -> dict[str, str]:
        """What a client needs in its environment to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmTestCluster:
        began = time.monotonic()
        remove_stale()
        self._record()
        try:
            self._network()
            self._write_files()
            self._munged()
            self.daemons.append(
                self._in_namespace(
                    None, CONTROLLER, ["slurmctld", "-D", "-i", "-f", str(self.conf)], self.root / "slurmctld.out"
                )
            )
            for node in self.nodes:
                self.start_slurmd(node.name)
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - began
        return self

    def _record(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        record = {
            "pid": os.getpid(),
            "root": str(self.root),
            "bridge": self.bridge,
            "netns": [node.netns for node in self.nodes],
        }
        (STATE_DIR / f"{self.tag}.json").write_text(json.dumps(record))

    def _network(self) -> None:
        try:
            self._make_network()
        except subprocess.CalledProcessError as exc:
            raise NamespacesUnavailable(f"`{' '.join(exc.cmd)}` failed: {(exc.stderr or '').strip()}") from None

    def _make_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            _run("ip", "netns", "add", node.netns)
            _run("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _run("ip", "link", "set", node.host_if, "master", self.bridge)
            _run("ip", "link", "set", node.host_if, "up")
            _run("ip", "addr", "add", f"{node.address}/24", "dev", "eth0", netns=node.netns)
            _run("ip", "link", "set", "eth0", "up", netns=node.netns)
            _run("ip", "link", "set", "lo", "up", netns=node.netns)

    def _write_files(self) -> None:
        for sub in ("state", "spool", "log", *(f"spool/{node.name}" for node in self.nodes)):
            (self.root / sub).mkdir(exist_ok=True)
        hosts = ["127.0.0.1 localhost", f"{self.controller_address} {CONTROLLER}"]
        hosts += [f"{node.address} {node.name}" for node in self.nodes]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")
        self.conf.write_text(self._slurm_conf())

    def _slurm_conf(self) -> str:
        r = self.root
        node_names = ",".join(node.name for node in self.nodes)
        lines = [
            "ClusterName=smsdptest",
            f"SlurmctldHost={CONTROLLER}({self.controller_address})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            # A node whose slurmd stops is declared DOWN (and its jobs NODE_FAIL) within seconds.
            "SlurmdTimeout=6",
            "KillWait=15",
            "MinJobAge=600",
            "MessageTimeout=5",
            "InactiveLimit=0",
            "SlurmctldTimeout=10",
        ]
        lines += [
            f"NodeName={node.name} NodeAddr={node.address} CPUs={self.cpus_per_node} State=UNKNOWN"
            for node in self.nodes
        ]
        lines.append(f"PartitionName={PARTITION} Nodes={node_names} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _munged(self) -> None:
        key = self.root / "munge.key"
        _run("mungekey", "--create", "--keyfile", str(key))
        os.chmod(key, 0o600)
        _run(
            "munged",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.root}/munged.pid",
            f"--seed-file={self.root}/munged.seed",
            f"--log-file={self.root}/log/munged.log",
        )

    def _in_namespace(self, netns: str | None, hostname: str, argv: list[str], out: Path) -> subprocess.Popen:
        """``argv`` with its own hostname and /etc/hosts (and network namespace ``netns``)."""
        script = f'mount --bind {self.root}/hosts /etc/hosts && hostname {hostname} && exec "$@"'
        full = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
        if netns is not None:
            # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup file system slurmd reads.
            full = ["nsenter", f"--net=/run/netns/{netns}", *full]
        with open(out, "ab") as log:
            return subprocess.Popen(
                full,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )

    def queue(self) -> str:
        """``squeue``'s view of every job this cluster knows (id, state, nodes, reason), for messages."""
        result = subprocess.run(
            ["squeue", "-h", "-o", "%i %j %T %N %r"],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=30,
        )
        return (result.stdout + result.stderr).strip()

    def wait_free(self, timeout: float = 180.0) -> None:
        """Until no job holds a node: a job Slurm still counts as running or completing after a test
        (a controller restarted while its steps ended retries their completion for minutes) would
        keep the next test's job queued."""
        deadline = time.monotonic() + timeout
        while self.queue() and time.monotonic() < deadline:
            time.sleep(0.5)
        if self.queue():
            raise AssertionError(f"the Slurm test cluster is still busy after {timeout:.0f} s:\n{self.queue()}")
        self._wait_idle(timeout=max(10.0, deadline - time.monotonic()))

    def _wait_idle(self, wanted: tuple[str, ...] = ("idle",), timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for daemon in [*self.daemons, *(node.process for node in self.nodes)]:
                if daemon is not None and daemon.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({daemon.args[-5:]}):\n{self._logs_tail()}")
            result = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                capture_output=True,
                text=True,
                env={**os.environ, **self.env},
                timeout=30,
            )
            states = result.stdout.strip()
            if result.returncode == 0 and states and all(line.split()[1] in wanted for line in states.splitlines()):
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"the Slurm nodes did not come up idle in {timeout:.0f} s: {states!r}; \n{self._logs_tail()}"
        )

    def _logs_tail(self, lines: int = 15) -> str:
        """The end of every daemon log (the temp dir is removed on failure: say it here)."""
        parts = []
        for path in sorted([*self.root.glob("*.out"), *(self.root / "log").glob("*.log")]):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # ---------------------------------------------------------------- faults

    def stop_slurmd(self, node_name: str) -> None:
        """Stop one node's slurmd (SIGKILL: a crashed daemon); the node's jobs are left alone."""
        node = self.node(node_name)
        if node.process is not None:
            os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(timeout=10)

    def start_slurmd(self, node_name: str) -> None:
        node = self.node(node_name)
        node.process = self._in_namespace(
            node.netns,
            node.name,
            ["slurmd", "-D", "-N", node.name, "-f", str(self.conf)],
            self.root / f"slurmd-{node.name}.out",
        )

    def stop_controller(self) -> None:
        """Stop slurmctld (SIGKILL: a crashed controller); the nodes and their jobs are left alone."""
        controller = self.daemons[0]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(controller.pid, signal.SIGKILL)
        controller.wait(timeout=10)

    def start_controller(self) -> None:
        """slurmctld again, recovering its state (not ``-i``); returns once every node answers it again."""
        self.daemons[0] = self._in_namespace(
            None, CONTROLLER, ["slurmctld", "-D", "-f", str(self.conf)], self.root / "slurmctld.out"
        )
        self._wait_idle(wanted=("idle", "mix", "alloc", "comp"))

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """Kill everything this cluster started (and anything left in its namespaces), remove it all."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                _kill_group(node.process)
            for pid in _netns_pids(node.netns):
                _kill_pid(pid)
        for daemon in self.daemons:
            if daemon.poll() is None:
                _kill_group(daemon)
        pid_file = self.root / "munged.pid"
        if pid_file.is_file():
            _kill_pid(int(pid_file.read_text().strip() or 0))
        for node in self.nodes:
            _run("ip", "netns", "del", node.netns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        (STATE_DIR / f"{self.tag}.json").unlink(missing_ok=True)


def remove_stale() -> list[str]:
    """Remove what clusters of sessions that are gone left behind (by their records); their tags."""
    removed: list[str] = []
    if not STATE_DIR.is_dir():
        return removed
    for path in sorted(STATE_DIR.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{int(record.get('pid', 0))}").exists():  # its session still runs
            continue
        for pid in processes_mentioning(record["root"]):  # slurmctld, slurmd, munged: their files are there
            _kill_pid(pid)
        for netns in record["netns"]:
            for pid in _netns_pids(netns):
                _kill_pid(pid)
            _run("ip", "netns", "del", netns, check=False)
        _run("ip", "link", "del", record["bridge"], check=False)
        shutil.rmtree(record["root"], ignore_errors=True)
        path.unlink(missing_ok=True)
        removed.append(path.stem)
    return removed


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    return live_pids(text.encode(), "cmdline")


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _kill_pid(pid: int) -> None:
    if pid <= 1:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _netns_pids(netns: str) -> list[int]:
    result = _run("ip", "netns", "pids", netns, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]
