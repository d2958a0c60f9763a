"""``docs/gen_api.py``: the API reference is generated from the docstrings of the public names."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "docs", "gen_api.py")

# Public names whose docstrings do not give their TF name yet (their modules are owned by other
# work in progress). Remove a name once its docstring has a "TF name:" line: the test below
# fails when an entry here is no longer needed.
PENDING: set[str] = set()


def load_gen_api() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_writes_a_section_for_every_public_name(tmp_path):
    out = tmp_path / "api.md"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, SCRIPT, "-o", str(out)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    gen_api = load_gen_api()
    modules = gen_api.public_modules()
    assert {m.__name__ for m in modules} >= {
        "torchsupervisor",
        "torchsupervisor.summary",
        "torchsupervisor.errors",
    }
    for module in modules:
        assert f"\n## {module.__name__}\n" in text
        for name in module.__all__:
            assert f"### `{module.__name__}.{name}`" in text, name
    # Signatures and docstrings, rendered as Markdown.
    assert "class Saver(var_list=None, reshape=False, sharded=False" in text
    assert "#### `Supervisor.managed_session`" in text
    assert "Alias of [`SummaryWriter`](#torchsupervisorsummarywriter)." in text
    assert "- `logdir`: The directory for the events file; created if missing." in text


def test_every_public_name_has_a_docstring_with_its_tf_name():
    problems = load_gen_api().problems()
    missing = {p.split(":")[0] for p in problems}
    unexpected = [p for p in problems if p.split(":")[0] not in PENDING]
    assert not unexpected, "\n".join(unexpected)
    assert missing >= PENDING, f"fixed, remove from PENDING: {sorted(PENDING - missing)}"


def test_problems_finds_missing_docstrings_and_tf_names(monkeypatch):
    gen_api = load_gen_api()

    def Saver():
        pass

    def helper():
        """Do something TF never had."""

    def merge():
        """Merge summaries."""

    for fn in (Saver, helper, merge):
        fn.__module__ = "torchsupervisor.fake"
    fake = types.ModuleType("torchsupervisor.fake")
    fake.__all__ = ["Saver", "helper", "merge"]
    fake.Saver, fake.helper, fake.merge = Saver, helper, merge
    monkeypatch.setattr(gen_api, "public_modules", lambda: [fake])
    assert gen_api.problems() == [
        "torchsupervisor.fake.merge: the docstring does not give its TF name ('TF name: ...')",
        "torchsupervisor.fake.Saver: no docstring",
    ]


def test_docstring_rendering():
    gen_api = load_gen_api()
    doc = (
        "Do a thing.\n\nTypical use::\n\n    x = f(1)\n    y = 2\n\nArgs:\n"
        "    a: The ``first`` one,\n        on two lines.\n    b: Second.\n\n"
        "Returns:\n    Something\n    long.\n\nTF name: ``tf.thing``."
    )
    assert gen_api.docstring_markdown(doc) == (
        "Do a thing.\n\nTypical use:\n\n```python\nx = f(1)\ny = 2\n```\n\n**Args:**\n\n"
        "- `a`: The `first` one, on two lines.\n- `b`: Second.\n\n**Returns:**\n\n"
        "Something long.\n\nTF name: `tf.thing`."
    )


def test_generated_reference_is_in_the_repository_and_up_to_date(tmp_path):
    """docs/api.md is what the script writes now: regenerate it when a docstring changes."""
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("# API reference\n")
    assert "### `torchsupervisor.Supervisor`" in text
    assert " at 0x" not in text  # defaults are shown by name, not by address
    out = tmp_path / "api.md"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, SCRIPT, "-o", str(out)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8") == text, "run: python docs/gen_api.py"
