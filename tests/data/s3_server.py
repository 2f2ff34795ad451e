"""A real S3-protocol HTTP server on loopback for the tests: moto's standalone server, in a
process of its own, started and stopped by the test that needs it. Clients talk to it with the
real s3fs / botocore / deltalake stacks, as they would to any S3-compatible store."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

KEY, SECRET = "testing-key", "testing-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, auth: bool = True):
        self.port = _free_port()
        self.key, self.secret = KEY, SECRET
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        env = dict(os.environ)
        if auth:       # check signatures: the first 3 requests (below) make the IAM user
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "6"
        self.proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on {self.endpoint}")
                time.sleep(0.2)
        if auth:
            self._make_user()

    def _make_user(self) -> None:
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, aws_access_key_id=KEY,
                           aws_secret_access_key=SECRET, region_name="us-east-1")
        self.key, self.secret = self._user(iam, "tests", ["s3:*"])
        # may read and list, not write: for uploads that the store refuses
        self.reader_key, self.reader_secret = self._user(iam, "reader", [
            "s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation", "s3:ListAllMyBuckets"])

    @staticmethod
    def _user(iam, name: str, actions: list[str]) -> tuple[str, str]:
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
        k = iam.create_access_key(UserName=name)["AccessKey"]
        return k["AccessKeyId"], k["SecretAccessKey"]

    @property
    def storage_options(self) -> dict:
        return {"key": self.key, "secret": self.secret, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}

    def env(self) -> dict:
        """The AWS_* environment that points boto-based clients (and deltalake) here."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true"}

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)

    def make_bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                     aws_secret_access_key=self.secret, region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"

    def upload(self, local: str, url: str) -> str:
        self.fs().put(str(local).rstrip("/") + "/", url.rstrip("/") + "/", recursive=True)
        return url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def started(monkeypatch=None) -> S3Server:
    server = S3Server()
    if monkeypatch is not None:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return server
