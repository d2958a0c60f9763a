"""A fake cloud metadata service on 127.0.0.1: answers set per path, every request recorded.

Each answer is (status, body, headers the request must carry); a request without them gets
the status the real services give (AWS 401, GCE and Azure 400/403 style: here 400).
"""

from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass, field


@dataclass
class Answer:
    status: int
    body: bytes = b""
    needs: dict[str, str] = field(default_factory=dict)


class FakeMetadata:
    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], Answer] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                with fake._lock:
                    fake.requests.append((self.command, self.path, headers))
                    answer = fake.answers.get((self.command, self.path))
                if answer is None:
                    answer = Answer(404, b"not found")
                elif any(headers.get(k.lower()) != v for k, v in answer.needs.items()):
                    answer = Answer(400, b"missing header")
                self.send_response(answer.status)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            do_GET = do_PUT = do_POST = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def set(
        self,
        path: str,
        status: int,
        body: bytes = b"",
        method: str = "GET",
        needs: dict[str, str] | None = None,
    ) -> None:
        with self._lock:
            self.answers[(method, path)] = Answer(status, body, dict(needs or {}))

    def paths(self) -> list[str]:
        with self._lock:
            return [path for _, path, _ in self.requests]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
