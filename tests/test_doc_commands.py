"""Every command in a ```bash block of README.md, docs/*.md and launchers/*.md is real: a
`python train.py` (or `hcp-train`, `torchrun ... train.py`, `python -m hcp.launch.sbatch`) command
composes and passes validation for the world it would start, a script or benchmark it names
exists and knows every `--flag` it is given, and `pip install` extras exist. A command of any
other kind fails the test, so a page cannot show one nobody checks."""
import glob
import os
import re
import shlex
import tomllib

import pytest

from cfg_utils import REPO

PAGES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md")),
         *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/launchers/*.md"))]
"""The pages whose ```bash blocks are parsed (paths relative to the repository)."""

ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _lines(block: str):
    """The block's command lines: continuations joined, comments dropped, `$VAR`s of the block's
    own assignments (`V=/models/x MODEL="..."`) substituted as bash would before word splitting."""
    env = {}
    for line in block.replace("\\\n", " ").split("\n"):
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), line)
        words = shlex.split(line, comments=True)
        if words and all(ASSIGN.match(w) for w in words):
            env.update(w.split("=", 1) for w in words)
        elif words:
            expanded = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), line)
            yield shlex.split(expanded, comments=True)


def commands() -> list[tuple[str, list[str]]]:
    """(page, words) of every command in the pages' bash blocks; `a && b` gives two."""
    found = []
    for page in PAGES:
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for words in _lines(block):
                while "&&" in words:
                    i = words.index("&&")
                    found.append((page, words[:i]))
                    words = words[i + 1:]
                found.append((page, words))
    return found


def _first_of_each_sweep(overrides: list[str]) -> list[str]:
    """A sweep's first job: `a=1,2` -> `a=1` (Hydra's own parser)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for raw, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if parsed.is_sweep_override():
            raw = f"{raw.split('=', 1)[0]}={next(parsed.sweep_string_iterator())}"
        out.append(raw)
    return out


GPU_NODE = 8
"""GPUs of the node a GPU command is meant for (`launcher.nproc_per_node=auto` there)."""


def check_train(overrides: list[str], tmp_path) -> None:
    """Compose and validate `python train.py OVERRIDES` as the entry does, for the world it
    starts here (`auto`: 4 CPU ranks) or, failing that, on one 8-GPU node (the LLaVA-1.5
    commands at `llm.layout.tp=8`). A command that imports a Hugging Face checkpoint absent here
    (`llm.init_from=/models/...`) is only composed: its architecture comes from that
    checkpoint's config.json. One that names an optional GPU backend missing here (Transformer
    Engine) validates up to that backend's check."""
    from hcp.config.compose import compose_config
    from hcp.config.errors import ConfigError
    from hcp.config.layouts import world_size_of
    from hcp.config.validate import validate
    from hcp.launch.launch import resolve_nproc

    if overrides[:1] == ["-m"]:
        overrides = _first_of_each_sweep(overrides[1:])
    overrides = [o for o in overrides if not o.startswith(("hydra/launcher=", "hydra."))]
    cfg = compose_config(overrides, run_dir=str(tmp_path))
    if any(o.split("=")[0].endswith(".init_from") and not os.path.exists(o.split("=", 1)[1])
           for o in overrides):
        return
    try:
        validate(cfg, world_size_of(cfg, resolve_nproc("auto")))
    except ConfigError as here:
        if "package is not installed" in str(here):  # an optional GPU backend (TE) absent here
            return
        try:
            validate(cfg, world_size_of(cfg, GPU_NODE))
        except ConfigError:
            raise here from None


def check_script(words: list[str]) -> None:
    """`python PATH ARGS`: PATH exists and every `--flag` of ARGS appears in its source (or, for a
    benchmark built on `benchmarks/harness.arg_parser`, is one of the shared flags it adds)."""
    path = os.path.join(REPO, words[0])
    assert os.path.isfile(path), f"{words[0]} does not exist"
    with open(path) as f:
        source = f.read()
    shared = {"--help"}
    if "arg_parser(" in source:
        with open(os.path.join(REPO, "benchmarks", "harness.py")) as f:
            shared |= set(re.findall(r'"(--[a-z-]+)"', f.read()))
    for flag in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
        assert f'"{flag}"' in source or flag in shared, f"{words[0]} has no option {flag}"


def check_pip(words: list[str]) -> None:
    """`pip install [-e] .[EXTRA,...]`: every extra is declared in pyproject.toml."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    target = words[-1]
    assert target.startswith("."), words
    for extra in re.findall(r"\[(.*)\]", target)[0].split(",") if "[" in target else []:
        assert extra.strip('"') in extras, f"no extra {extra} in pyproject.toml"


def check(words: list[str], tmp_path) -> None:
    """Check one command (see the module docstring); an unknown kind fails."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # `VAR=value command`
        words = words[1:]
    if words[0] in ("python", "python3") and words[1:2] == ["train.py"]:
        if {"--help", "--hydra-help"} & set(words):  # tests/test_first_hour.py runs them
            return None
        return check_train(words[2:], tmp_path)
    if words[0] == "hcp-train":
        return check_train(words[1:], tmp_path)
    if words[0] in ("torchrun", "srun") and "train.py" in words:
        return check_train(words[words.index("train.py") + 1:], tmp_path)
    if words[:3] == ["python", "-m", "hcp.launch.sbatch"]:
        from hcp.launch.sbatch import main

        assert main(["--dry-run", *(w for w in words[3:] if w != "--dry-run")]) == 0
        return None
    if words[0] == "python" and words[1].endswith(".py"):
        return check_script(words[1:])
    if words[:3] == ["python", "-m", "benchmarks"]:  # one entry for every benchmark
        assert os.path.isfile(os.path.join(REPO, "benchmarks", "__main__.py")), words
        if len(words) == 3:  # the list of benchmarks
            return None
        script = f"benchmarks/{words[3]}.py"
        return check_script([script, *words[4:]] if os.path.isfile(os.path.join(REPO, script))
                            else ["benchmarks/__main__.py", *words[4:]])
    if words[0] == "bash":
        assert os.path.isfile(os.path.join(REPO, words[1])), f"{words[1]} does not exist"
        return None
    if words[:2] == ["pip", "install"]:
        return check_pip(words)
    if words[1:3] == ["-m", "venv"] or words[0] in (".", "source", "cd"):
        return None
    raise AssertionError(f"a command no test checks: {shlex.join(words)}")


ALL = commands()


def test_every_page_is_parsed_and_the_readme_keeps_its_two_commands():
    pages = {page for page, _ in ALL}
    assert {"README.md", "docs/layouts.md", "docs/planning.md", "docs/dynamic_cp.md",
            "docs/rehearsal.md", "docs/launching.md", "docs/benchmarks.md",
            "docs/data_and_models.md"} <= pages, pages
    readme = [words for page, words in ALL if page == "README.md"]
    for command in (["bash", "scripts/setup.sh"], ["python", "train.py"],
                    ["bash", "scripts/test.sh"], ["python", "-m", "venv", ".venv"]):
        assert command in readme, command


def test_a_wrong_command_fails_its_check(tmp_path):
    from hcp.config.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.max_steps"):
        check(["python", "train.py", "trainer.max_step=3"], tmp_path)
    with pytest.raises(ConfigError, match="llm.layout.tp"):  # composes, breaks a rule
        check(["python", "train.py", "+recipe=llama_tiny", "llm.layout.tp=3"], tmp_path)
    with pytest.raises(AssertionError, match="has no option --no-such-flag"):
        check(["python", "benchmarks/layouts.py", "--no-such-flag"], tmp_path)
    with pytest.raises(AssertionError, match="no extra nope"):
        check(["pip", "install", "-e", ".[nope]"], tmp_path)
    with pytest.raises(AssertionError, match="a command no test checks"):
        check(["make", "all"], tmp_path)


@pytest.mark.parametrize("page, words", ALL, ids=[f"{p}:{' '.join(w)[:60]}" for p, w in ALL])
def test_the_command_is_real(page, words, tmp_path):
    check(words, tmp_path)
