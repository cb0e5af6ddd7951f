"""Training across simulated hosts (tests/hosts.py): network namespaces joined by a bridge, each host with its
own hostname, address, LMYARD_CACHE and Docker engine; a services host with the image registry.

Skipped where namespaces cannot be made (not root, no `ip`); .ci/run sets LMYARD_REQUIRE_HOSTS=1, which turns
the skip into a failure.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from hosts import SUBNET, Hosts, HostsUnavailable, check_available

pytestmark = pytest.mark.slow


def _require(docker: bool = False, registry: bool = False) -> None:
    try:
        check_available(docker, registry)
    except HostsUnavailable as e:
        if os.environ.get("LMYARD_REQUIRE_HOSTS") == "1":
            pytest.fail(f"LMYARD_REQUIRE_HOSTS=1 but {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Hosts a and b with their own engines, and the services host with the registry; for this module.
    Its teardown checks that nothing of it is left."""
    _require(docker=True, registry=True)
    harness = Hosts(tmp_path_factory.mktemp("hosts"), ["a", "b"], docker=True, registry=True)
    with harness:
        yield harness
    assert harness.leftovers() == []


def test_each_host_has_its_own_name_address_and_cache_and_reaches_the_others(hosts):
    seen = {}
    for host in hosts.hosts:
        out = host.run(["sh", "-c", 'hostname; ip -o -4 addr show dev eth0; echo "$LMYARD_CACHE"'])
        assert out.returncode == 0, out.stderr
        name, addr, cache = out.stdout.splitlines()
        seen[name] = addr.split()[3]
        assert cache == str(host.cache)
        # the registry on the services host answers from every host
        reach = f"import urllib.request; print(urllib.request.urlopen('http://{hosts.registry}/v2/').status)"
        assert host.run(["python3", "-c", reach]).stdout.strip() == "200"
    assert seen == {"host-a": f"{SUBNET}.2/24", "host-b": f"{SUBNET}.3/24"}


def test_the_root_namespace_gets_no_test_address_and_reaches_services_only_through_a_forward(hosts):
    import subprocess
    import urllib.request

    assert f"inet {SUBNET}." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    port = hosts.forward(hosts.services, 5000)
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=10).status == 200


def test_each_host_engine_starts_empty_and_names_its_host(hosts):
    for host in hosts.hosts:
        with contextlib.closing(host.docker()) as client:
            info = client.info()
            assert info["Name"] == host.hostname
            assert info["DockerRootDir"].startswith(str(host.root))
            assert client.images.list() == []  # nothing but what comes through the registry, later


def test_teardown_leaves_no_namespace_link_engine_or_mount_even_after_a_failure(tmp_path):
    _require(docker=True)
    harness = Hosts(tmp_path, ["x"], docker=True)
    with pytest.raises(RuntimeError, match="boom"), harness:
        host = harness["x"]
        assert harness.leftovers()  # namespaces and the engine are there while it runs
        with contextlib.closing(host.docker()) as client:
            client.ping()
        raise RuntimeError("boom")
    assert harness.leftovers() == []
    assert host.dockerd is not None and host.dockerd.poll() is not None
