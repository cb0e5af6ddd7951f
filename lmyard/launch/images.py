"""Build the stage image offline: a local Debian base, a local wheelhouse, `docker build`.

    python -m lmyard.launch.images build                       # base + wheelhouse + image, cached
    python -m lmyard.launch.images build --push registry.internal:5000   # and push it; prints its digest
    python -m lmyard.launch.images build --base pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime --no-torch
    python -m lmyard.launch.images tag                         # the tag this checkout builds
    python -m lmyard.launch.images prune --keep 3              # drop older stage images (~1.1 GB each)

Design notes: docs/launch.md, `lmyard/launch/images.py`.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lmyard.errors import UserError
from lmyard.paths import cache_root
from lmyard.version import code_version

REPO = Path(__file__).resolve().parents[2]  # lmyard/launch/images.py -> the repository
IMAGES = REPO / "images"
BASE_IMAGE = "lmyard-base:bookworm"
STAGE_REPO = "lmyard-stage"
BUILD_STAGE_LABEL = "lmyard.build-stage"
SOURCE_LABEL = "lmyard.source-digest"  # on the stage image: source_digest() of what it was built from
# Trimmed from the debootstrapped tree: nothing the stages run needs them (~140 MB of 275 MB).
TRIM = (
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
)


def cache_dir() -> Path:
    """LMYARD_IMAGE_CACHE, default `images` under the one cache root (LMYARD_CACHE, ~/.cache/lmyard)."""
    return Path(os.environ.get("LMYARD_IMAGE_CACHE") or cache_root("images"))


def source_digest() -> str:
    """A digest of what goes into the image: the packages' sources, pyproject and images/."""
    h = hashlib.sha256()
    files = [REPO / "pyproject.toml", *sorted(IMAGES.glob("*"))]
    for pkg in ("lmyard", "flows", "tasks"):
        files += sorted((REPO / pkg).rglob("*.py"))
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _sources_changed() -> bool:
    """Uncommitted or untracked changes in what goes into the image (True outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", "lmyard", "flows", "tasks", "images", "pyproject.toml"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return True
    return out.returncode != 0 or bool(out.stdout.strip())


def image_tag() -> str:
    """`lmyard-stage:<code version>`; changed sources add `.src<digest>`, so an edit never reuses a stale image."""
    version = code_version().removesuffix(".dirty")
    if _sources_changed():
        version += f".src{source_digest()}"
    return f"{STAGE_REPO}:{re.sub(r'[^A-Za-z0-9_.-]', '-', version)}"


def _client():
    import docker

    return docker.from_env(timeout=600)


def _image_exists(client, ref: str) -> bool:
    import docker

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def _debian_mirror() -> str:
    """The Debian mirror apt is configured with (deb822 or one-line sources), else deb.debian.org."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        m = re.search(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(https?://\S+/debian)/?\s", text, re.M)
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def build_base(client, log: Callable[[str], None] = print, suite: str = "bookworm") -> str:
    """`lmyard-base:<suite>`: debootstrap + `docker import`; the root tarball is cached."""
    tag = f"lmyard-base:{suite}"
    if _image_exists(client, tag):
        return tag
    tarball = cache_dir() / f"base-{suite}.tar"
    if not tarball.exists():
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap is not installed: apt-get install -y debootstrap")
        tarball.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="lmyard-rootfs-", dir=tarball.parent) as root:
            mirror = _debian_mirror()
            log(f"debootstrap {suite} from {mirror}")
            subprocess.run(
                ["debootstrap", "--variant=minbase", "--include=python3,python3-venv", suite, root, mirror],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            for rel in TRIM:
                shutil.rmtree(Path(root, rel), ignore_errors=True)
            tmp = tarball.with_suffix(".tar.part")
            with tarfile.open(tmp, "w") as tar:
                tar.add(root, arcname=".")
            tmp.replace(tarball)
    log(f"docker import {tarball} as {tag}")
    client.api.import_image_from_file(
        str(tarball),
        repository=tag.split(":")[0],
        tag=suite,
        changes=[
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV LANG=C.UTF-8",
            'CMD ["python3"]',
        ],
    )
    return tag


def pinned_requirements(include_torch: bool = True) -> list[str]:
    """images/requirements.txt with each package pinned to the version installed here, when it fits."""
    from packaging.requirements import Requirement

    out = []
    for line in (IMAGES / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.name == "torch" and not include_torch:
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            out.append(line)
            continue
        out.append(f"{req.name}=={have}" if req.specifier.contains(have, prereleases=True) else line)
    return out


def build_wheelhouse(dest: Path, include_torch: bool = True, log: Callable[[str], None] = print) -> None:
    """Every dependency's wheel the image installs, and the pinned requirements.txt, into `dest`."""
    shared = cache_dir() / "wheels"  # downloads kept across builds
    shared.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    reqs = pinned_requirements(include_torch)
    (dest / "requirements.txt").write_text("\n".join(reqs) + "\n")
    log(f"pip download {len(reqs)} requirements (and their dependencies) into {shared}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--dest",
            str(shared),
            "-r",
            str(dest / "requirements.txt"),
        ],
        check=True,
    )
    for whl in shared.glob("*.whl"):
        try:
            os.link(whl, dest / whl.name)
        except OSError:
            shutil.copy2(whl, dest / whl.name)


def build_own_wheel(dest: Path) -> None:
    """lmyard's own wheel into `dest`, from a clean copy of this checkout's sources."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "src")
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, src / name)
        for pkg in ("lmyard", "flows", "tasks"):
            shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp, str(src)], check=True
        )
        for whl in Path(tmp).glob("*.whl"):
            shutil.move(str(whl), dest / whl.name)


def build_image(
    tag: str | None = None,
    base: str | None = None,
    include_torch: bool = True,
    log: Callable[[str], None] = print,
    force: bool = False,
) -> str:
    """Build (or reuse) the stage image; returns its tag. Builds on one machine take turns (a lock file in the
    image cache): a second build of the same tag waits for the first and then reuses its image."""
    client = _client()
    tag = tag or image_tag()
    if not force and _image_exists(client, tag):
        log(f"{tag} exists; not rebuilding")
        return tag
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if not force and _image_exists(client, tag):
            log(f"{tag} was built meanwhile; not rebuilding")
            return tag
        return _build(client, tag, base, include_torch, log, force)


def _build(client, tag: str, base: str | None, include_torch: bool, log: Callable[[str], None], force: bool) -> str:
    digest = source_digest()
    if not force and base is None and include_torch:
        # Same sources under another code version (a commit that touched only docs or tests): retag.
        for img in client.images.list(name=STAGE_REPO, filters={"label": f"{SOURCE_LABEL}={digest}"}):
            img.tag(*tag.split(":", 1))
            log(f"{tag}: same sources as {img.tags[0] if img.tags else img.short_id}; tagged, not rebuilt")
            return tag
    base = base or build_base(client, log)
    with tempfile.TemporaryDirectory(prefix="lmyard-build-", dir=cache_dir()) as ctx:
        shutil.copy2(IMAGES / "Dockerfile", Path(ctx, "Dockerfile"))
        build_wheelhouse(Path(ctx, "wheels"), include_torch, log)
        build_own_wheel(Path(ctx, "lmyard-wheel"))
        log(f"docker build {tag} FROM {base}")
        _docker_build(
            client, ctx, tag, {"BASE_IMAGE": base, "CODE_VERSION": code_version(), "SOURCE_DIGEST": digest}, log
        )
    if ".src" in tag:  # a build of uncommitted sources replaces the earlier ones (~1.1 GB each)
        for img in client.images.list(name=STAGE_REPO):
            if img.tags and all(".src" in t and t != tag for t in img.tags):
                client.images.remove(img.id, force=True)
    return tag


def _docker_build(client, ctx: str, tag: str, buildargs: dict[str, str], log: Callable[[str], None]) -> None:
    """`docker build` of the context folder `ctx` as `tag`, its steps logged; the engine's old build stages dropped
    after it, whatever happens."""
    tail: collections.deque[str] = collections.deque(maxlen=5)
    try:
        for chunk in client.api.build(
            path=ctx, tag=tag, rm=True, forcerm=True, decode=True, pull=False, buildargs=buildargs
        ):
            if "error" in chunk:  # with the build's last lines (a RUN's own message, e.g. no torch in the base)
                raise RuntimeError(f"docker build failed: {chunk['error'].strip()}; last output: {' | '.join(tail)}")
            text = chunk.get("stream", "").rstrip()
            if text:
                tail.append(text)
            if text.startswith("Step "):
                log(text)
    finally:
        _drop_old_build_stages(client)


def push_image(tag: str, registry: str, log: Callable[[str], None] = print) -> str:
    """Push the local image `tag` as REGISTRY/<tag>; its digest reference REGISTRY/<repo>@sha256:... The
    registry's tag is dropped here afterwards (the local image keeps its own tag)."""
    import docker

    client = _client()
    repo, _, version = tag.rpartition(":")
    remote = f"{registry}/{repo}"
    client.images.get(tag).tag(remote, version)
    digest = None
    try:
        log(f"docker push {remote}:{version}")
        for chunk in client.api.push(remote, version, stream=True, decode=True):
            if "error" in chunk:
                raise UserError(f"push of {tag} to the registry {registry} failed: {_one_line(chunk['error'])}")
            digest = chunk.get("aux", {}).get("Digest", digest)
    except docker.errors.APIError as e:
        raise UserError(f"push of {tag} to the registry {registry} failed: {_one_line(e)}") from None
    finally:
        client.images.remove(f"{remote}:{version}")
    if digest is None:
        raise UserError(f"push of {tag} to the registry {registry}: the registry returned no digest")
    return f"{remote}@{digest}"


def _one_line(error) -> str:
    text = getattr(error, "explanation", None) or str(error)
    return " ".join(str(text).split())


def registry_of(ref: str) -> str | None:
    """The registry host of an image reference (`reg:5000/lmyard-stage@sha256:...`: reg:5000); None for a
    name without one (an image that only exists on the engines, or Docker Hub's)."""
    first, sep, _ = ref.partition("/")
    return first if sep and ("." in first or ":" in first or first == "localhost") else None


def ensure_images(
    clients: dict, ref: str, nodes: dict[str, list[int]], log: Callable[[str], None] = print
) -> tuple[str, dict]:
    """`ref` on every engine (clients by URL): an image from a registry pinned to the digest node 0's engine
    reads there, and pulled by that digest where missing, all engines at once. The pinned reference and each
    engine's image; an engine that cannot get it is one line naming its nodes, the engine and the registry."""
    import concurrent.futures

    first = next(iter(clients))
    ref = _pinned(clients[first], f"nodes {_nums(nodes[first])} on {first}", ref)
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        futures = {
            url: pool.submit(_ensure, client, f"nodes {_nums(nodes[url])} on {url}", ref, log)
            for url, client in clients.items()
        }
    return ref, {url: f.result() for url, f in futures.items()}  # the first engine's failure, in node order


def _nums(indices: list[int]) -> str:
    return ", ".join(map(str, indices))


def _pinned(client, where: str, ref: str) -> str:
    """`ref` by digest: as it is when it has one or no registry, else the digest its registry has for the tag."""
    import docker

    registry = registry_of(ref)
    if registry is None or "@" in ref:
        return ref
    try:
        data = client.images.get_registry_data(ref)
    except docker.errors.APIError as e:
        raise UserError(f"{where}: cannot read {ref} from the registry {registry}: {_one_line(e)}") from None
    return f"{ref.rpartition(':')[0] if ':' in ref.split('/')[-1] else ref}@{data.id}"


def _ensure(client, where: str, ref: str, log: Callable[[str], None]):
    """The image `ref` on one engine: there already, or pulled from its registry."""
    import docker

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        pass
    registry = registry_of(ref)
    if registry is None:
        raise UserError(
            f"image {ref} is not on the engine {where.partition(' on ')[2]}: build it there "
            "(python -m lmyard.launch.images build), push it to a registry (build --push REGISTRY, "
            "launch.docker.registry) or load it (docker save | docker load)"
        )
    log(f"{where}: pulling {ref}")
    try:
        return client.images.pull(ref)
    except docker.errors.APIError as e:
        raise UserError(f"{where}: cannot pull {ref} from the registry {registry}: {_one_line(e)}") from None


def _drop_old_build_stages(client) -> None:
    """Remove the build stages (untagged, labelled) but the newest: the engine's cache of the dependencies."""
    import docker

    stages = client.images.list(filters={"dangling": True, "label": BUILD_STAGE_LABEL})
    for img in sorted(stages, key=_created, reverse=True)[1:]:
        try:
            client.images.remove(img.id, force=True)
        except docker.errors.APIError:
            pass


def _created(img) -> tuple[str, str]:
    """Sort key of an image's creation time (RFC 3339 in UTC with 0-9 fraction digits)."""
    whole, _, frac = img.attrs["Created"].rstrip("Z").partition(".")
    return whole, frac.ljust(9, "0")


def prune(keep: int = 3, repo: str = STAGE_REPO, log: Callable[[str], None] = print) -> list[str]:
    """Remove all but the `keep` newest images of `repo`; returns the removed images' tags.

    Kept as well: the image this checkout runs (its tag may sit on an older image whose sources
    are unchanged) and any image a container, running or stopped, was made from.
    """
    if keep < 1:
        raise UserError(f"prune --keep {keep}: keep at least 1 image (the newest)")
    client = _client()
    in_use = {c.attrs["Image"] for c in client.containers.list(all=True)}
    current = image_tag() if repo == STAGE_REPO else None
    removed: list[str] = []
    for img in sorted(client.images.list(name=repo), key=_created, reverse=True)[keep:]:
        name = ", ".join(img.tags) or img.short_id
        if img.id in in_use or current in img.tags:
            log(f"keeping {name}: {'a container was made from it' if img.id in in_use else 'this checkout runs it'}")
            continue
        client.images.remove(img.id, force=True)  # force: every tag of this image goes with it
        removed.extend(img.tags or [img.short_id])
        log(f"removed {name} ({img.attrs['Size'] / 1e6:,.0f} MB)")
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmyard.launch.images", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the stage image (base and wheelhouse cached)")
    b.add_argument("--base", help=f"BASE_IMAGE (default: {BASE_IMAGE}, made here with debootstrap)")
    b.add_argument("--no-torch", action="store_true", help="keep the base image's torch (CUDA bases)")
    b.add_argument("--tag", help="image tag (default: from the code version)")
    b.add_argument("--force", action="store_true", help="rebuild even if the tag exists")
    b.add_argument("--push", metavar="REGISTRY", help="then push it to REGISTRY (host[:port]); prints its digest")
    sub.add_parser("tag", help="print the tag this checkout builds")
    pr = sub.add_parser("prune", help=f"remove all but the newest {STAGE_REPO} images (and those in use)")
    pr.add_argument("--keep", type=int, default=3, help="how many of the newest images to keep (default 3)")
    args = p.parse_args(argv)
    if args.command == "tag":
        print(image_tag())
        return 0
    if args.command == "prune":
        try:
            print(f"removed {len(prune(args.keep))} images")
        except UserError as e:
            p.error(str(e))
        return 0
    t0 = time.perf_counter()
    tag = build_image(args.tag, args.base, include_torch=not args.no_torch, force=args.force)
    size = _client().images.get(tag).attrs["Size"]
    print(f"{tag}: {size / 1e6:,.0f} MB, {time.perf_counter() - t0:.0f} s")
    if args.push:
        try:
            print(push_image(tag, args.push))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
