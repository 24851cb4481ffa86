"""A private Docker daemon and the project image for the container tests (fixtures).

``dockerd`` runs as a child of the test process on loopback only (no bridge, no iptables), with
its own exec root, pidfile and socket; clients reach it through ``DOCKER_HOST``. Its data root
persists in ``$TOKENMILL_DOCKER_CACHE`` (default ``/var/tmp/tokenmill-docker``) so the base and
project images are built once and reused; a lock file keeps two sessions from sharing it at once.
Both fixtures are module-scoped: inside ``make test`` the daemon stops (by its PID, unmounting
what it left under its directories) and the lock is released as soon as the container module is
done, not when the whole suite ends.

Without root, ``dockerd`` or ``debootstrap`` (``.ci/sysdeps`` installs them), or when the daemon
cannot start, every test that needs it is skipped with the reason (``make test`` lists skip
reasons: ``pytest -rs``); with ``CI`` set, that skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TOKENMILL_DOCKER_CACHE", "/var/tmp/tokenmill-docker"))
BASE_IMAGE = "tokenmill-base:bookworm"
IMAGE = "tokenmill:e2e"
LABEL = "app=tokenmill"  # infra/docker/dagster.yaml labels every run container with it
START_SECONDS = 60


@dataclass(frozen=True)
class Docker:
    """A client of the private daemon."""

    host: str  # unix:///.../docker.sock
    image: str = IMAGE
    base_image_seconds: float = 0.0  # what building the images took (0: cached)
    image_seconds: float = 0.0

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"}

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run(
            ["docker", *args], env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def ids(self, *args: str) -> list[str]:
        return self.run(*args).split()

    def remove_labelled(self) -> None:
        """Remove every container carrying ``LABEL`` (running or exited)."""
        found = self.ids("ps", "-aq", "--filter", f"label={LABEL}")
        if found:
            self.run("rm", "-f", "-v", *found)


def _skip(reason: str) -> None:
    pytest.skip(f"tests/docker: {reason}")


def _unmount_under(*dirs: Path) -> None:
    """Unmount whatever the daemon left mounted at or below ``dirs`` (deepest first; dockerd
    bind-mounts its data root onto itself)."""
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1].encode().decode("unicode_escape") for line in mounts]
    roots = [str(d.resolve()) for d in dirs]
    for point in sorted(points, key=len, reverse=True):
        if any(point == r or point.startswith(r + "/") for r in roots):
            subprocess.run(["umount", "-l", point], capture_output=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def dockerd() -> Iterator[Docker]:
    """The private daemon, up for the module; stopped by PID and cleaned up afterwards."""
    if os.geteuid() != 0:
        _skip("dockerd needs root here")
    for tool in ("dockerd", "docker"):
        if shutil.which(tool) is None:
            _skip(f"{tool} not found (.ci/sysdeps installs docker.io)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one session at a time on this data root
        data = CACHE / "data"
        run_dir = Path(tempfile.mkdtemp(prefix="tmd-", dir="/tmp"))  # short: socket paths
        _unmount_under(data)  # a crashed earlier session
        log = run_dir / "dockerd.log"
        docker = Docker(f"unix://{run_dir}/docker.sock")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    "dockerd",
                    "--bridge=none",
                    "--iptables=false",
                    "--ip6tables=false",
                    "--ip-masq=false",
                    f"--data-root={data}",
                    f"--exec-root={run_dir / 'exec'}",
                    f"--pidfile={run_dir / 'dockerd.pid'}",
                    "-H",
                    docker.host,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + START_SECONDS
            while True:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-2000:]
                    _skip(f"dockerd exited with {proc.returncode}: {tail}")
                ok = subprocess.run(
                    ["docker", "version"], env=docker.env(), capture_output=True, timeout=30
                )
                if ok.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    _skip(f"dockerd not answering after {START_SECONDS} s")
                time.sleep(0.3)
            # The daemon is private to these tests: whatever an earlier, interrupted session
            # (or a failed build) left in the cached data root goes first.
            stale = docker.ids("ps", "-aq")
            if stale:
                docker.run("rm", "-f", "-v", *stale)
            yield docker
        finally:
            try:
                if proc.poll() is None:
                    docker.remove_labelled()
            finally:
                _stop(proc)
                _unmount_under(run_dir, data)
                shutil.rmtree(run_dir, ignore_errors=True)


def _has_image(docker: Docker, name: str) -> bool:
    return bool(docker.run("images", "-q", name).strip())


@pytest.fixture(scope="module")
def image(dockerd: Docker) -> Docker:
    """``tokenmill:e2e`` built by ``make image`` on the local debootstrap base image (both
    cached in the daemon's data root; Docker's layer cache makes a rebuild with unchanged code
    take seconds). A replaced ``tokenmill:e2e`` is removed, so no dangling image is left."""
    base_seconds = 0.0
    if not _has_image(dockerd, BASE_IMAGE):
        if shutil.which("debootstrap") is None and not Path("/usr/sbin/debootstrap").exists():
            _skip("debootstrap not found (.ci/sysdeps installs it)")
        start = time.perf_counter()
        rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
        try:
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=python3,python3-venv,ca-certificates",
                    "bookworm",
                    str(rootfs),
                ],
                check=True,
                capture_output=True,
                timeout=900,
            )
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(
                ["docker", "import", "-", BASE_IMAGE],
                stdin=tar.stdout,
                env=dockerd.env(),
                check=True,
                capture_output=True,
                timeout=600,
            )
            assert tar.wait() == 0
        finally:
            _unmount_under(rootfs)
            shutil.rmtree(rootfs, ignore_errors=True)
        base_seconds = time.perf_counter() - start
    before = dockerd.run("images", "-q", IMAGE).strip()
    start = time.perf_counter()
    done = subprocess.run(
        [
            "make",
            "-s",
            "image",
            f"IMAGE={IMAGE}",
            f"BASE_IMAGE={BASE_IMAGE}",
            f"HOST_PY={sys.executable}",
        ],
        cwd=ROOT,
        env=dockerd.env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, f"make image failed:\n{done.stdout}\n{done.stderr}"
    after = dockerd.run("images", "-q", IMAGE).strip()
    if before and before != after:
        dockerd.run("rmi", before, check=False)
    return Docker(
        dockerd.host,
        IMAGE,
        base_image_seconds=base_seconds,
        image_seconds=time.perf_counter() - start,
    )
