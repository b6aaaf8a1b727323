"""A scripted OpenAI-compatible endpoint on the loopback address, for the tests of the endpoint
judge (tests/rollout/test_judges.py) and the endpoint player (tests/rollout/test_endpoint_player.py,
tests/eval/test_endpoint_eval.py): the same replies for every request, or one computed from each
request (`answer`), and the requests it received."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def completion(content, finish_reason: str | None = None) -> bytes:
    """A chat-completions reply whose first choice says `content` (and gives `finish_reason`,
    when one is given)."""
    choice = {"message": {"role": "assistant", "content": content}}
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    return json.dumps({"choices": [choice]}).encode()


class Server:
    """What the scripted endpoint answers (`status`, its `reason` phrase, extra `headers`,
    `body`; `answer(request body) -> (status, body)` in their place when set; `hang`: no answer
    until `release` is set) and the requests it received (method, path, Authorization header,
    JSON body)."""

    def __init__(self):
        self.status, self.reason, self.headers = 200, None, {}
        self.body, self.hang = completion("<score>0.8</score>"), False
        self.answer: Callable[[dict | None], tuple[int, bytes]] | None = None
        self.release = threading.Event()
        self.requests: list[dict] = []
        self.url = ""


class Handler(BaseHTTPRequestHandler):
    # The headers and the body go out in two writes: with Nagle's algorithm the second waits
    # for the client's delayed ACK of the first, some 40 ms a reply.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        server: Server = self.server.script
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length)) if length else None
        auth = self.headers.get("Authorization")
        server.requests.append(
            {"method": self.command, "path": self.path, "authorization": auth, "body": body}
        )
        if server.hang:
            server.release.wait(5.0)  # far past any timeout a test sets; teardown cuts it short
            return
        status, reply = (
            (server.status, server.body) if server.answer is None else server.answer(body)
        )
        self.send_response(status, server.reason)
        for name, value in server.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST  # a client that follows a redirect may come back with a GET

    def log_message(self, format, *args) -> None:  # the test output stays clean
        pass


class _Listener(ThreadingHTTPServer):
    # socketserver's backlog of 5 drops the connections of a burst of parallel requests (the
    # endpoint player sends 8 at once), and a dropped SYN is sent again only after a second.
    request_queue_size = 64


@contextlib.contextmanager
def serving(script: Server):
    """A ThreadingHTTPServer on 127.0.0.1 (a free port) answering as `script` says, in a daemon
    thread, shut down on leaving."""
    httpd = _Listener(("127.0.0.1", 0), Handler)
    httpd.script = script
    # A short poll: shutdown() waits for the loop's next look at its flag.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    script.url = f"http://127.0.0.1:{httpd.server_port}/v1"
    try:
        yield script
    finally:
        script.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()
