"""Half-open gRPC calls over raw HTTP/2: a call's HEADERS frame, and never its message.

What a hostile client on the network sends to hold a server's call slots (issue 18.5). Frames
are written by hand (RFC 9113 framing, RFC 7541 literal header fields), so the test needs no
HTTP/2 library; a reader thread per connection acknowledges the server's SETTINGS and PINGs
(as a live client does, so the connection is not dropped for that) and records which streams
the server ended (RST_STREAM, or trailers with END_STREAM)."""

from __future__ import annotations

import socket
import struct
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def _string(s: bytes) -> bytes:
    assert len(s) < 127  # one-byte length prefix, no Huffman coding
    return bytes([len(s)]) + s


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """Each header as a literal field without indexing, new name (RFC 7541 6.2.2)."""
    return b"".join(b"\x00" + _string(k.encode()) + _string(v.encode()) for k, v in headers)


class HalfOpenCalls:
    """``connections`` connections from ``source`` to ``port``, each opening ``per_connection``
    calls of ``path`` that send their headers and nothing more."""

    def __init__(
        self,
        port: int,
        path: str,
        *,
        connections: int,
        per_connection: int,
        source: str = "127.0.0.2",
        token: str | None = None,
    ) -> None:
        self.ended: set[tuple[int, int]] = set()  # (connection, stream) the server ended
        self.goaway = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        if token is not None:
            headers.append(("authorization", f"Bearer {token}"))
        block = header_block(headers)
        for c in range(connections):
            sock = socket.socket()
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
            self._socks.append(sock)
            thread = threading.Thread(target=self._read, args=(c, sock), daemon=True)
            thread.start()
            self._threads.append(thread)
            calls = b"".join(
                frame(HEADERS, END_HEADERS, 2 * i + 1, block) for i in range(per_connection)
            )
            sock.sendall(calls)
        self.opened = connections * per_connection

    def _read(self, c: int, sock: socket.socket) -> None:
        buf = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 9:
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind, flags = buf[3], buf[4]
                stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9 : 9 + length], buf[9 + length :]
                try:
                    if kind == SETTINGS and not flags & ACK:
                        sock.sendall(frame(SETTINGS, ACK, 0))
                    elif kind == PING and not flags & ACK:
                        sock.sendall(frame(PING, ACK, 0, payload))
                except OSError:
                    return
                with self._lock:
                    if kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM):
                        self.ended.add((c, stream))
                    elif kind == GOAWAY:
                        self.goaway += 1

    def ended_count(self) -> int:
        with self._lock:
            return len(self.ended)

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        for thread in self._threads:
            thread.join(2)


class RawCall:
    """Whole unary gRPC calls over one raw HTTP/2 connection from ``source``: a second client
    on this machine with an address of its own (a gRPC client here cannot pick its source
    address). Calls run one at a time; ``call`` returns the response message (b"" when the
    call ended without one)."""

    FRAME_MAX = 16384  # the smallest SETTINGS_MAX_FRAME_SIZE a server may announce

    def __init__(self, port: int, source: str = "127.0.0.2") -> None:
        self._port = port
        self._sock = socket.socket()
        self._sock.bind((source, 0))
        self._sock.connect(("127.0.0.1", port))
        self._sock.settimeout(10)
        self._buf = b""
        self._stream = -1
        self._sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def _frame(self) -> tuple[int, int, int, bytes]:
        while True:
            if len(self._buf) >= 9:
                length = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) >= 9 + length:
                    head, self._buf = self._buf[: 9 + length], self._buf[9 + length :]
                    stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                    return head[3], head[4], stream, head[9:]
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self._buf += chunk

    def call(self, path: str, message: bytes) -> bytes:
        self._stream += 2
        s = self._stream
        block = header_block(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", f"127.0.0.1:{self._port}"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )
        body = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC length prefix
        out = [frame(HEADERS, END_HEADERS, s, block)]
        for i in range(0, len(body), self.FRAME_MAX):
            last = i + self.FRAME_MAX >= len(body)
            out.append(frame(DATA, END_STREAM if last else 0, s, body[i : i + self.FRAME_MAX]))
        self._sock.sendall(b"".join(out))
        reply = b""
        while True:
            kind, flags, stream, payload = self._frame()
            if kind == SETTINGS and not flags & ACK:
                self._sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self._sock.sendall(frame(PING, ACK, 0, payload))
            elif stream == s and kind == DATA:
                reply += payload
                if payload:  # give the window back, so that long replies keep coming
                    update = struct.pack(">I", len(payload))
                    self._sock.sendall(frame(0x8, 0, 0, update) + frame(0x8, 0, s, update))
            if stream == s and (kind == RST_STREAM or flags & END_STREAM):
                return reply[5:]

    def close(self) -> None:
        self._sock.close()
