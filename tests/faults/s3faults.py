"""A faulty S3 endpoint for the fault suite: a loopback HTTP proxy in a thread that forwards
every request to a real moto_server, except the ones a rule picks, which get a 5xx answer, a
dropped connection, a response cut short, or are held until the test releases them.

The proxy is a real server on its own port (clients talk HTTP to it exactly as to S3), so boto3,
its retries and ``tokenmill``'s own retries run unmodified. ``kill()`` closes the listening
socket and every open connection at once (what clients see when the S3 server dies); ``start()``
brings it back on the same port. moto keeps its state behind it, like S3 after an outage.

Also here: ``fast_retries`` (botocore's retry sleeps shrunk, attempt counts kept), helpers
reading the bucket (``s3_tree``, ``unvouched``: manifests that vouch for missing or different
files), and ``materialize_shard``, one shard partition of the pipeline on an S3 root.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from dagster import AssetKey, DagsterInstance, ExecuteInProcessResult, materialize
from prod_servers import S3

from assets.factory import build_assets
from assets.support.partitions import partitions_name
from assets.support.resources import StorageResource
from pipelines.build import resources_for
from tokenmill.atomic import TMP_DIR
from tokenmill.recipe import Recipe
from tokenmill.storage.layout import DATASET_MANIFESTS
from tokenmill.storage.pull import LEDGER_NAME, PARTIAL_SUFFIX

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te"}
ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>injected by the fault proxy</Message><RequestId>fault</RequestId></Error>"
)
CODES = {500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable"}
DENIED_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
    "<Message>The request signature we calculated does not match the signature you provided. "
    "Check your key and signing method.</Message><AWSAccessKeyId>{key_id}</AWSAccessKeyId>"
    "<StringToSign>AWS4-HMAC-SHA256 {method} {path}</StringToSign>"
    "<RequestId>fault</RequestId></Error>"
)


@dataclass
class Rule:
    """Requests matching ``method`` and the ``path`` regex (searched in path + query) get
    ``action`` for the next ``times`` matches (None = forever):

    * ``"500"``/``"502"``/``"503"``: an S3 error answer with that status;
    * ``"drop"``: the connection closed without an answer;
    * ``"cut"``: the upstream answer's headers and ``keep`` body bytes, then the connection closed;
    * ``"stall"``: like ``"cut"``, but after the ``keep`` bytes ``hit`` is set and the answer
      waits until ``release`` is set (or the proxy is killed) before the connection closes;
    * ``"hold"``: ``hit`` is set and the request waits, unanswered, until ``release`` is set or
      the proxy is killed (then the connection just closes);
    * ``"deny"``: 403 SignatureDoesNotMatch echoing the access key id and the string to sign in
      the XML body, as AWS does.
    """

    method: str
    path: str
    action: str
    times: int | None = None
    keep: int = 0
    hit: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    matched: int = 0


class FaultProxy:
    """The proxy: ``endpoint`` is its URL; ``rules`` are consulted in order per request."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.port = 0
        self.server: ThreadingHTTPServer | None = None
        self.sockets: set[socket.socket] = set()
        self.start()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` (the same across kill and start)."""
        return f"http://127.0.0.1:{self.port}"

    def add(
        self, method: str, path: str, action: str, *, times: int | None = None, keep: int = 0
    ) -> Rule:
        """Append a rule (see :class:`Rule`) and return it."""
        rule = Rule(method, path, action, times=times, keep=keep)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and release every held request: plain forwarding from now on."""
        with self.lock:
            for rule in self.rules:
                rule.release.set()
            self.rules.clear()

    def pick(self, method: str, path: str) -> Rule | None:
        """The first rule with matches left for this request (its count advanced)."""
        with self.lock:
            for rule in self.rules:
                if rule.method == method and re.search(rule.path, path):
                    if rule.times is not None and rule.matched >= rule.times:
                        continue
                    rule.matched += 1
                    return rule
        return None

    def start(self) -> None:
        """Listen (again) on the proxy's port and serve in a daemon thread."""
        handler = type("Handler", (_Handler,), {"proxy": self})
        self.server = _Server(("127.0.0.1", self.port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kill(self) -> None:
        """Die like a crashed server: stop listening and reset every open connection."""
        server, self.server = self.server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self.lock:
            doomed, self.sockets = list(self.sockets), set()
            for rule in self.rules:
                rule.release.set()
        for sock in doomed:
            _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` so the peer sees a reset (no orderly shutdown)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()


class _Server(ThreadingHTTPServer):
    """The listening side; errors of connections cut on purpose are not worth a traceback."""

    def handle_error(self, request: object, client_address: object) -> None:
        """Stay quiet: broken connections are what this server is for."""


class _Handler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests (HTTP/1.1 keep-alive) to moto."""

    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.proxy.lock:
            self.proxy.sockets.add(self.connection)

    def finish(self) -> None:
        with self.proxy.lock:
            self.proxy.sockets.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """Silence the per-request log line on stderr."""

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self) -> None:
        method, path = self.command, self.path
        body = self._body()
        rule = self.proxy.pick(method, path)
        action = rule.action if rule else "forward"
        if action in ("500", "502", "503"):
            self._answer(int(action), ERROR_XML.format(code=CODES[int(action)]), method)
            return
        if action == "deny":
            found = re.search(r"Credential=([^/]+)/", self.headers.get("Authorization", ""))
            key_id = found.group(1) if found else ""
            self._answer(403, DENIED_XML.format(key_id=key_id, method=method, path=path), method)
            return
        if action == "drop":
            self.close_connection = True
            _reset(self.connection)
            return
        if action == "hold" and rule is not None:
            rule.hit.set()
            rule.release.wait(timeout=120)
            self.close_connection = True
            _reset(self.connection)
            return
        status, headers, payload = self._forward(method, path, body)
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if action in ("cut", "stall") and rule is not None:
            self.wfile.write(payload[: rule.keep])
            self.wfile.flush()
            if action == "stall":
                rule.hit.set()
                rule.release.wait(timeout=120)
            self.close_connection = True
            _reset(self.connection)
            return
        if method != "HEAD":
            self.wfile.write(payload)

    def _forward(
        self, method: str, path: str, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()

    def _answer(self, status: int, body: str, method: str) -> None:
        payload = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve


def s3_tree(s3: S3, prefix: str) -> dict[str, bytes]:
    """``{key: content}`` of every object under ``prefix``, read from moto directly."""
    return {
        key: s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        for key in s3.keys(prefix)
    }


def files_under(root: Path) -> dict[str, bytes]:
    """``{relative path: content}`` of every file under ``root`` but a pull's own state (its
    ledger, partial downloads in ``.tmp/``)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not is_pull_state(p.relative_to(root).as_posix())
    }


def is_pull_state(rel: str) -> bool:
    """The ledger of a pull destination, or a partial download in a ``.tmp/`` folder."""
    return rel == LEDGER_NAME or (f"{TMP_DIR}/" in rel and rel.endswith(PARTIAL_SUFFIX))


def unvouched(objects: dict[str, bytes]) -> list[str]:
    """Dataset manifests in ``objects`` (an :func:`s3_tree`) that vouch for files which are not
    there as recorded (size, sha256 or part hashes); empty when every manifest tells the truth."""
    problems = []
    for key, raw in objects.items():
        if not key.endswith(".manifest.json"):
            continue
        folder = key.rsplit("/", 1)[0]
        if folder.endswith(f"/{DATASET_MANIFESTS}"):  # the sidecar folder beside the pair
            folder = folder.rsplit("/", 1)[0]
        for name, entry in json.loads(raw)["files"].items():
            data = objects.get(f"{folder}/{name}")
            if data is None or len(data) != entry["bytes"]:
                problems.append(f"{key}: {name} missing or of another size")
                continue
            wrong = "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]
            offset = 0
            for part in entry.get("parts", ()):
                piece = data[offset : offset + part["bytes"]]
                wrong = wrong or hashlib.sha256(piece).hexdigest() != part["sha256"]
                offset += part["bytes"]
            if wrong:
                problems.append(f"{key}: {name} differs from the manifest")
    return problems


def materialize_shard(
    recipe: Recipe,
    instance: DagsterInstance,
    *,
    endpoint: str,
    work: Path,
    stages: tuple[str, ...] = ("raw_jsonl", "hf_dataset", "tokens"),
    dataset: str = "docs",
    partition: str = "part-00000",
) -> ExecuteInProcessResult:
    """One shard partition of ``dataset`` through ``stages`` (asset checks left out) with the
    storage root's S3 endpoint set to ``endpoint`` and work directories under ``work``."""
    assets, _ = build_assets(recipe)
    resources = resources_for(recipe)
    resources["storage"] = StorageResource(
        root=recipe.storage.root, s3_endpoint_url=endpoint, work_dir=str(work)
    )
    name = partitions_name(dataset)
    if partition not in instance.get_dynamic_partitions(name):
        instance.add_dynamic_partitions(name, [partition])
    return materialize(
        assets,
        instance=instance,
        resources=resources,
        partition_key=partition,
        selection=[AssetKey([dataset, stage]) for stage in stages],
        raise_on_error=False,
    )


def step_errors(result: ExecuteInProcessResult) -> list[str]:
    """What each failed step of a run raised, as the user reads it: the message of the error
    under Dagster's "Error occurred while executing op" wrapper."""
    messages = []
    for event in result.all_events:
        if event.is_step_failure:
            error = event.event_specific_data.error
            while error.cls_name == "DagsterExecutionStepExecutionError" and error.cause:
                error = error.cause
            messages.append(error.message)
    return messages
