"""A real S3-protocol server for the tests: ``moto_server`` on 127.0.0.1 with IAM authentication
on, so wrong keys and read-only users are refused as a real store would refuse them.

``start()`` returns an :class:`S3` with the endpoint, an admin's keys (full access) and a helper
to make users with narrower policies. Nothing is mocked: pyarrow's S3 client talks HTTP to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


@dataclasses.dataclass
class S3:
    endpoint: str
    key: str
    secret: str
    process: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, service: str, key: str | None = None, secret: str | None = None):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key or self.key, aws_secret_access_key=secret or self.secret)

    def user(self, name: str, actions: list[str]) -> tuple[str, str]:
        """A user allowed only ``actions``; returns its (key, secret)."""
        return _user(self.client("iam"), name, actions)

    def filesystem(self, key: str | None = None, secret: str | None = None):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=key or self.key, secret_key=secret or self.secret, region="us-east-1",
                                 endpoint_override=self.endpoint, allow_bucket_creation=True)

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        import pyarrow.fs as pafs

        infos = self.filesystem().get_file_info(pafs.FileSelector(f"{bucket}/{prefix}".rstrip("/"),
                                                                   allow_not_found=True, recursive=True))
        return {i.path: i.size for i in infos if i.type == pafs.FileType.File}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _user(iam, name: str, actions: list[str]) -> tuple[str, str]:
    iam.create_user(UserName=name)
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
    iam.put_user_policy(UserName=name, PolicyName="access", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(bucket: str):
    """A server with ``bucket`` made, its credentials and endpoint in this process's environment
    while the block runs (processes started then, Ray nodes included, inherit them)."""
    server = start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        server.filesystem().create_dir(bucket)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def start() -> S3:
    """Start moto_server; the first 3 requests (creating the admin) are the only unauthenticated ones."""
    import boto3

    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    process = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("moto_server did not start (pip install 'moto[server]')") from None
            time.sleep(0.1)
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bootstrap",
                       aws_secret_access_key="bootstrap")
    key, secret = _user(iam, "admin", ["*"])
    return S3(endpoint, key, secret, process)
