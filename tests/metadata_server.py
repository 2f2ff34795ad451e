"""A cloud's instance metadata service on loopback, for the ``preempt_watch=`` tests: the real
protocol of each cloud (the headers it requires, AWS's IMDSv2 session token, Azure's
``api-version``), answering "no notice" until the test calls ``notice()``.

    with MetadataServer("aws") as server:      # server.url -> $GPULAUNCH_METADATA_URL
        ...; server.notice(left_s=60)
"""

from __future__ import annotations

import email.utils
import http.server
import json
import threading
import time
import urllib.parse

AWS_TOKEN = "AQAEAFakeSessionToken=="
VM_NAME = "vm-under-test"


class MetadataServer:
    def __init__(self, cloud: str):
        self.cloud = cloud
        self.notice_at: float | None = None       # the time the machine goes (after notice())
        self.requests: list[tuple[str, str, int]] = []     # (method, path, status answered)
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_PUT(self):
                self._answer(*server.answer("PUT", self.path, self.headers))

            def do_GET(self):
                self._answer(*server.answer("GET", self.path, self.headers))

            def _answer(self, status, body, ctype="text/plain"):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "MetadataServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def notice(self, left_s: float = 60.0) -> None:
        """From now on the service says the machine goes in ``left_s`` seconds."""
        self.notice_at = time.time() + left_s

    def answered(self, status: int) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r[2] == status)

    def answer(self, method: str, path: str, headers) -> tuple:
        status, body, *rest = getattr(self, f"_{self.cloud}")(method, path, headers)
        with self._lock:
            self.requests.append((method, path, status))
        return (status, body, *rest)

    # ------------------------------------------------------------------ the protocols
    def _aws(self, method, path, headers):
        if path == "/latest/api/token":
            if method != "PUT":
                return 405, ""
            ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, ""
            return 200, AWS_TOKEN
        if headers.get("X-aws-ec2-metadata-token") != AWS_TOKEN:
            return 401, ""                                # IMDSv2 required
        if path == "/latest/meta-data/spot/instance-action" and method == "GET":
            if self.notice_at is None:
                return 404, ""
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.notice_at))
            return 200, json.dumps({"action": "terminate", "time": when}), "application/json"
        return 404, ""

    def _gcp(self, method, path, headers):
        if headers.get("Metadata-Flavor") != "Google":
            return 403, ""
        if urllib.parse.urlsplit(path).path == "/computeMetadata/v1/instance/preempted":
            return 200, "TRUE" if self.notice_at is not None else "FALSE"
        return 404, ""

    def _azure(self, method, path, headers):
        if headers.get("Metadata") != "true":
            return 400, json.dumps({"error": "Bad request. Required metadata header not "
                                             "specified"})
        parts = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(parts.query)
        if "api-version" not in query:
            return 400, json.dumps({"error": "Bad request. api-version was not specified"})
        if parts.path == "/metadata/instance/compute/name":
            return 200, VM_NAME
        if parts.path != "/metadata/scheduledevents":
            return 404, ""
        # another VM of the scale set is always being evicted: never this VM's notice
        events = [self._azure_event("other-vm", time.time() + 40)]
        if self.notice_at is not None:
            events.append(self._azure_event(VM_NAME, self.notice_at))
        return 200, json.dumps({"DocumentIncarnation": len(events), "Events": events}), \
            "application/json"

    @staticmethod
    def _azure_event(vm: str, at: float) -> dict:
        return {"EventId": f"602d9444-d2cd-49c7-8624-{vm}", "EventType": "Preempt",
                "ResourceType": "VirtualMachine", "Resources": [vm], "EventStatus": "Scheduled",
                "NotBefore": email.utils.formatdate(at, usegmt=True),
                "Description": "Virtual machine is being preempted.", "EventSource": "Platform",
                "DurationInSeconds": -1}

