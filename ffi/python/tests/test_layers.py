"""The layering rule of the Python package (ffi/python/tidepool), read from
its sources as tests/engine/layers.rs reads the crates': its modules sit in
the layers below, lowest first, and a module imports only modules of its
own layer or of a lower one, with no import circle among them (an import
inside a function counts: it runs all the same). So there is no import
that runs up, and no circle.

1. the bottom, importing none of the package: _native (the ctypes
   bindings of libtidepool.so), _devices (what a `device` argument
   means), _units (bytes written for people), _stacks (the frame capture,
   C++ that the wheel builds: no .py, so named in EXTENSIONS);
2. what the library does: _memory (statistics, memory_summary),
   _observers, _snapshots, tags;
3. _torch: torch.cuda's memory functions pointed at those;
4. _install: tidepool as PyTorch's allocator;
5. the package's names (tidepool/__init__.py);
6. the planner, tidepool.plan, lowest first:
   a. plan.errors, the errors every part raises, and plan.patching, the
      attributes set for a run and set back;
   b. what is recorded and drawn: plan.record (the Recorder),
      plan.attention, plan.autocast, plan.workload, plan.ddp, plan.plot,
      plan.recompute (checkpointing's recomputation under its forward's
      function modes), plan.comm (copies between a process's cards),
      plan.reads (values read back from the card: placeholders);
   c. plan.optimizer, plan.fsdp, plan.cards, plan.fake_cuda (CUDA without
      a GPU, for a script planned as it is), plan.weights (the weights such
      a script loads from files, not read), plan.generation (transformers'
      generate to its length limit);
   d. plan.step, one variant's recorded run, and plan.launch, a script's
      rank as torchrun starts it;
   e. the command's parts: plan.arguments, plan.running, plan.report;
   f. plan.command (the command), plan.script (its `run SCRIPT`) and
      plan.demos (the recorder's demos and their command line);
   g. the planner's names (plan/__init__.py) and plan.__main__;
   The planner never touches libtidepool: of the modules outside it, it
   imports _units alone;
7. the names the planner's modules had first: record, workload, autocast,
   attention (tidepool.record is plan.record with plan.demos);
8. adapters for other runtimes on top: cupy, numba, vllm, memory_saver
   and what they share (_runtimes), which import any layer below. A
   module of the package's top folder that no layer lists is taken for an
   adapter; a module of the planner must be listed.

Only torch-free parsing (ast): this runs without torch and without the
library, over the checkout's sources (or the installed package's).
"""
import ast
import importlib.util
import os
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

# Lowest first; within a layer, imports either way (without a circle).
LAYERS = [
    ["_native", "_devices", "_units", "_stacks"],
    ["_memory", "_observers", "_snapshots", "tags"],
    ["_torch"],
    ["_install"],
    ["tidepool"],
    ["plan.errors", "plan.patching"],
    ["plan.record", "plan.attention", "plan.autocast", "plan.workload", "plan.ddp", "plan.plot", "plan.recompute",
     "plan.comm", "plan.reads"],
    ["plan.optimizer", "plan.fsdp", "plan.cards", "plan.fake_cuda", "plan.weights", "plan.generation"],
    ["plan.step", "plan.launch"],
    ["plan.arguments", "plan.running", "plan.report"],
    ["plan.command", "plan.script", "plan.demos"],
    ["plan", "plan.__main__"],
    ["record", "workload", "autocast", "attention"],
    ["cupy", "numba", "vllm", "memory_saver", "_runtimes"],
]
ADAPTERS = len(LAYERS) - 1
# The package's compiled modules (no .py in a checkout).
EXTENSIONS = {"_stacks"}
# The modules outside the planner that the planner may import (none of
# them loads libtidepool).
PLANNER_MAY_IMPORT = {"_units"}


def package_dir():
    """The checkout's ffi/python/tidepool, else the installed package's."""
    checkout = os.path.join(os.path.dirname(HERE), "tidepool")
    if os.path.isfile(os.path.join(checkout, "__init__.py")):
        return checkout
    spec = importlib.util.find_spec("tidepool")  # finds it without importing it
    return list(spec.submodule_search_locations)[0]


def modules_of(root, package="tidepool"):
    """{name: path} of the package's .py files; a name is relative to the
    package ("_native", "plan.errors"; "plan" for plan/__init__.py), the
    package itself is `package`."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        parts = os.path.relpath(folder, root).split(os.sep)
        parts = [] if parts == ["."] else parts
        for file in files:
            if file.endswith(".py"):
                stem = file[:-3]
                name = ".".join(parts if stem == "__init__" else parts + [stem])
                found[name or package] = os.path.join(folder, file)
    return found


def imports_of(name, path, modules, package="tidepool"):
    """The package's modules that module `name` imports: {module: line}."""
    is_package = os.path.basename(path) == "__init__.py"
    dotted = package if name == package else f"{package}.{name}"

    def ours(full):
        """The module of ours a dotted name is, or None."""
        if full == package:
            return package
        short = full[len(package) + 1:] if full.startswith(package + ".") else None
        return short if short in modules or short in EXTENSIONS else None

    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                # `import tidepool.plan.cards`: the longest module of ours it names.
                for end in range(len(parts), 0, -1):
                    target = ours(".".join(parts[:end]))
                    if target is not None:
                        found.setdefault(target, node.lineno)
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = dotted.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == package or source.startswith(package + ".")):
                continue
            for alias in node.names:
                # `from . import step` imports the module step; `from .cards
                # import Exit`, cards.
                target = ours(f"{source}.{alias.name}") or ours(source)
                if target is not None:
                    found.setdefault(target, node.lineno)
    found.pop(name, None)
    return found


def layer_of(name, package="tidepool"):
    """The index of `name`'s layer; None for an unlisted planner module."""
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    if name == "plan" or name.startswith("plan."):
        return None
    return ADAPTERS


def circles(graph):
    """The import circles of graph ({module: {module: line}}): one list of
    modules for each strongly connected part of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def problems(root, package="tidepool"):
    """What breaks the rule in the package at `root`, a line each."""
    modules = modules_of(root, package)
    graph = {name: imports_of(name, path, modules, package) for name, path in modules.items()}
    lines = []
    for name in sorted(graph):
        mine = layer_of(name, package)
        if mine is None:
            lines.append(f"{name}: a module of the planner that no layer lists (add it to LAYERS)")
            continue
        for target, line in sorted(graph[name].items()):
            theirs = layer_of(target, package)
            if theirs is not None and theirs > mine:
                lines.append(f"{name} (line {line}) imports {target}, of a higher layer ({theirs + 1} > {mine + 1})")
            planner = name == "plan" or name.startswith("plan.")
            outside = not (target == "plan" or target.startswith("plan."))
            if planner and outside and target not in PLANNER_MAY_IMPORT:
                lines.append(f"{name} (line {line}) imports {target}: the planner imports, of the modules outside "
                             f"it, {', '.join(sorted(PLANNER_MAY_IMPORT))} alone (it never touches libtidepool)")
    for part in circles(graph):
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in part for b in part if b in graph[a]]
        lines.append(f"an import circle among {', '.join(part)}: {'; '.join(edges)}")
    return lines


class Layers(unittest.TestCase):
    def test_the_package_imports_only_down_and_has_no_circle(self):
        root = package_dir()
        self.assertIn("plan.command", modules_of(root), root)
        self.assertEqual(problems(root), [], f"the layering rule of {root} (test_layers.py's docstring)")

    def test_every_listed_module_of_the_planner_is_there(self):
        # A layer naming a module that went away would hide nothing, but
        # says the docstring is stale.
        modules = modules_of(package_dir())
        listed = [name for layer in LAYERS for name in layer if name == "plan" or name.startswith("plan.")]
        self.assertEqual([name for name in listed if name not in modules], [])

    def test_a_circle_and_an_upward_import_are_found(self):
        # The check itself, on a package made for it: plan.cards importing
        # plan.command (inside a function) runs up and closes a circle;
        # _memory and tags importing each other is a circle in one layer.
        files = {
            "__init__.py": "from ._memory import memory_stats\n",
            "_native.py": "import ctypes\n",
            "_memory.py": "from . import _native\n\ndef f():\n    from .tags import region\n",
            "tags.py": "from ._memory import memory_stats\n",
            "cupy.py": "from . import _memory, tags\nimport tidepool.plan.cards\n",
            "plan/__init__.py": "from .command import main\n",
            "plan/command.py": "from .cards import resolve_cards\n",
            "plan/cards.py": "def resolve_cards():\n    from .command import Exit\n",
            "plan/report.py": "from .. import _memory\n",
        }
        with tempfile.TemporaryDirectory() as root:
            for name, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
                with open(os.path.join(root, name), "w") as f:
                    f.write(textwrap.dedent(text))
            found = problems(root)
        self.assertIn("plan.cards (line 2) imports plan.command, of a higher layer (11 > 8)", found)
        self.assertIn("an import circle among plan.cards, plan.command: plan.cards -> plan.command (line 2); "
                      "plan.command -> plan.cards (line 1)", found)
        self.assertIn("an import circle among _memory, tags: _memory -> tags (line 4); tags -> _memory (line 1)",
                      found)
        self.assertTrue(any(line.startswith("plan.report (line 1) imports _memory: the planner imports") for line in found),
                        found)
        self.assertEqual(len(found), 4, found)  # the adapter on top imports what it likes


if __name__ == "__main__":
    unittest.main()
