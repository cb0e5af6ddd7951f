"""A TCP forwarder on 127.0.0.1 that tests can cut and restore (a store outage, seen from the client), or hold
(a hung server: connections stay open, and no byte gets through until release).

The target is a port on 127.0.0.1 or a unix socket. Run as a script, it listens on a unix socket and forwards
to HOST:PORT, in whatever network namespace it was started in (tests/hosts.py: the way from this machine's
127.0.0.1 to a server inside a simulated host, through a socket file both namespaces see):

    python tests/tcp_proxy.py --unix /path/to/sock 10.213.0.2:5000
"""

from __future__ import annotations

import argparse
import os
import socket
import threading


class TcpProxy:
    def __init__(self, target: int | str):
        self.target = target  # a port on 127.0.0.1, or a unix socket's path
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.flowing = threading.Event()  # cleared by hold(): the pumps keep what they read until release()
        self.flowing.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (mid-request included)."""
        with self.lock:
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns.clear()

    def hold(self) -> None:
        """Stall every connection, open and new: requests hang without an error, as with a hung server."""
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return
            try:
                upstream = _connect(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        _pump(src, dst, self.flowing)


def _connect(target: int | str | tuple[str, int]) -> socket.socket:
    if isinstance(target, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(target)
        except OSError:
            sock.close()
            raise
        return sock
    return socket.create_connection(("127.0.0.1", target) if isinstance(target, int) else target)


def _pump(src: socket.socket, dst: socket.socket, flowing: threading.Event | None = None) -> None:
    try:
        while data := src.recv(1 << 20):
            if flowing is not None:
                flowing.wait()
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve_unix(path: str, host: str, port: int) -> None:
    """Accept on the unix socket `path`, forward each connection to host:port; until killed."""
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    while True:
        client, _ = listener.accept()
        try:
            upstream = _connect((host, port))
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="forward a unix socket to HOST:PORT")
    p.add_argument("--unix", required=True, help="the unix socket to listen on")
    p.add_argument("target", help="HOST:PORT")
    args = p.parse_args()
    host, _, port = args.target.rpartition(":")
    serve_unix(args.unix, host, int(port))
