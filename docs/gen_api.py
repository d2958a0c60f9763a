"""Write the API reference (``docs/api.md``) from torchsupervisor's public names and docstrings.

    python docs/gen_api.py              # writes docs/api.md next to this script
    python docs/gen_api.py -o out.md    # somewhere else
    python docs/gen_api.py --check      # exit status 1 if a public name lacks its docstring

The public names are those in ``torchsupervisor.__all__`` and, for each public module listed
there (``torchsupervisor.summary``, ``torchsupervisor.errors``, ...), in its ``__all__``. Each
class or function gets its signature and its docstring (Google style, turned into Markdown);
classes also get their public methods and properties. Names re-exported from other packages
(TensorBoard's protos) and constants are listed with where they come from or their value.

``--check`` (and ``problems()``, used by the tests) reports every public class or function
defined in torchsupervisor without a docstring, and every one whose TF 1 counterpart exists
(``TF_NAMES``) but whose docstring does not give it on a ``TF name:`` line.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import os
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

ROOT = "torchsupervisor"
HERE = os.path.dirname(os.path.abspath(__file__))

# TF 1 public names that torchsupervisor mirrors (``tf.train``, ``tf.summary``, ``tf.errors``,
# the graph-collection functions of ``tf.compat.v1`` and ``tf.distribute``): a public name in
# this set must say which TF name it corresponds to.
TF_NAMES = frozenset(
    str.split(
        """
    Supervisor Coordinator LooperThread SessionManager Saver Session Server ClusterSpec
    CheckpointState CheckpointReader NewCheckpointReader checkpoint_exists get_checkpoint_mtimes
    get_checkpoint_state latest_checkpoint update_checkpoint_state generate_checkpoint_state_proto
    remove_checkpoint list_variables load_checkpoint load_variable basic_train_loop
    global_step get_global_step create_global_step get_or_create_global_step assert_global_step
    Graph GraphKeys add_to_collection add_to_collections get_collection get_collection_ref
    clear_collection get_default_graph reset_default_graph global_variables_initializer
    local_variables_initializer report_uninitialized_variables
    FileWriter FileWriterCache SummaryWriterCache summary_iterator scalar histogram image audio
    text merge merge_all
    MonitoredSession SingularMonitoredSession MonitoredTrainingSession Scaffold
    ChiefSessionCreator WorkerSessionCreator SessionCreator SessionRunHook SessionRunArgs
    SessionRunContext SessionRunValues StopAtStepHook CheckpointSaverHook CheckpointSaverListener
    StepCounterHook SummarySaverHook NanTensorHook NanLossDuringTrainingError LoggingTensorHook
    GlobalStepWaiterHook FinalOpsHook FeedFnHook SecondOrStepTimer
    QueueRunner FIFOQueue add_queue_runner start_queue_runners
    OpError OutOfRangeError AbortedError UnavailableError CancelledError DeadlineExceededError
    DataLossError NotFoundError InvalidArgumentError FailedPreconditionError AlreadyExistsError
    PermissionDeniedError ResourceExhaustedError UnauthenticatedError UnimplementedError
    InternalError UnknownError exception_type_from_error_code error_code_from_exception_type
    exponential_decay inverse_time_decay natural_exp_decay piecewise_constant polynomial_decay
    cosine_decay linear_cosine_decay noisy_linear_cosine_decay ExponentialMovingAverage
    FtrlOptimizer ProximalGradientDescentOptimizer ProximalAdagradOptimizer AdagradDAOptimizer
    clip_by_global_norm clip_by_average_norm clip_by_norm clip_by_value global_norm
    """
    )
)


# --------------------------------------------------------------------------------- discovery


def public_modules() -> list[types.ModuleType]:
    """Return ``torchsupervisor`` and the public modules its ``__all__`` lists, in order."""
    root = importlib.import_module(ROOT)
    modules = [root]
    for name in root.__all__:
        obj = getattr(root, name)
        if (
            isinstance(obj, types.ModuleType)
            and obj.__name__.startswith(ROOT + ".")
            and hasattr(obj, "__all__")
            and obj not in modules
        ):
            modules.append(obj)
    return modules


def public_names(module: types.ModuleType) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, object)`` for every name in ``module.__all__``, sorted case-blind."""
    for name in sorted(module.__all__, key=lambda n: (n.lower(), n)):
        yield name, getattr(module, name)


def _own(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith(ROOT)


def _documentable(obj: Any) -> bool:
    return (inspect.isclass(obj) or inspect.isfunction(obj)) and _own(obj)


def _gives_tf_name(doc: str, name: str) -> bool:
    """A ``TF name:`` line, or the TF name itself (``tf.<path>.<name>``) in the text."""
    return (
        "TF name" in doc or re.search(r"\btf\.[\w.]*\b" + re.escape(name) + r"\b", doc) is not None
    )


def problems() -> list[str]:
    """Return what is missing from the docstrings of the public names (empty when complete)."""
    found = []
    for module in public_modules():
        for name, obj in public_names(module):
            if not _documentable(obj):
                continue
            full = f"{module.__name__}.{name}"
            doc = inspect.getdoc(obj) or ""
            if not doc.strip():
                found.append(f"{full}: no docstring")
            elif name in TF_NAMES and not _gives_tf_name(doc, name):
                found.append(f"{full}: the docstring does not give its TF name ('TF name: ...')")
    return found


# --------------------------------------------------------------------------------- rendering

_SECTION = re.compile(
    r"^(Args|Arguments|Returns|Yields|Raises|Attributes|Example|Examples|Note|Notes|Warning)"
    r":\s*$"
)


def _code(text: str) -> str:
    """Turn reStructuredText ``literals`` into Markdown `code`."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def docstring_markdown(doc: str) -> str:
    """Render a Google-style docstring as Markdown.

    Section headers (``Args:``, ``Returns:``, ...) become bold lines and their indented items
    a list; a paragraph ending in ``::`` introduces a code block (its indented lines).
    """
    lines = doc.expandtabs().splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.endswith("::") and not _SECTION.match(stripped):
            out.append(_code(line.rstrip()[:-1]))
            i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            out += ["", "```python", *(b[indent:] for b in block), "```", ""]
            continue
        match = _SECTION.match(stripped)
        if match and not line.startswith(" "):
            out += [f"**{match.group(1)}:**", ""]
            i += 1
            items: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                body = lines[i]
                if body.strip():
                    depth = len(body) - len(body.lstrip())
                    if depth <= 4 or not items:
                        items.append(body.strip())
                    else:
                        items[-1] += " " + body.strip()
                i += 1
            if match.group(1) not in ("Args", "Arguments", "Raises", "Attributes"):
                out += [_code(" ".join(items)), ""]  # a paragraph, not a list of names
                continue
            for item in items:
                head, sep, rest = item.partition(": ")
                if sep and re.fullmatch(r"[\w.*\[\], |()]+", head) and len(head) < 60:
                    out.append(f"- `{head}`: {_code(rest)}")
                else:
                    out.append(f"- {_code(item)}")
            out.append("")
            continue
        out.append(_code(stripped))  # no indentation: Markdown would make it a code block
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


class _Default:
    """A default value shown by the module-level name it has (no ``<object at 0x...>``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    @classmethod
    def of(cls, value: Any, function: Any) -> Any:
        if value is inspect.Parameter.empty or " at 0x" not in repr(value):
            return value
        module = sys.modules.get(getattr(function, "__module__", ""), None)
        for name, candidate in vars(module or types.ModuleType("")).items():
            if candidate is value and not name.startswith("__"):
                return cls(name)
        return cls(f"<{type(value).__name__}>")


def _signature(obj: Any, name: str) -> str:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return f"{name}(...)"
    params = [
        p.replace(annotation=inspect.Parameter.empty, default=_Default.of(p.default, target))
        for p in sig.parameters.values()
    ]
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    plain = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
    return f"{name}{plain}"


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    if issubclass(cls, BaseException) or issubclass(cls, enum.Enum):
        return
    seen = set()
    for klass in cls.__mro__:
        if not _own(klass):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member) or isinstance(member, property):
                yield name, member


def render_object(qualname: str, name: str, obj: Any, aliases: dict[int, str]) -> list[str]:
    """Return the Markdown lines documenting one public name."""
    out = [f"### `{qualname}`", ""]
    original = aliases.get(id(obj))
    if original is not None and original != name:
        target = _anchor(qualname.rsplit(".", 1)[0] + "." + original)
        return [*out, f"Alias of [`{original}`](#{target}).", ""]
    if isinstance(obj, types.ModuleType):
        return [*out, f"The module [`{obj.__name__}`](#{_anchor(obj.__name__)}).", ""]
    if not (inspect.isclass(obj) or callable(obj)):
        return [*out, f"A constant: `{obj!r}`." if len(repr(obj)) < 80 else "A constant.", ""]
    if not _own(obj):
        return [*out, _origin(obj), ""]
    kind = "class " if inspect.isclass(obj) else ""
    out += ["```python", f"{kind}{_signature(obj, name)}", "```", ""]
    out += [docstring_markdown(inspect.getdoc(obj) or "(no docstring)"), ""]
    if inspect.isclass(obj):
        for member_name, member in _members(obj):
            label = f"{name}.{member_name}"
            if isinstance(member, property):
                out += [f"#### `{label}` (property)", ""]
            else:
                out += [f"#### `{label}`", "", "```python"]
                out += [_signature(member, member_name).replace("(self, ", "(", 1)]
                out[-1] = out[-1].replace("(self)", "()")
                out += ["```", ""]
            doc = inspect.getdoc(member.fget if isinstance(member, property) else member)
            out += [docstring_markdown(doc or "(no docstring)"), ""]
    return out


def _origin(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    if module:
        return f"Re-exported from `{module}.{obj.__name__}`."
    if hasattr(obj, "DESCRIPTOR"):
        return f"The protobuf message class `{obj.DESCRIPTOR.full_name}`."
    return "Defined elsewhere."


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", text.lower().replace(" ", "-"))


def render() -> str:
    """Return the whole API reference as Markdown."""
    modules = public_modules()
    lines = [
        "# API reference",
        "",
        "Generated by `python docs/gen_api.py` from the docstrings of the public names "
        "(`__all__`) of `torchsupervisor` and of its public modules. Do not edit by hand: "
        "edit the docstrings and run the script again.",
        "",
        "Modules: " + " · ".join(f"[`{m.__name__}`](#{_anchor(m.__name__)})" for m in modules),
        "",
    ]
    for module in modules:
        names = list(public_names(module))
        aliases: dict[int, str] = {}
        for _, obj in names:
            original = getattr(obj, "__name__", None)
            if original in dict(names) and dict(names)[original] is obj:
                aliases[id(obj)] = original
        lines += [f"## {module.__name__}", ""]
        lines += [docstring_markdown(inspect.getdoc(module) or ""), ""]
        lines += ["| Name | What |", "|---|---|"]
        for name, obj in names:
            summary = (inspect.getdoc(obj) or "").strip().split("\n")[0] if _own(obj) else ""
            if isinstance(obj, types.ModuleType):
                summary = f"module `{obj.__name__}`"
            elif aliases.get(id(obj), name) != name:
                summary = f"alias of `{aliases[id(obj)]}`"
            elif not _own(obj) and (inspect.isclass(obj) or callable(obj)):
                summary = _origin(obj).rstrip(".")
            elif not (inspect.isclass(obj) or callable(obj)):
                summary = f"`{obj!r}`" if len(repr(obj)) < 40 else "a constant"
            summary = _code(summary).replace("|", "\\|")
            lines.append(f"| [`{name}`](#{_anchor(module.__name__ + '.' + name)}) | {summary} |")
        lines.append("")
        for name, obj in names:
            lines += render_object(f"{module.__name__}.{name}", name, obj, aliases)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference (or ``--check`` the docstrings); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--output", default=os.path.join(HERE, "api.md"))
    parser.add_argument("--check", action="store_true", help="only check the docstrings")
    args = parser.parse_args(argv)
    if args.check:
        found = problems()
        for problem in found:
            print(problem)
        return 1 if found else 0
    text = render()
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
