"""A TCP forwarder on 127.0.0.1 that tests can cut and restore (a store outage, seen from the client), or hold
(a hung server: connections stay open, and no byte gets through until release)."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int):
        self.target_port = target_port
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
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
