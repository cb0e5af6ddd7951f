"""A Docker engine's refusal of a container, in the config's terms.

An engine that rejects a container's definition when it is created or started rejects it again on a retry:
a 4xx answer (an invalid config), or the runtime refusing the spec (runc's "OCI runtime create failed": a
limit the engine may not raise, an unknown ulimit; a device node that is not there). `engine_refusal` makes
that a UserError (one line, exit 2, not retried) naming the node, the engine and the key to change; any other
engine error (a 5xx of its own: it may pass) stays what it was.
"""

from __future__ import annotations

import contextlib
import re
import resource
from collections.abc import Iterator

from lmyard.errors import UserError

# runc's wrappers around the reason, outermost first
_WRAPPERS = (
    "failed to create shim task",
    "OCI runtime create failed",
    "OCI runtime start failed",
    "runc create failed",
    "unable to start container process",
    "error during container init",
    "error setting rlimits for ready process",
    "unknown",
)
_DETERMINISTIC = ("OCI runtime create failed", "error gathering device information")
_RLIMIT_NAMES = {
    getattr(resource, n): n.removeprefix("RLIMIT_").lower() for n in dir(resource) if n.startswith("RLIMIT_")
}
# (words of the reason, the config key that sets what it names), first match wins
_KEYS = (
    (("rlimit", "ulimit"), "launch.docker.ulimits"),
    (("device",), "launch.docker.gpu_mode and launch.docker.node_gpus"),
    (("mount", "bind source", "volume"), "launch.docker.volumes"),
    (("network",), "launch.docker.network"),
    (("shm",), "launch.docker.shm_size"),
    (("user", "uid", "gid"), "launch.docker.user"),
    (("image", "manifest"), "launch.docker.image"),
)


def reason(explanation: str) -> str:
    """The engine's explanation without runc's wrappers, on one line; a limit runc names by its number
    ("rlimit type 8") gets its ulimit name too."""
    parts = [p.strip() for p in " ".join(str(explanation).split()).split(": ")]
    kept = ": ".join(p for p in parts if p not in _WRAPPERS) or " ".join(str(explanation).split())
    return re.sub(r"rlimit type (\d+)", lambda m: f"{m[0]} ({_RLIMIT_NAMES.get(int(m[1]), '?')})", kept)


def config_key(text: str) -> str | None:
    """The config key that sets what an engine's refusal names, when one does."""
    low = text.lower()
    return next((key for words, key in _KEYS if any(w in low for w in words)), None)


def engine_refusal(error, what: str, url: str) -> UserError | None:
    """A UserError for a docker.errors.APIError that a retry cannot change, naming `what` ("node 0", "the
    network ...") on the engine `url` and the key to change; None for an engine's error of its own."""
    text = str(error.explanation or error)
    if not (error.is_client_error() or any(s in text for s in _DETERMINISTIC)):
        return None
    why = reason(text)
    key = config_key(why)
    fix = f"change {key}" if key else "change its launch.docker settings"
    if key == "launch.docker.ulimits" and "operation not permitted" in why:
        fix += (
            ": this engine cannot raise that limit (it lacks CAP_SYS_RESOURCE); lower or drop it, "
            "e.g. --set 'launch.docker.ulimits={stack: 67108864}' leaves memlock as the engine sets it"
        )
    return UserError(f"{what}: the Docker engine {url} refused its container ({why}): {fix}")


@contextlib.contextmanager
def refused(what: str, url: str) -> Iterator[None]:
    """Around a container's (or a network's) creation or start: the engine's refusal that a retry cannot change
    becomes `engine_refusal`'s UserError; any other error passes unchanged."""
    import docker

    try:
        yield
    except docker.errors.APIError as e:
        refusal = engine_refusal(e, what, url)
        if refusal is None:
            raise
        raise refusal from None
