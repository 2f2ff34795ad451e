"""``preempt_watch=``: the caller watches a cloud's instance metadata service for a preemption
notice, and turns the first one into the same notice as SIGTERM (``caller.preemption.post``):
every rank saves a checkpoint of its step (``parallel.save_on_preemption``) and the run stops.

One daemon thread per run, started with the run (``on_start``) and told to stop when it ends
(``on_end``); it asks the service every ``POLL_S`` seconds with short timeouts, through no
proxy (the services answer on a link-local address). The protocols, as each cloud documents
them:

* AWS (EC2 spot): IMDSv2. ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
  gives a session token; ``GET /latest/meta-data/spot/instance-action`` with
  ``X-aws-ec2-metadata-token`` answers 404 until the interruption notice, then
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-12-06T21:00:00Z"}`` (the
  time of the action: about two minutes ahead).
* GCP (Spot / preemptible VMs): ``GET /computeMetadata/v1/instance/preempted`` with
  ``Metadata-Flavor: Google`` answers ``FALSE``, then ``TRUE``; the VM has about 30 s from then.
* Azure (Spot VMs): Scheduled Events, ``GET /metadata/scheduledevents?api-version=2020-07-01``
  with ``Metadata: true``: an event with ``EventType`` ``Preempt`` whose ``Resources`` name this
  VM (``/metadata/instance/compute/name``) and whose ``NotBefore`` (an RFC 1123 date, empty once
  started) says when; at least 30 s ahead.

The grace period of the notice: the time the cloud leaves (less ``MARGIN_S``, so that the
checkpoint is due before the machine goes); where the cloud gives no time, ``preempt_grace``
(else 30 s). A service this host cannot reach never fails nor slows the run: one warning line,
then the thread keeps asking quietly. ``$GPULAUNCH_METADATA_URL`` replaces the service's
address (a test's server on loopback, a proxy of your own).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import email.utils
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

from .. import option_checks
from ..errors import ConfigurationError
from .callbacks import RunCallback

WATCH_ENV = "GPULAUNCH_PREEMPT_WATCH"
METADATA_URL_ENV = "GPULAUNCH_METADATA_URL"
# Every cloud's service answers on the link-local address (GCP's also as
# metadata.google.internal): no name lookup in the caller's thread.
BASE_URLS = {"aws": "http://169.254.169.254", "gcp": "http://169.254.169.254",
             "azure": "http://169.254.169.254"}
CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure"}
POLL_S = 1.0              # how often the service is asked
TIMEOUT_S = 1.0           # per request: a host off the cloud answers nothing at all
MARGIN_S = 5.0            # the checkpoint is due this long before the machine goes
CONVENTIONAL_S = 30.0     # GCP's notice (and Azure's least) when no time is given
AWS_TOKEN_TTL_S = 21600
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Unreachable(Exception):
    """The service did not answer as the protocol says (no route, refused, a wrong status)."""


@dataclasses.dataclass(frozen=True)
class CloudNotice:
    what: str                 # the cloud, and what it said
    left_s: float | None      # seconds until the machine goes, as the cloud says (None: unsaid)


def _request(url: str, headers: dict, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with _NO_PROXY.open(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read(1 << 16).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"{type(reason).__name__}: {reason}") from None


def _expect(status: int, what: str) -> None:
    if status != 200:
        raise Unreachable(f"{what} answered HTTP {status}")


class Aws:
    def __init__(self, base: str):
        self.base, self._token, self._token_at = base, None, 0.0

    def check(self) -> CloudNotice | None:
        if self._token is None or time.monotonic() - self._token_at > AWS_TOKEN_TTL_S / 2:
            status, body = _request(f"{self.base}/latest/api/token", {
                "X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}, "PUT")
            _expect(status, "PUT /latest/api/token")
            self._token, self._token_at = body.strip(), time.monotonic()
        status, body = _request(f"{self.base}/latest/meta-data/spot/instance-action",
                                {"X-aws-ec2-metadata-token": self._token})
        if status == 401:                 # the token expired: a new one next time
            self._token = None
            return None
        if status == 404:                 # no interruption notice
            return None
        _expect(status, "GET /latest/meta-data/spot/instance-action")
        data = json.loads(body)
        action, when = data.get("action", "?"), data.get("time", "")
        try:
            at = _dt.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
        except (ValueError, AttributeError):
            at = None
        return CloudNotice(f"AWS spot instance-action: {action} at {when}",
                           None if at is None else at - time.time())


class Gcp:
    def __init__(self, base: str):
        self.base = base

    def check(self) -> CloudNotice | None:
        status, body = _request(f"{self.base}/computeMetadata/v1/instance/preempted",
                                {"Metadata-Flavor": "Google"})
        _expect(status, "GET /computeMetadata/v1/instance/preempted")
        if body.strip().upper() != "TRUE":
            return None
        return CloudNotice("GCP instance/preempted: TRUE", CONVENTIONAL_S)


class Azure:
    def __init__(self, base: str):
        self.base, self._name = base, None

    def _vm_name(self) -> str:
        """This VM's name (events may be for other VMs of its scale set); '' if unknown."""
        if self._name is None:
            status, body = _request(f"{self.base}/metadata/instance/compute/name"
                                    "?api-version=2021-02-01&format=text", {"Metadata": "true"})
            self._name = body.strip() if status == 200 else ""
        return self._name

    def check(self) -> CloudNotice | None:
        status, body = _request(f"{self.base}/metadata/scheduledevents?api-version=2020-07-01",
                                {"Metadata": "true"})
        _expect(status, "GET /metadata/scheduledevents")
        for event in json.loads(body).get("Events") or []:
            resources = event.get("Resources") or []
            if event.get("EventType") != "Preempt" or (
                    resources and self._vm_name() and self._vm_name() not in resources):
                continue
            when = event.get("NotBefore") or ""
            try:
                left = email.utils.parsedate_to_datetime(when).timestamp() - time.time()
            except (TypeError, ValueError):
                left = None                  # started already: no time given
            return CloudNotice(f"Azure scheduled event Preempt "
                               f"{'not before ' + when if when else event.get('EventStatus', '')}",
                               left)
        return None


PROTOCOLS = {"aws": Aws, "gcp": Gcp, "azure": Azure}


def base_url(cloud: str) -> str:
    return (os.environ.get(METADATA_URL_ENV) or BASE_URLS[cloud]).rstrip("/")


def grace_for(notice: CloudNotice, configured: float | None) -> float:
    """The notice's grace: what the cloud leaves less MARGIN_S, else ``configured`` (else 30
    s); never past the time the cloud leaves."""
    if notice.left_s is None:
        return configured or CONVENTIONAL_S
    return max(1.0, notice.left_s - MARGIN_S)


class Watch:
    """The polling thread: ``on_notice(CloudNotice)`` once, at the first notice."""

    def __init__(self, cloud: str, on_notice, *, name: str = "gpulaunch-preempt-watch",
                 interval: float = POLL_S):
        self.cloud, self.base, self.interval = cloud, base_url(cloud), interval
        self._protocol = PROTOCOLS[cloud](self.base)
        self._on_notice = on_notice
        self._stop = threading.Event()
        self.warned = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> "Watch":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self._protocol.check()
            except Exception as e:  # noqa: BLE001 - unreachable, or not the protocol
                notice = None
                if not self.warned:
                    self.warned = True
                    sys.stderr.write(
                        f"gpulaunch: preempt_watch={self.cloud!r}: cannot reach the "
                        f"{CLOUD_NAMES[self.cloud]} metadata service at {self.base} ({e}); the "
                        "run goes on, and the watch keeps asking quietly\n")
                    sys.stderr.flush()
            if notice is not None and not self._stop.is_set():
                self._on_notice(notice)
                return
            self._stop.wait(self.interval)


class PreemptWatch(RunCallback):
    """The run callback: a ``Watch`` from the run's start to its end."""

    name = "preempt_watch"

    def __init__(self, cloud: str):
        self.cloud = cloud
        self.watch: Watch | None = None

    def on_start(self, run) -> None:
        self.watch = Watch(self.cloud, lambda notice: self._post(run, notice),
                           name=f"gpulaunch-preempt-watch-{run.run.run_id}").start()

    def _post(self, run, notice: CloudNotice) -> None:
        from . import preemption
        if run.finished:
            return
        try:
            preemption.post(run, grace_for(notice, preemption.grace_of(run.spec)),
                            source=notice.what, restart=False)   # the machine is going away
        except Exception as e:  # noqa: BLE001 - a side concern never fails the run
            sys.stderr.write(f"gpulaunch: preempt_watch: could not post the notice ({notice.what}"
                             f"): {type(e).__name__}: {e}\n")

    def on_end(self, run, state) -> None:
        if self.watch is not None:
            self.watch.stop()


def watch_callback(options) -> PreemptWatch | None:
    """The watch of a launch: ``preempt_watch=`` (checked with the options: not with a Ray
    run), else ``$GPULAUNCH_PREEMPT_WATCH``, which a Ray run ignores with a warning line."""
    cloud = options.preempt_watch
    if cloud is None:
        cloud = option_checks.preempt_watch(os.environ.get(WATCH_ENV),
                                            name=f"${WATCH_ENV}")
        if cloud is not None and options.remote:
            sys.stderr.write(f"gpulaunch: ${WATCH_ENV}={cloud} ignored for this Ray run: "
                             "preemption notices reach the ranks of runs on this host only\n")
            return None
    if cloud is not None and cloud not in PROTOCOLS:       # defensive: the check names them
        raise ConfigurationError(f"preempt_watch={cloud!r}: choose one of {sorted(PROTOCOLS)}")
    return PreemptWatch(cloud) if cloud is not None else None
