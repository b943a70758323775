"""A TCP proxy on 127.0.0.1 in front of the S3 server that breaks connections on demand.

It forwards bytes both ways and, when told, resets a connection mid-response, delays a
response, answers with 503, refuses connections for a while (a server restart, as clients see
it), swallows connections without answering (a network that stays down), or holds requests
that match a predicate until released. It logs each request line and Range header, so tests
can check that a broken download resumed with a ranged GET.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
import time
from typing import Callable

_REQUEST = re.compile(rb"^(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.1\r\n", re.M)
_RANGE = re.compile(rb"\r\n[Rr]ange: bytes=(\d+)-")


def _reset(sock: socket.socket) -> None:
    """Close with RST, not FIN: what a dying peer or a middlebox looks like."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def _peer_closed(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.live: set[socket.socket] = set()
        self.requests: list[tuple[str, str, int | None]] = []  # (method, path, range start)
        self.response_bytes = 0
        self.cut_after: int | None = None  # reset the next response stream after this many bytes
        self.cut_request_after: int | None = None  # reset the next request stream after this many bytes
        self.cuts = 0
        self.delay_once: float = 0.0  # hold the next response this long
        self.fail_next = 0  # answer the next N new connections' requests with 503
        self.down_until = 0.0  # reset every new connection until this time
        self.blackhole = False  # accept and never answer
        self.hold: Callable[[str, str], bool] | None = None  # hold matching requests
        self.held = threading.Event()  # set once a request is being held
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    # -- controls ------------------------------------------------------------------------------

    def reset_all(self) -> None:
        with self.lock:
            socks = list(self.live)
            self.live.clear()
        for s in socks:
            _reset(s)

    def restart(self, seconds: float) -> None:
        """The endpoint disappears for `seconds`: live connections die, new ones are refused."""
        self.down_until = time.time() + seconds
        self.reset_all()

    def fail(self, n: int) -> None:
        self.fail_next = n
        self.reset_all()  # keep-alive connections would bypass it

    def release(self) -> None:
        self.hold = None

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.reset_all()

    # -- plumbing ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if time.time() < self.down_until:
            _reset(client)
            return
        if self.blackhole:
            self.live.add(client)
            return  # never answered; the client's read timeout has to fire
        if self.fail_next > 0:
            self.fail_next -= 1
            client.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                body = b"<?xml version='1.0'?><Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            client.close()
            return
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            _reset(client)
            return
        with self.lock:
            self.live.update((client, server))
        threading.Thread(target=self._pump_requests, args=(client, server), daemon=True).start()
        self._pump_responses(server, client)

    def _pump_requests(self, client: socket.socket, server: socket.socket) -> None:
        sent = 0
        try:
            while chunk := client.recv(1 << 16):
                limit = self.cut_request_after
                if limit is not None and sent + len(chunk) > limit:
                    self.cut_request_after = None
                    self.cuts += 1
                    _reset(client)
                    _reset(server)
                    return
                sent += len(chunk)
                for m in _REQUEST.finditer(chunk):
                    method, path = m.group(1).decode(), m.group(2).decode()
                    rng = _RANGE.search(chunk, m.end())
                    self.requests.append((method, path, int(rng.group(1)) if rng else None))
                    while self.hold is not None and self.hold(method, path) and not self._closed:
                        self.held.set()
                        if _peer_closed(client):
                            # The sender died while held: the request never reaches the server.
                            _reset(server)
                            return
                        time.sleep(0.05)
                server.sendall(chunk)
        except OSError:
            pass
        finally:
            _reset(server)

    def _pump_responses(self, server: socket.socket, client: socket.socket) -> None:
        sent = 0
        try:
            while chunk := server.recv(1 << 16):
                if self.delay_once:
                    delay, self.delay_once = self.delay_once, 0.0
                    time.sleep(delay)
                limit = self.cut_after
                if limit is not None and sent + len(chunk) > limit:
                    self.cut_after = None
                    self.cuts += 1
                    client.sendall(chunk[: max(0, limit - sent)])
                    _reset(client)
                    _reset(server)
                    return
                client.sendall(chunk)
                sent += len(chunk)
                self.response_bytes += len(chunk)
        except OSError:
            pass
        finally:
            _reset(client)
