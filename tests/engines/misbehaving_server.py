"""A fake HTTP server on loopback that misbehaves the ways a judge, a scorer or a vLLM server can: it stands in for
them because a real one cannot be made to trickle, flood or cut off on cue. Run in a thread (`MisbehavingServer`) or
as a process (`python misbehaving_server.py ... --port N`, the command line VllmServer gives vLLM).

The first path segment picks the behaviour; the rest of the path is ignored (so `<url>/trickle` works as a judge's
base_url, which gets `/chat/completions` appended):
    /ok             200 with ANSWER
    /trickle        headers (Content-Length 1000), then one byte every 0.3 s
    /slow-headers   the status line and headers one byte every 0.3 s
    /flood          200 with no Content-Length, then FLOOD_BYTES of body (closing the connection ends it)
    /flood-declared Content-Length FLOOD_BYTES, then the body
    /cut-then-ok    odd-numbered requests: Content-Length 1000, 10 bytes, connection closed; even ones: ANSWER
    /cut-then-ok-chunked  the same with a chunked body
GET behaves as POST; `/health` as the behaviour given to MisbehavingServer (default /ok).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# One answer that every client under test accepts: a scorer's score, a judge's chat completion.
ANSWER = json.dumps({"score": 0.5, "choices": [{"index": 0, "message": {"content": "5"}}]}).encode()
FLOOD_BYTES = 64 << 20
TRICKLE_S = 0.3


class MisbehavingServer:
    """A ThreadingHTTPServer on 127.0.0.1 (`port` 0: a free one). `requests[name]`: requests seen per behaviour;
    `flood_sent`: bytes of flood body written before the client hung up. `health`: the behaviour of `/health`."""

    def __init__(self, port: int = 0, health: str = "ok"):
        self.health = health
        self.requests: dict[str, int] = {}
        self.flood_sent: list[int] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - http.server naming
                self.do_POST()

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                name = self.path.strip("/").split("/")[0].split("?")[0]
                name = owner.health if name == "health" else name
                owner.requests[name] = owner.requests.get(name, 0) + 1
                try:
                    getattr(self, "_" + name.replace("-", "_"), self._ok)(owner.requests[name])
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up and left
                self.close_connection = True

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _ok(self, count: int) -> None:
                self._answer(200, ANSWER)

            def _trickle(self, count: int) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.flush()
                for _ in range(1000):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(TRICKLE_S)

            def _slow_headers(self, count: int) -> None:
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}":
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(TRICKLE_S)

            def _flood(self, count: int, declared: bool = False) -> None:
                self.send_response(200)
                if declared:
                    self.send_header("Content-Length", str(FLOOD_BYTES))
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                chunk, sent = b"x" * (64 << 10), 0
                try:
                    while sent < FLOOD_BYTES:
                        self.wfile.write(chunk)
                        sent += len(chunk)
                finally:
                    owner.flood_sent.append(sent)

            def _flood_declared(self, count: int) -> None:
                self._flood(count, declared=True)

            def _cut_then_ok(self, count: int, chunked: bool = False) -> None:
                if count % 2 == 0:
                    return self._answer(200, ANSWER)
                self.send_response(200)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"3e8\r\n" + b"x" * 10)  # a chunk of 1000 bytes, 10 of them sent
                else:
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"x" * 10)
                self.wfile.flush()
                self.connection.shutdown(2)  # cut: the client sees the end of the stream mid-body

            def _cut_then_ok_chunked(self, count: int) -> None:
                self._cut_then_ok(count, chunked=True)

            def log_message(self, *args):  # keep test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> MisbehavingServer:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":  # as VllmServer starts vLLM: `<python> <launcher> <pid> -m <module> ... --port N ...`
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    arguments, _ = parser.parse_known_args()
    MisbehavingServer(arguments.port).server.serve_forever()
