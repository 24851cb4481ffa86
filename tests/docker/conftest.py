"""Fixtures of the container tests (``docker_daemon.py``): a private ``dockerd`` for the module
and the project image built on a local debootstrap base."""

from docker_daemon import dockerd, image  # noqa: F401 (fixtures)
