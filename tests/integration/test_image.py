"""compose/Dockerfile.worker's image, reproduced without Docker, serves a request.

No Docker engine runs where the tests run, so this follows the Dockerfile on
this machine, instruction by instruction: the files its COPY lines name go into
an ``/app`` of their own; root builds a wheel of them and installs it into a
fresh virtual environment (the worker extra's packages come, read-only, from the
development environment instead of PyPI); root runs the RUN that trains the demo
model; then ``conveyor worker`` runs as the image's USER (a uid with no rights
on any of those files) with the image's ENV, its WORKDIR and its CMD, and serves
a real request through the real Kafka broker and Redis. Image paths such as
``/opt/conveyor/models`` live under a temporary root folder.

The Dockerfile is parsed: an instruction this test does not reproduce fails it,
so the image and the test cannot drift apart.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from common.install import DISTRIBUTION
from demo.models.digits import DIGITS_VERSION, heldout_digits
from producers import AsyncClient, ClientSettings, Status
from producers.admin import create_model_topics
from tests.conftest import REPO
from workers.exits import EXIT_ENVIRONMENT

DOCKERFILE = REPO / "compose" / "Dockerfile.worker"
COMPOSE = REPO / "compose" / "docker-compose.yml"
# The Dockerfile's RUN lines, each reproduced below; a new one must be added here.
EXTRAS = ("worker", "s3", "tracing", "timm", "quant", "demo")
INSTALL = f"pip install '.[{','.join(EXTRAS)}]'"
BUILD_MODEL = "python -m demo.models.digits"
ADD_USER = "useradd --create-home --uid 10001 --user-group conveyor"

# One test process runs them all under pytest -n: the image's files are laid out once.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.xdist_group("image")]


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile that a worker image is made of."""

    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[list[str], str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    workdir: str = "/"
    user: tuple[int, int] = (0, 0)
    cmd: list[str] = field(default_factory=list)
    base: str = ""

    @classmethod
    def parse(cls, text: str) -> Dockerfile:
        image = cls()
        joined = re.sub(r"\\\n\s*", " ", text)
        for line in joined.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            word, _, rest = line.strip().partition(" ")
            rest = rest.strip()
            if word == "FROM":
                image.base = rest
            elif word == "ENV":
                image.env.update(_pair(item) for item in shlex.split(rest))
            elif word == "WORKDIR":
                image.workdir = rest
            elif word == "COPY":
                *sources, target = shlex.split(rest)
                image.copies.append((sources, target))
            elif word == "RUN":
                image.runs.append(rest)
            elif word == "USER":
                uid, _, gid = rest.partition(":")
                image.user = (int(uid), int(gid or uid))
            elif word == "CMD":
                image.cmd = json.loads(rest)
            else:
                raise AssertionError(f"{DOCKERFILE.name}: {word} is not reproduced by this test")
        return image


@dataclass
class Image:
    """The reproduced image: a root folder standing for /, and how to run in it."""

    dockerfile: Dockerfile
    root: Path
    python: Path  # the image's python3 (the virtual environment's)
    read_capability: bool  # see _needs_read_capability

    def path(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def env(self, **overrides: str) -> dict[str, str]:
        """The image's ENV, its paths moved under the root, as its USER gets it."""
        env = {
            key: str(self.path(value)) if value.startswith("/") else value
            for key, value in self.dockerfile.env.items()
        }
        env["PATH"] = f"{self.python.parent}:/usr/local/bin:/usr/bin:/bin"
        env["HOME"] = str(self.path("/home/conveyor"))
        return {**env, **overrides}

    def as_user(self, argv: list[str]) -> list[str]:
        """``argv`` run as the image's USER: no capability, no supplementary group."""
        uid, gid = self.dockerfile.user
        command = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        if self.read_capability:
            command += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        return [*command, *argv]


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    dockerfile = Dockerfile.parse(DOCKERFILE.read_text())
    assert dockerfile.runs == [INSTALL, BUILD_MODEL, ADD_USER], "reproduce the new RUN here"
    assert dockerfile.user[0] != 0, "the worker must not run as root"
    root = Path(tempfile.mkdtemp(prefix="conveyor-image-"))
    root.chmod(0o755)  # mkdtemp makes it private to root; the image's / is not
    try:
        yield _build(dockerfile, root)
    finally:
        shutil.rmtree(root)


def _build(dockerfile: Dockerfile, root: Path) -> Image:
    app = root / dockerfile.workdir.lstrip("/")
    app.mkdir(parents=True)
    for sources, target in dockerfile.copies:
        destination = app / target
        for source in sources:
            if (REPO / source).is_dir():  # a folder's contents go into the target folder
                ignore = shutil.ignore_patterns("__pycache__")  # as the .dockerignore says
                shutil.copytree(REPO / source, destination, ignore=ignore, dirs_exist_ok=True)
            else:
                shutil.copy2(REPO / source, destination)
    image = Image(dockerfile, root, root / "venv/bin/python", read_capability=False)
    # RUN pip install '.[worker,...]': a wheel of /app, installed by root. Its dependencies
    # are the development environment's (read-only for the worker), not PyPI's.
    wheels = root / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run([*pip_wheel, "--wheel-dir", str(wheels), "."], cwd=app)
    _run([_system_python(), "-m", "venv", str(root / "venv")], cwd=root)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(image.python), "-c", purelib], cwd=root).strip())
    folders = "".join(f"{folder}\n" for folder in _dependency_folders())
    (site / "development-dependencies.pth").write_text(folders)
    [wheel] = wheels.glob("*.whl")
    pip_install = [str(image.python), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    _run([*pip_install, str(wheel)], cwd=root)
    # RUN python -m demo.models.digits, as root, with the image's ENV.
    _run([str(image.python), *BUILD_MODEL.split()[1:]], cwd=app, env=image.env())
    # RUN useradd --create-home: the user's home is the only folder it owns.
    home = image.path("/home/conveyor")
    home.mkdir(parents=True)
    os.chown(home, *dockerfile.user)
    image.read_capability = _needs_read_capability(image)
    return image


def _dependency_folders() -> list[str]:
    """Where this environment keeps the distribution's dependencies, the image's extras'
    too."""
    folders = set()
    for line in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": e}) for e in EXTRAS):
            folders.add(str(metadata.distribution(requirement.name).locate_file("")))
    return sorted(folders)


def _system_python() -> str:
    """A python of this interpreter's version that any user may run (pyenv's is root's)."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = shutil.which(name, path="/usr/bin:/usr/local/bin")
    assert found, f"no /usr/bin/{name}: the image test runs the worker with the system's python"
    return found


def _needs_read_capability(image: Image) -> bool:
    """Whether the worker's uid needs CAP_DAC_READ_SEARCH to read the development packages.

    They stand in for the image's site-packages, which any user may read. When this
    checkout sits under a folder only root may enter (a CI clone in a private temporary
    folder), the capability lets the uid read them; it still cannot write anything.
    """
    torch_init = Path(str(metadata.distribution("torch").locate_file("torch/__init__.py")))
    check = subprocess.run(image.as_user(["test", "-r", str(torch_init)]), check=False)
    return check.returncode != 0


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done.stdout


def _compose_worker_env() -> dict[str, str]:
    worker = yaml.safe_load(COMPOSE.read_text())["services"]["worker"]
    return {key: str(value) for key, value in worker["environment"].items()}


def test_the_image_builds_the_model_and_nothing_is_writable(image: Image) -> None:
    models = image.path(image.dockerfile.env["CONVEYOR_MODEL_DIR"])
    artifact = models / f"{DIGITS_VERSION}.pt"
    assert artifact.is_file()
    assert artifact.stat().st_uid == 0
    venv = image.python.parent.parent
    for place in (models, venv, image.path(image.dockerfile.workdir)):
        probe = subprocess.run(image.as_user(["touch", str(place / "probe")]), check=False)
        assert probe.returncode != 0, f"the worker's user may write {place}"


@pytest.mark.integration
async def test_the_image_serves_a_request_as_its_unprivileged_user(
    image: Image,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    tmp_path: Path,
) -> None:
    await create_model_topics(client_settings, model_name, partitions=1)
    # Compose's worker environment, pointed at this machine's services, with this
    # test's own topics and a free metrics port on a shared broker and host.
    env = image.env(
        **{
            **_compose_worker_env(),
            "CONVEYOR_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "CONVEYOR_REDIS_URL": redis_url,
            "CONVEYOR_MODEL_NAME": model_name,
            "CONVEYOR_METRICS_PORT": "0",
            "CONVEYOR_DECODE_THREADS": "2",
        }
    )
    assert env["CONVEYOR_MODEL"] == "digits"
    log_path = tmp_path / "worker.log"
    worker = _start_worker(image, env, log_path)
    try:
        png, digit = heldout_digits()[0]
        async with AsyncClient(client_settings) as client:
            request_id = await client.submit(png, model=model_name)
            result = await client.wait(request_id, timeout=240)
        assert result.status is Status.ok, log_path.read_text()
        assert result.model_version == DIGITS_VERSION
        assert result.outputs[0]["label"] == str(digit)
        # Answered by that process (its default worker id), which runs as the image's user.
        assert result.worker == f"{socket.gethostname()}-{worker.pid}"
        assert _owner(worker.pid) == image.dockerfile.user[0]
    finally:
        worker.send_signal(signal.SIGTERM)
        status = worker.wait(60)
    assert status == 0, log_path.read_text()


def _pair(item: str) -> tuple[str, str]:
    """``NAME=value`` as (name, value)."""
    name, _, value = item.partition("=")
    return name, value


def _start_worker(image: Image, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The image's CMD as its USER, in its WORKDIR, logging to ``log_path``.

    Not producers.testing's WorkerProcess: what is under test is the image's own command
    line, configured by the environment alone, as Compose and Kubernetes run it."""
    with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            image.as_user(image.dockerfile.cmd),
            cwd=image.path(image.dockerfile.workdir),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _owner(pid: int) -> int:
    return Path(f"/proc/{pid}").stat().st_uid


async def test_an_unwritable_model_folder_fails_in_one_line(
    image: Image,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    await create_model_topics(client_settings, model_name, partitions=1)
    empty = image.path("/opt/conveyor/empty")
    empty.mkdir(parents=True)  # root's, and without the model
    env = image.env(
        **{
            **_compose_worker_env(),
            "CONVEYOR_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "CONVEYOR_REDIS_URL": redis_url,
            "CONVEYOR_MODEL_NAME": model_name,
            "CONVEYOR_MODEL_DIR": str(empty),
            "CONVEYOR_METRICS_PORT": "0",
        }
    )
    done = await asyncio.to_thread(
        subprocess.run,
        image.as_user(image.dockerfile.cmd),
        cwd=image.path(image.dockerfile.workdir),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_ENVIRONMENT, done.stderr
    assert "Traceback" not in done.stderr
    *_log_lines, line = done.stderr.splitlines()  # the failure is one line, the last
    assert line.startswith(f"conveyor worker: cannot write the demo model to {empty}")
    assert "set CONVEYOR_MODEL_DIR to a folder this user may write" in line
    assert f"the worker runs as uid {image.dockerfile.user[0]}" in line
