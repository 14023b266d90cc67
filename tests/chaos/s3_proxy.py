"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 endpoint (moto's server).

Clients are pointed at ``proxy.endpoint``; every request is forwarded to the real endpoint unless
a fault rule takes it. Rules (each bounded by a number of faults, so no test can loop forever):

- ``throttle``: bursts of 503 SlowDown, as S3 answers when a prefix takes too many requests;
- ``reset_upload_parts``: the connection is reset (TCP RST) half-way through an UploadPart body;
- ``hold``: a request is held, not forwarded, until the test lets it go (then the connection is
  reset), so the test can kill the client at that exact point (before the commit marker);
- ``truncate_listing``: a ListObjectsV2 page for a prefix comes back cut short, its last keys
  missing and ``IsTruncated`` false, as an eventually consistent store can answer.

``proxy.injected`` counts the faults injected, by kind.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

HOLD_LIMIT_S = 120.0  # a held request is let go after this long even if the test never does
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "proxy-connection",
    "upgrade",
    "expect",
}
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Request:
    """What a rule sees of a request: method, bucket-relative key, query."""

    method: str
    key: str
    query: dict[str, list[str]]

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber" in self.query and "uploadId" in self.query

    @property
    def is_listing(self) -> bool:
        return self.method == "GET" and self.query.get("list-type") == ["2"]


@dataclass
class Rule:
    kind: str
    matches: Callable[[Request], bool]
    max_faults: int
    every: int = 1  # of each `every` matching requests ...
    burst: int = 1  # ... the first `burst` are faulted
    arg: object = None
    seen: int = 0
    faults: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, request: Request) -> bool:
        """Whether this rule faults ``request`` (counts it)."""
        if not self.matches(request):
            return False
        with self.lock:
            position, self.seen = self.seen % self.every, self.seen + 1
            if self.faults >= self.max_faults or position >= self.burst:
                return False
            self.faults += 1
            return True


class Hold:
    """A held request: ``reached`` is set when it arrives; ``release()`` resets its connection."""

    def __init__(self):
        self.reached, self.released = threading.Event(), threading.Event()

    def release(self) -> None:
        self.released.set()


class S3FaultProxy:
    """A threaded HTTP proxy to ``upstream`` that injects the faults its rules describe."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rules: list[Rule] = []
        self.injected: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> S3FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for rule in self.rules:
            if isinstance(rule.arg, Hold):
                rule.arg.release()
        self._server.shutdown()
        self._server.server_close()

    # -- rules -----------------------------------------------------------------------------
    def clear(self) -> None:
        for rule in self.rules:
            if isinstance(rule.arg, Hold):
                rule.arg.release()
        self.rules = []

    def throttle(self, every: int, burst: int, max_faults: int, writes_only: bool = False) -> None:
        """Of each ``every`` requests, answer the first ``burst`` with 503 SlowDown."""

        def matches(r: Request) -> bool:
            return not writes_only or r.method in ("PUT", "POST", "DELETE")

        self.rules.append(Rule("slowdown", matches, max_faults, every, burst))

    def reset(self, matches: Callable[[Request], bool], max_faults: int, every: int = 1) -> None:
        """Reset the connection half-way through the body of one in ``every`` matching requests."""
        self.rules.append(Rule("reset", matches, max_faults, every))

    def reset_upload_parts(self, max_faults: int, every: int = 1) -> None:
        """Reset the connection half-way through the body of UploadPart requests."""
        self.reset(lambda r: r.is_upload_part, max_faults, every)

    def hold(self, matches: Callable[[Request], bool]) -> Hold:
        """Hold the first request ``matches`` accepts; never forward it."""
        hold = Hold()
        self.rules.append(Rule("hold", matches, 1, arg=hold))
        return hold

    def truncate_listing(self, prefix: str, keep: int, max_faults: int = 1000) -> None:
        """ListObjectsV2 under ``prefix`` returns only its first ``keep`` keys, as if complete."""

        def matches(r: Request) -> bool:
            return r.is_listing and r.query.get("prefix", [""])[0].startswith(prefix)

        self.rules.append(Rule("truncated-listing", matches, max_faults, arg=keep))

    def _rule_for(self, request: Request) -> Rule | None:
        with self._lock:
            self.requests[request.method] += 1
        for rule in self.rules:
            if rule.take(request):
                with self._lock:
                    self.injected[rule.kind] += 1
                return rule
        return None


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client gone mid-request (killed by the test, or timed out) is no error here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: S3FaultProxy

    def log_message(self, *args) -> None:  # no access log on the test's output
        pass

    def _handle(self) -> None:
        url = urlsplit(self.path)
        key = unquote(url.path).lstrip("/").partition("/")[2]
        request = Request(self.command, key, parse_qs(url.query, keep_blank_values=True))
        rule = self.owner._rule_for(request)
        if rule is not None and rule.kind == "slowdown":
            self._read_body()
            self._reply(503, {"Content-Type": "application/xml"}, SLOW_DOWN)
            return
        if rule is not None and rule.kind == "reset":
            self._read_body(limit=max(1, int(self.headers.get("Content-Length", "2")) // 2))
            self._reset()
            return
        if rule is not None and rule.kind == "hold":
            rule.arg.reached.set()
            rule.arg.released.wait(HOLD_LIMIT_S)
            self._reset()
            return
        status, headers, body = self._forward(self._read_body())
        if rule is not None and rule.kind == "truncated-listing" and status == 200:
            body = _truncate_listing(body, rule.arg)
        self._reply(status, headers, body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _read_body(self, limit: int | None = None) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length if limit is None else min(limit, length))

    def _read_chunked(self) -> bytes:
        body = bytearray()
        for _ in range(1_000_000):
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                break
            body += self.rfile.read(size)
            self.rfile.readline()
        return bytes(body)

    def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection(*self.owner.upstream, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            if self.command in ("PUT", "POST") or body:
                headers["Content-Length"] = str(len(body))
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
            out = {k: v for k, v in response.getheaders() if k.lower() not in HOP_HEADERS}
            return response.status, out, data
        finally:
            connection.close()

    def _reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            if name.lower() not in ("content-length", "date", "server"):
                self.send_header(name, value)
        if self.command != "HEAD" or "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Content-Length", headers["Content-Length"])
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()


_CONTENTS = re.compile(rb"<Contents>.*?</Contents>", re.DOTALL)


def _truncate_listing(body: bytes, keep: int) -> bytes:
    """A ListObjectsV2 page with only its first ``keep`` objects, presented as the last page."""
    entries = _CONTENTS.findall(body)
    if len(entries) <= keep:
        return body
    for entry in entries[keep:]:
        body = body.replace(entry, b"", 1)
    body = re.sub(rb"<IsTruncated>\w+</IsTruncated>", b"<IsTruncated>false</IsTruncated>", body)
    body = re.sub(rb"<NextContinuationToken>.*?</NextContinuationToken>", b"", body)
    return re.sub(rb"<KeyCount>\d+</KeyCount>", b"<KeyCount>%d</KeyCount>" % keep, body)
