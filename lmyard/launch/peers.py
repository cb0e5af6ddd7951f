"""Which node of a stalled multi-node job cannot reach the others: the watchdog's line names the host.

When every rank stops at once (a collective waits on a peer whose link is down), the heartbeats alone cannot
say which host is at fault: every rank waits. The launcher then asks each node, through its own engine (a path
that does not cross the training network), to open a TCP connection to node 0's rendezvous, the c10d store
that node 0's torchrun keeps listening for the whole job: a node that cannot is named with its host and address.

    unreachable([Peer(0, "host-a", "10.0.0.2", probe_a), Peer(1, "host-b", "10.0.0.3", probe_b)], "10.0.0.2:29400")
    -> ("node 1 (host-b, 10.0.0.3) cannot reach node 0's rendezvous at 10.0.0.2:29400 (timed out)", [1])

The nodes named are the lost ones of an elastic run (lmyard.launch.elastic): it goes on without them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PROBE_S = 5  # how long one node tries to connect
# run on a node: exit 0 when host:port accepts a connection within PROBE_S, else the reason on stderr, exit 1
PROBE = (
    "import socket, sys\n"
    "try:\n"
    f"    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout={PROBE_S}).close()\n"
    "except OSError as e:\n"
    "    sys.exit(str(e) or type(e).__name__)\n"
)


@dataclass
class Peer:
    node: int
    host: str  # the host's name, as its engine reports it
    addr: str  # the address the node binds and advertises
    probe: Callable[[str, int], str | None]  # (host, port) -> why it cannot connect, None when it can


def unreachable(peers: list[Peer], endpoint: str) -> tuple[str, list[int]] | None:
    """The nodes other than node 0 that cannot connect to `endpoint` (node 0's rendezvous), in words and by index;
    None when every node can (or there is nothing to ask)."""
    host, _, port = endpoint.rpartition(":")
    others = [p for p in peers if p.node != 0]
    if not others or not port.isdigit():
        return None
    with ThreadPoolExecutor(len(others)) as pool:
        why = list(pool.map(lambda p: _ask(p, host, int(port)), others))
    failed = [f"node {p.node} ({p.host}, {p.addr})" for p, w in zip(others, why, strict=True) if w]
    if not failed:
        return None
    reasons = sorted({w for w in why if w})
    node0 = next((f" ({p.host}, {p.addr})" for p in peers if p.node == 0), "")
    lost = [p.node for p, w in zip(others, why, strict=True) if w]
    return (
        f"{', '.join(failed)} cannot reach node 0{node0}'s rendezvous at {endpoint} ({'; '.join(reasons)}): "
        "check that host's network link",
        lost,
    )


def _ask(peer: Peer, host: str, port: int) -> str | None:
    try:
        return peer.probe(host, port)
    except Exception:  # the node's engine does not answer either: no verdict about its network
        return None


def docker_probe(container) -> Callable[[str, int], str | None]:
    """A probe run inside `container` (`docker exec`; its image has Python) through its engine."""

    def probe(host: str, port: int) -> str | None:
        code, out = container.exec_run(["python", "-c", PROBE, host, str(port)])
        if code == 0:
            return None
        text = out.decode(errors="replace").strip().splitlines()
        return text[-1] if text else f"exit code {code}"

    return probe


def docker_unreachable(nodes: list, containers: list, clients: dict) -> tuple[str, list[int]] | None:
    """`unreachable` for a Docker job's nodes (lmyard.launch.docker_job.NodePlan), each asked through its engine;
    a host is named as its engine names itself."""
    peers, endpoint = [], None
    for node, container in zip(nodes, containers):
        command = node.kwargs["command"]
        endpoint = endpoint or _arg(command, "--rdzv_endpoint")
        try:
            host = clients[node.url].info()["Name"]
        except Exception:
            host = node.url
        peers.append(Peer(node.index, host, _arg(command, "--local_addr") or host, docker_probe(container)))
    return unreachable(peers, endpoint) if endpoint else None


def _arg(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command[:-1] else None
