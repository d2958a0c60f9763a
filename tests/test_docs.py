"""The documentation's code: every torchsupervisor Python block compiles, every
torchsupervisor name it uses exists, and the README's example runs (on a temporary log
directory, for fewer steps), as do the quickstart's and the PyPI description's."""

from __future__ import annotations

import os
import re

import pytest

import torchsupervisor as ts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "README.md",
    *(os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))),
]
DOCS = [d for d in DOCS if d.endswith(".md") and d != os.path.join("docs", "api.md")]


def _python_blocks(doc: str) -> list[str]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _resolve(dotted: str) -> object:
    obj: object = ts
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_compile_and_name_real_api(doc):
    for i, block in enumerate(_python_blocks(doc)):
        if "ts." not in block and "torchsupervisor" not in block:
            continue  # A TensorFlow original, quoted as the seed wrote it.
        # A line "...what goes here..." is prose standing for user code.
        code = re.sub(r"(?m)^(\s*)\.\.\.\S.*\.\.\.\s*$", r"\1...", block)
        compile(code, f"{doc}[block {i}]", "exec")
        for dotted in set(re.findall(r"\bts(?:\.[A-Za-z_][A-Za-z0-9_]*)+", block)):
            # Attribute chains on the namespace and its modules (ts.summary.scalar, ...);
            # stop at the first lower-case name after a class (a method call on an instance).
            parts = dotted.split(".")
            keep = ["ts"]
            for part in parts[1:]:
                keep.append(part)
                if part[:1].isupper():
                    break
            name = ".".join(keep)
            try:
                _resolve(name)
            except AttributeError:
                pytest.fail(f"{doc} block {i} uses {name}, which torchsupervisor does not have")


_GENERATED = ("benchmarks/results/",)  # Made by running the benchmarks.


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_of_the_repository_a_doc_cites_exists(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    cited = set(re.findall(r"`((?:tests|examples|benchmarks|docs)/[\w/.-]+)`", text))
    cited |= set(re.findall(r"`(torchsupervisor/[\w/-]+\.py)`", text))
    missing = sorted(p for p in cited if p not in _GENERATED and not os.path.exists(f"{ROOT}/{p}"))
    assert not missing, f"{doc} cites files that do not exist: {missing}"


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md", "docs/pypi.md"])
def test_the_first_example_runs(tmp_path, monkeypatch, doc):
    block = next(b for b in _python_blocks(doc) if "managed_session" in b)
    assert "10_000" in block
    monkeypatch.chdir(tmp_path)
    code = block.replace("10_000", "30")
    namespace: dict = {}
    exec(compile(code, doc, "exec"), namespace)
    step = namespace["step"]
    assert step.value == 30
    assert ts.latest_checkpoint(str(tmp_path / "runs" / "exp")).endswith("model.ckpt-30")


def test_every_doc_is_linked_from_the_readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    docs = [n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
    assert "quickstart.md" in docs
    assert [n for n in docs if f"docs/{n}" not in readme] == []
    # The quickstart is the first document the README points to.
    assert readme.index("docs/quickstart.md") == readme.index("docs/")
