"""docker/Dockerfile is correct on paper: fast checks of its text, no docker needed (the image is not built here).

The Dockerfile is parsed (line continuations joined, comment lines dropped, ``${NAME}`` replaced by the defaults of
its ARG and ENV instructions) and these must hold:

- every FROM names its image by a version tag (``13.0.2-devel-...``; not ``latest``, not untagged) or a digest;
- every ``pip install`` names each package with an exact ``==`` version, or installs the local project (``.``);
  requirement files are refused, since their pins cannot be checked here;
- torch is installed from the download.pytorch.org index of the base image's CUDA (``13.0.x-devel`` <-> ``cu130``),
  in an earlier ``pip install`` than the local project; flash-attn is built with ``--no-build-isolation`` and a
  numeric ``MAX_JOBS`` build ARG;
- the image's last USER is not root (by name or uid 0) and comes after the last RUN that needs root (apt, user
  and ownership changes, mkdir, pip into the root-owned environment);
- no ENV or ARG name looks like a credential (a TOKEN, SECRET, KEY, PASSWORD or CREDENTIAL part) and no text
  looks like a literal token (``hf_...``, ``ghp_...``, ``sk-...``, ``AKIA...``);
- every COPY/ADD source exists in the repository (the build context) and is not excluded by .dockerignore;
- the JSON-form CMD parses, and the code of its ``python -c`` compiles;
- .dockerignore excludes .venv, runs/ and .git; docker/README.md states the pinned versions and names the
  launchers it documents (scripts/launch.sh, scripts/slurm/train.sbatch), which exist.

Each check is a function that returns a list of problems for a Dockerfile text; the tests run each on the real
file (no problem) and on mutated copies (at least one problem), so that every check is seen to fail.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
DOCKER_README = REPO / "docker" / "README.md"


# --- parsing -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    args: str  # the rest of the instruction, continuations joined, variables not yet substituted
    line: int  # 1-based line of the instruction's first line


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. A trailing backslash joins the next line (as docker does, without the newline);
    comment lines are dropped, also inside a continued instruction."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not parts and not stripped):
            continue
        if not parts:
            start = number
        line = raw.rstrip()
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        parts.append(line)
        keyword, _, args = "".join(parts).strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    if parts:
        raise ValueError(f"line {start}: the last instruction ends with a continuation")
    return instructions


_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def substitute(text: str, values: dict[str, str]) -> str:
    """``${NAME}``, ``${NAME:-default}`` and ``$NAME`` replaced from ``values``; unknown names are left as they are."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        if name in values:
            return values[name]
        return match.group(2) if match.group(2) is not None else match.group(0)

    return _VARIABLE.sub(one, text)


def _pairs(args: str) -> list[tuple[str, str | None]]:
    """``NAME=value`` pairs of an ARG or ENV instruction (``ENV NAME value``, the old form, too)."""
    words = shlex.split(args)
    if words and "=" not in words[0] and len(words) > 1:  # ENV NAME value
        return [(words[0], " ".join(words[1:]))]
    return [(name, value if sep else None) for name, sep, value in (word.partition("=") for word in words)]


def variables(instructions: list[Instruction]) -> dict[str, str]:
    """The defaults of every ARG and the values of every ENV (later ones win; ARGs without default are absent)."""
    values: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword in ("ARG", "ENV"):
            for name, value in _pairs(ins.args):
                if value is not None:
                    values[name] = substitute(value, values)
    return values


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions of the last stage (the image that is run), from its FROM on."""
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    return instructions[starts[-1] :] if starts else []


_SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")


@dataclass(frozen=True)
class Command:
    words: list[str]  # the command and its arguments, variables substituted
    env: dict[str, str]  # leading NAME=value assignments
    run: Instruction


def shell_commands(ins: Instruction, values: dict[str, str]) -> list[Command]:
    """The simple commands of a RUN instruction, split at ``&&``, ``||``, ``;`` and pipes (quotes respected)."""
    if ins.args.startswith("["):
        groups = [json.loads(ins.args)]
    else:
        lexer = shlex.shlex(ins.args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        groups, current = [], []
        for token in lexer:
            if token in _SEPARATORS:
                groups.append(current)
                current = []
            else:
                current.append(token)
        groups.append(current)
    commands = []
    for group in groups:
        words = [substitute(word, values) for word in group]
        env = {}
        while words and _ASSIGNMENT.fullmatch(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            commands.append(Command(words, env, ins))
    return commands


# --- pip ------------------------------------------------------------------------------------------------------------

_PIP_OPTIONS_WITH_VALUE = {
    "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-t", "--target",
    "--prefix", "--root", "--python", "-C", "--config-settings", "--platform", "--python-version", "--abi",
    "--implementation", "--src", "--upgrade-strategy", "--progress-bar", "--no-binary", "--only-binary",
    "--trusted-host", "--cache-dir", "--log", "--proxy", "--retries", "--timeout", "--exists-action", "--cert",
    "--client-cert", "--report", "--root-user-action", "--use-feature", "--use-deprecated", "--keyring-provider",
    "--global-option", "--build-option",
}  # fmt: skip
_REQUIREMENT_FILE_OPTIONS = {"-r", "--requirement"}
_PINNED = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9,._-]+\])?==([0-9][0-9A-Za-z.+!-]*)")
_LOCAL = re.compile(r"\.{1,2}(/[^\[\]\s]*)?(\[[A-Za-z0-9,._-]+\])?")


@dataclass(frozen=True)
class PipInstall:
    command: Command
    options: dict[str, str]  # options with a value (last one wins)
    flags: set[str]
    requirements: list[str]  # as written (variables substituted)
    local: list[str]  # local project paths (``.``, ``-e .[extra]``)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_installs(instructions: list[Instruction]) -> list[PipInstall]:
    """Every ``pip install`` (``pip``, ``pip3``, ``python -m pip``) of every RUN, in order."""
    values = variables(instructions)
    installs = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for command in shell_commands(ins, values):
            words = command.words
            if Path(words[0]).name in ("pip", "pip3") and words[1:2] == ["install"]:
                args = words[2:]
            elif Path(words[0]).name.startswith("python") and words[1:4] == ["-m", "pip", "install"]:
                args = words[4:]
            else:
                continue
            options: dict[str, str] = {}
            flags: set[str] = set()
            requirements: list[str] = []
            local: list[str] = []
            it = iter(args)
            for arg in it:
                if arg in ("-e", "--editable"):
                    local.append(next(it, ""))
                elif arg in _REQUIREMENT_FILE_OPTIONS or arg in _PIP_OPTIONS_WITH_VALUE:
                    options[arg] = next(it, "")
                elif arg.startswith("--") and "=" in arg:
                    name, _, value = arg.partition("=")
                    options[name] = value
                elif arg.startswith("-"):
                    flags.add(arg)
                elif _LOCAL.fullmatch(arg):
                    local.append(arg)
                else:
                    requirements.append(arg)
            installs.append(PipInstall(command, options, flags, requirements, local))
    return installs


def _names(install: PipInstall) -> set[str]:
    return {canonical(m.group(1)) for r in install.requirements if (m := _PINNED.fullmatch(r))}


# --- checks: each returns a list of problems ------------------------------------------------------------------------


def from_problems(text: str) -> list[str]:
    instructions = parse_dockerfile(text)
    values = variables(instructions)
    problems, stages = [], {"scratch"}
    for ins in instructions:
        if ins.keyword != "FROM":
            continue
        words = [w for w in ins.args.split() if not w.startswith("--")]
        image = substitute(words[0], values) if words else ""
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2])
        where = f"line {ins.line}: FROM {image or '(nothing)'}"
        if image in stages:
            continue
        if not image or "$" in image:
            problems.append(f"{where}: the image is not resolved (an ARG without default?)")
        elif "@sha256:" in image:
            continue
        else:
            last = image.rsplit("/", 1)[-1]
            tag = last.partition(":")[2]
            if not tag:
                problems.append(f"{where}: no tag (docker takes latest)")
            elif tag == "latest" or not re.search(r"\d+\.\d+", tag):
                problems.append(f"{where}: the tag {tag!r} is not a version")
    if not any(ins.keyword == "FROM" for ins in instructions):
        problems.append("no FROM")
    return problems


def pip_pin_problems(text: str) -> list[str]:
    problems = []
    for install in pip_installs(parse_dockerfile(text)):
        where = f"line {install.command.run.line}: pip install"
        for option in _REQUIREMENT_FILE_OPTIONS & set(install.options):
            problems.append(f"{where}: {option} {install.options[option]} (pins in a file are not checked)")
        for requirement in install.requirements:
            if "$" in requirement:
                problems.append(f"{where}: {requirement!r} has an unresolved variable (an ARG without default?)")
            elif not _PINNED.fullmatch(requirement):
                problems.append(f"{where}: {requirement!r} is not pinned with an exact == version")
        for path in install.local:
            if not _LOCAL.fullmatch(path):
                problems.append(f"{where}: -e {path!r} is not the local project")
        if not install.requirements and not install.local:
            problems.append(f"{where}: installs nothing")
    return problems


def _cuda_version(text: str) -> tuple[str, str] | None:
    instructions = parse_dockerfile(text)
    values = variables(instructions)
    stage = final_stage(instructions)
    if not stage:
        return None
    image = substitute(stage[0].args.split()[0], values)
    match = re.fullmatch(r"(?:[\w.-]+/)*cuda:(\d+)\.(\d+)\.\d+-(?:[\w.]+-)*devel-ubuntu[\d.]+", image)
    return (match.group(1), match.group(2)) if match else None


def torch_problems(text: str) -> list[str]:
    problems = []
    cuda = _cuda_version(text)
    if cuda is None:
        problems.append("the base image is not an nvidia/cuda X.Y.Z-...devel-ubuntu image (nvcc builds flash-attn)")
    installs = pip_installs(parse_dockerfile(text))
    torch_at = next((i for i, inst in enumerate(installs) if "torch" in _names(inst)), None)
    project_at = next((i for i, inst in enumerate(installs) if inst.local), None)
    if torch_at is None:
        problems.append("torch is never installed with a pinned version")
    if project_at is None:
        problems.append("the local project is never installed")
    if torch_at is not None and project_at is not None and torch_at >= project_at:
        problems.append("torch is not installed before the local project (in an earlier pip install)")
    if torch_at is not None:
        torch = installs[torch_at]
        index = torch.options.get("--index-url") or torch.options.get("-i") or ""
        match = re.fullmatch(r"https://download\.pytorch\.org/whl/(cu\d+)/?", index)
        if not match:
            problems.append(f"torch is not installed from a download.pytorch.org CUDA index (--index-url {index!r})")
        elif cuda is not None and match.group(1) != f"cu{cuda[0]}{cuda[1]}":
            problems.append(f"torch index {match.group(1)} does not match the base image's CUDA {'.'.join(cuda)}")
    return problems


def flash_attn_problems(text: str) -> list[str]:
    instructions = parse_dockerfile(text)
    args = {name: value for ins in instructions if ins.keyword == "ARG" for name, value in _pairs(ins.args)}
    installs = [inst for inst in pip_installs(instructions) if "flash-attn" in _names(inst)]
    problems = []
    if not installs:
        problems.append("flash-attn is not installed with a pinned version")
    if not (args.get("MAX_JOBS") or "").isdigit():
        problems.append("no build ARG MAX_JOBS with a numeric default")
    for install in installs:
        where = f"line {install.command.run.line}: flash-attn"
        if "--no-build-isolation" not in install.flags:
            problems.append(f"{where}: not built with --no-build-isolation (it must compile against the torch here)")
        if "MAX_JOBS" not in install.command.env and "MAX_JOBS" not in args:
            problems.append(f"{where}: MAX_JOBS is not set for the build")
    return problems


_NEEDS_ROOT = re.compile(
    r"(?<![\w-])(apt-get|apt|dpkg|useradd|userdel|usermod|groupadd|groupmod|chown|chgrp|chmod|mkdir|ldconfig"
    r"|update-alternatives)(?![\w-])|pip3?\s+install"
)


def user_problems(text: str) -> list[str]:
    instructions = parse_dockerfile(text)
    values = variables(instructions)
    stage = final_stage(instructions)
    users = [(i, substitute(ins.args, values).strip()) for i, ins in enumerate(stage) if ins.keyword == "USER"]
    if not users:
        return ["no USER instruction: the image runs as root"]
    at, user = users[-1]
    name = user.split(":")[0]
    problems = []
    if name in ("root", "0") or "$" in name or not name:
        problems.append(f"the last USER is {user!r}: root, or not resolved")
    root_runs = [i for i, ins in enumerate(stage) if ins.keyword == "RUN" and _NEEDS_ROOT.search(ins.args)]
    if root_runs and root_runs[-1] > at:
        problems.append(f"line {stage[root_runs[-1]].line}: a RUN that needs root comes after the last USER")
    return problems


_SECRET_PARTS = ("TOKEN", "TOKENS", "SECRET", "SECRETS", "KEY", "KEYS", "PASSWORD", "PASSWD", "CREDENTIAL")
_LITERAL_TOKEN = re.compile(
    r"\b(hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16})"
)


def looks_like_secret(name: str) -> bool:
    parts = [part for part in re.split(r"[^A-Z0-9]+", name.upper()) if part]
    return any(part in _SECRET_PARTS or part.endswith(("TOKEN", "SECRET", "PASSWORD", "APIKEY")) for part in parts)


def secret_problems(text: str) -> list[str]:
    problems = []
    for ins in parse_dockerfile(text):
        if ins.keyword in ("ARG", "ENV"):
            for name, _ in _pairs(ins.args):
                if looks_like_secret(name):
                    problems.append(f"line {ins.line}: {ins.keyword} {name} looks like a credential")
    for number, line in enumerate(text.splitlines(), 1):
        if _LITERAL_TOKEN.search(line):
            problems.append(f"line {number}: looks like a literal token")
    return problems


def dockerignore_patterns(text: str) -> list[str]:
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex on paths relative to the context."""
    pattern = pattern.strip("/").removeprefix("./")
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i:]:
            end = pattern.index("]", i)
            out.append("[" + pattern[i + 1 : end].replace("!", "^", 1) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def is_excluded(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` (relative to the build context) is left out of the context: it, or a directory above it,
    matches the last matching pattern, unless that one is a ``!`` exception."""
    parts = Path(path.strip("/")).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern[1:] if negated else pattern)
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def copy_problems(text: str, context: Path, ignore_text: str) -> list[str]:
    instructions = parse_dockerfile(text)
    values = variables(instructions)
    patterns = dockerignore_patterns(ignore_text)
    problems = []
    for ins in instructions:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
        if any(word.startswith("--from") for word in words):
            continue  # from another stage or image, not from the context
        paths = [substitute(word, values) for word in words if not word.startswith("--")]
        if len(paths) < 2:
            problems.append(f"line {ins.line}: {ins.keyword} needs a source and a destination")
            continue
        for source in paths[:-1]:
            where = f"line {ins.line}: {ins.keyword} {source}"
            if re.match(r"[a-z]+://", source):
                problems.append(f"{where}: a download, not a file of the repository")
                continue
            relative = source.strip("/").removeprefix("./") or "."
            wildcard = any(char in relative for char in "*?[")
            if not (context / relative).exists() and not (wildcard and list(context.glob(relative))):
                problems.append(f"{where}: not in the repository")
            elif is_excluded(relative, patterns):
                problems.append(f"{where}: excluded by .dockerignore")
    return problems


def cmd_problems(text: str) -> list[str]:
    stage = final_stage(parse_dockerfile(text))
    commands = [ins for ins in stage if ins.keyword == "CMD"]
    if not commands:
        return []
    ins = commands[-1]
    try:
        words = json.loads(ins.args)
    except json.JSONDecodeError as error:
        return [f"line {ins.line}: CMD is not valid JSON ({error})"]
    if not (isinstance(words, list) and all(isinstance(word, str) for word in words)):
        return [f"line {ins.line}: CMD is not a list of strings"]
    if len(words) >= 3 and words[0].startswith("python") and words[1] == "-c":
        try:
            compile(words[2], "CMD", "exec")
        except SyntaxError as error:
            return [f"line {ins.line}: the python -c code of CMD does not compile ({error})"]
    return []


def all_problems(text: str, context: Path = REPO, ignore_text: str | None = None) -> list[str]:
    if ignore_text is None:
        ignore_text = DOCKERIGNORE.read_text()
    return (
        from_problems(text)
        + pip_pin_problems(text)
        + torch_problems(text)
        + flash_attn_problems(text)
        + user_problems(text)
        + secret_problems(text)
        + copy_problems(text, context, ignore_text)
        + cmd_problems(text)
    )


# --- tests on the real files ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_parser_joins_continuations_and_drops_comments():
    text = "# syntax=docker/dockerfile:1\nARG A=1\nRUN echo a \\\n# inside\n    && echo b\n\nUSER 1000\n"
    instructions = parse_dockerfile(text)
    assert [(i.keyword, i.line) for i in instructions] == [("ARG", 2), ("RUN", 3), ("USER", 7)]
    assert instructions[1].args == "echo a     && echo b"
    assert substitute("x${A}y$A${B:-z}", variables(instructions)) == "x1y1z"


def test_dockerfile_parses(dockerfile):
    keywords = {ins.keyword for ins in parse_dockerfile(dockerfile)}
    assert {"FROM", "RUN", "COPY", "USER", "WORKDIR", "CMD"} <= keywords


@pytest.mark.parametrize(
    "check",
    [from_problems, pip_pin_problems, torch_problems, flash_attn_problems, user_problems, secret_problems,
     cmd_problems],
)  # fmt: skip
def test_dockerfile_check(dockerfile, check):
    assert check(dockerfile) == []


def test_dockerfile_copies_existing_files_kept_by_dockerignore(dockerfile):
    assert copy_problems(dockerfile, REPO, DOCKERIGNORE.read_text()) == []


def test_every_pip_install_is_seen(dockerfile):
    installs = pip_installs(parse_dockerfile(dockerfile))
    names = set().union(*(_names(install) for install in installs))
    assert {"pip", "setuptools", "torch", "flash-attn"} <= names
    assert sum(bool(install.local) for install in installs) == 1


def test_dockerignore_excludes_local_state():
    patterns = dockerignore_patterns(DOCKERIGNORE.read_text())
    for path in (".venv", ".venv/bin/python", "runs", "runs/tiny_cpu/checkpoints/step_100", ".git", ".whl/x.whl"):
        assert is_excluded(path, patterns), path
    for path in ("lctrain/cli.py", "configs/train.yaml", "recipes/x.yaml", "scripts/launch.sh"):
        assert not is_excluded(path, patterns), path


def test_readme_states_the_pins_and_the_launchers(dockerfile):
    readme = DOCKER_README.read_text()
    values = variables(parse_dockerfile(dockerfile))
    for name in ("CUDA_IMAGE", "TORCH_VERSION", "TORCH_CUDA", "FLASH_ATTN_VERSION"):
        assert values[name] in readme, f"docker/README.md does not state {name}={values[name]}"
    for script in ("scripts/launch.sh", "scripts/slurm/train.sbatch"):
        assert script in readme
        assert (REPO / script).is_file(), script


# --- the checks fail on broken copies -------------------------------------------------------------------------------


def _replace(old: str, new: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        assert old in text, f"the mutation's text is not in the Dockerfile: {old!r}"
        return text.replace(old, new)

    return mutate


def _move_block(start: str, before: str) -> Callable[[str], str]:
    """Move the paragraph that begins with ``start`` (up to the next blank line) to just before ``before``."""

    def mutate(text: str) -> str:
        i = text.index(start)
        j = text.index("\n\n", i) + 2
        block, rest = text[i:j], text[:i] + text[j:]
        k = rest.index(before)
        return rest[:k] + block + rest[k:]

    return mutate


_TORCH_RUN = 'RUN python -m pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"'
_USER = "USER ${USER_UID}:${USER_GID}"

MUTATIONS = {
    "latest tag": (_replace("nvidia/cuda:13.0.2-devel-ubuntu24.04", "nvidia/cuda:latest"), "not a version"),
    "no tag": (_replace("nvidia/cuda:13.0.2-devel-ubuntu24.04", "nvidia/cuda"), "no tag"),
    "unresolved base": (_replace("ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04", "ARG CUDA_IMAGE"), "FROM"),
    "runtime base": (_replace("13.0.2-devel-ubuntu24.04", "13.0.2-runtime-ubuntu24.04"), "devel"),
    "range pin": (_replace('"einops==${EINOPS_VERSION}"', '"einops>=0.8"'), "einops>=0.8"),
    "unpinned": (_replace('"psutil==${PSUTIL_VERSION}"', "psutil"), "'psutil' is not pinned"),
    "pin without default": (_replace("ARG NINJA_VERSION=1.13.2", "ARG NINJA_VERSION"), "unresolved variable"),
    "requirements file": (_replace('"einops==${EINOPS_VERSION}"', "-r requirements.txt"), "-r requirements.txt"),
    "torch after project": (_move_block(_TORCH_RUN, _USER), "before the local project"),
    "torch from PyPI": (_replace('--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"', ""), "index"),
    "torch index of another CUDA": (_replace("ARG TORCH_CUDA=cu130", "ARG TORCH_CUDA=cu126"), "does not match"),
    "flash-attn isolated": (
        _replace('--no-build-isolation --no-deps "flash-attn', '--no-deps "flash-attn'),
        "--no-build-isolation",
    ),
    "no MAX_JOBS": (_replace("ARG MAX_JOBS=4", "ARG MAX_JOBS"), "MAX_JOBS"),
    "no USER": (_replace(_USER, ""), "no USER"),
    "USER root": (_replace(_USER, "USER root"), "root"),
    "USER uid 0": (_replace(_USER, "USER 0:0"), "root"),
    "USER too early": (_move_block(_USER, "WORKDIR /workspace"), "needs root"),
    "token ARG": (_replace("ARG USER_NAME=lctrain", "ARG USER_NAME=lctrain\nARG HF_TOKEN"), "HF_TOKEN"),
    "api key ENV": (_replace("OMP_NUM_THREADS=1 \\", "OMP_NUM_THREADS=1 WANDB_API_KEY=x \\"), "WANDB_API_KEY"),
    "literal token": (_replace("OMP_NUM_THREADS=1 \\", "OMP_NUM_THREADS=1 X=hf_" + "a1" * 17 + " \\"), "literal"),
    "missing source": (_replace("COPY tests/ tests/", "COPY tests/ tests/\nCOPY data/ data/"), "not in the repo"),
    "ignored source": (_replace("COPY tests/ tests/", "COPY tests/ tests/\nCOPY docs/ docs/"), "dockerignore"),
    "download": (_replace("COPY tests/ tests/", "COPY tests/ tests/\nADD https://x.org/a.tgz /a"), "download"),
    "CMD not JSON": (_replace('CMD ["python", "-c", "import', 'CMD ["python", "-c" "import'), "JSON"),
    "CMD python broken": (_replace("flash_attn.__version__, \\", "flash_attn.__version__,, \\"), "compile"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_checks_fail_on_a_broken_dockerfile(dockerfile, name):
    mutate, expected = MUTATIONS[name]
    problems = all_problems(mutate(dockerfile))
    assert problems, f"{name}: no problem found"
    assert any(expected in problem for problem in problems), f"{name}: {problems}"


def test_dockerignore_check_fails_without_the_patterns():
    patterns = [p for p in dockerignore_patterns(DOCKERIGNORE.read_text()) if p not in ("runs", ".venv")]
    assert not is_excluded("runs/tiny_cpu", patterns)
    assert not is_excluded(".venv", patterns)
    assert not is_excluded("runs", [*patterns, "runs", "!runs"])
