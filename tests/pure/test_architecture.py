"""The maps match the code: ``docs/architecture.md`` and the package's own
docstrings and comments name only what exists, and name all of it.

Three rules, each read from the source (no model, no MLX):

- every file a docstring or comment in ``mlx_lm_server/`` names (``bar.py``,
  ``foo/bar.py``) exists, found from the naming module's folder or a folder
  above it (so ``kv/quantized.py`` from ``assembly.py``, ``tests/model/test_kv.py``
  from anywhere); a name right after another project's possessive
  (``vLLM's deepseek_mtp.py``) is that project's file and is not looked for;
- the layout tree in ``docs/architecture.md`` (the first code block after
  ``## Layout``) names every package folder and every module, and nothing
  that is gone. In the tree a folder is a line whose first word ends in
  ``/``; a ``name.py`` on the folder's line or on a more indented line below
  it is a module of that folder. An ``__init__.py`` that defines nothing
  (only a docstring, imports) need not be named;
- a module over ``MAX_LINES`` lines says why it is one module: its docstring
  has a line starting with ``One module because`` (the phrase ``WHY``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mlx_lm_server"
DOC = ROOT / "docs" / "architecture.md"

MAX_LINES = 400
WHY = "One module because"

# A file name: ``bar.py``, ``foo/bar.py`` or ``../bar.py``, not part of a glob
# (``src/*.py``) or of a longer name.
FILE_NAME = re.compile(r"(?<![\w/.*-])((?:\.\./)*(?:\w+/)*\w+\.py)\b")

# Possessives that make the name after them another project's file.
OTHER_PROJECTS = ("vLLM's", "SGLang's", "mlx-lm's", "upstream's")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _prose(source: str) -> list[str]:
    """A module's docstrings (module, classes, functions) and comments."""
    texts = [ast.get_docstring(node, clean=False) or ""
             for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                  ast.AsyncFunctionDef))]
    texts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return texts


def named_files(text: str) -> list[str]:
    """The file names ``text`` names, less other projects' files."""
    return [m.group(1) for m in FILE_NAME.finditer(text)
            if not text[:m.start()].rstrip("` \n").endswith(OTHER_PROJECTS)]


def resolves(name: str, module: Path) -> bool:
    """Whether ``name`` exists in ``module``'s folder or a folder above it,
    up to the repository's root."""
    return any((folder / name).is_file()
               for folder in module.parents if folder == ROOT or ROOT in folder.parents)


def layout_tree(doc: str) -> tuple[set[str], set[str]]:
    """The folders and modules the layout tree names, as paths relative to
    the package (``spec_decode/proposer``, ``spec_decode/proposer/base.py``)."""
    block = doc.split("## Layout", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines()[1:] if line.strip()]
    assert lines and lines[0].strip() == "mlx_lm_server/", "the tree starts at mlx_lm_server/"
    folders, modules, stack = set(), set(), [(0, "")]
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # scripts/, tests/: the package's tree has ended
            break
        while len(stack) > 1 and indent <= stack[-1][0]:
            stack.pop()
        first = line.split()[0]
        if first.endswith("/"):
            folder = f"{stack[-1][1]}/{first[:-1]}".lstrip("/")
            folders.add(folder)
            stack.append((indent, folder))
            line = line.replace(first, "", 1)
        modules.update(f"{stack[-1][1]}/{name}".lstrip("/") for name in named_files(line))
    return folders, modules


def _defines_something(module: Path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for node in ast.parse(module.read_text()).body)


def test_every_file_a_docstring_or_comment_names_exists():
    missing = [f"{module.relative_to(ROOT)}: {name}"
               for module in _modules()
               for text in _prose(module.read_text())
               for name in named_files(text)
               if not resolves(name, module)]
    assert not missing, ("docstrings and comments name files that are not there "
                         "(from the module's folder or one above it):\n" + "\n".join(missing))


def test_the_layout_names_every_folder_and_module():
    folders, modules = layout_tree(DOC.read_text())
    want_folders = {str(p.parent.relative_to(PACKAGE)) for p in _modules()} - {"."}
    want_modules = {str(p.relative_to(PACKAGE)) for p in _modules()
                    if p.name != "__init__.py" or _defines_something(p)}
    unnamed = sorted((want_folders - folders) | (want_modules - modules))
    assert not unnamed, "docs/architecture.md's layout leaves out:\n" + "\n".join(unnamed)


def test_the_layout_names_nothing_that_is_gone():
    folders, modules = layout_tree(DOC.read_text())
    gone = sorted([f for f in folders if not (PACKAGE / f).is_dir()]
                  + [m for m in modules if not (PACKAGE / m).is_file()])
    assert not gone, "docs/architecture.md's layout names what is not there:\n" + "\n".join(gone)


def test_a_module_over_400_lines_says_why_in_its_docstring():
    unexplained = []
    for module in _modules():
        source = module.read_text()
        lines = len(source.splitlines())
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if lines > MAX_LINES and not any(line.startswith(WHY) for line in docstring.splitlines()):
            unexplained.append(f"{module.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, (f"modules over {MAX_LINES} lines whose docstring has no line "
                             f"starting with {WHY!r}:\n" + "\n".join(unexplained))


def test_the_rules_read_what_they_claim_to():
    """The readers themselves, on small texts: a gone name is caught, a glob
    and another project's file are not names to look for, and the tree
    attributes a module to the folder above it."""
    assert named_files("see ``kv/gone.py`` and (``src/*.py``), vLLM's ``x_mtp.py``") == [
        "kv/gone.py"]
    assert not resolves("kv/gone.py", PACKAGE / "assembly.py")
    assert resolves("kv/quantized.py", PACKAGE / "assembly.py")
    assert resolves("tests/pure/test_architecture.py", PACKAGE / "kv" / "ragged.py")
    assert named_files("its modes (``../config.py``)") == ["../config.py"]
    assert resolves("../config.py", PACKAGE / "spec_decode" / "proposer" / "__init__.py")
    doc = ("## Layout\n\n```\nmlx_lm_server/\n  a.py  one\n  kv/   b.py (x),\n"
           "        c.py\n    sub/  d.py\n  e.py\nscripts/  f.py\n```\n")
    assert layout_tree(doc) == ({"kv", "kv/sub"}, {"a.py", "kv/b.py", "kv/c.py",
                                                   "kv/sub/d.py", "e.py"})


# ---- layers: every import goes down ------------------------------------------------


def layers(text: str) -> dict[str, int]:
    """docs/architecture.md's ``### Layers`` list: room -> its line (1: the top)."""
    block = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    out = {}
    for line in block.strip().splitlines():
        number, rooms = line.split(".", 1)
        for room in re.findall(r"`([^`]+)`", rooms):
            out[room] = int(number)
    return out


def room(module: str) -> str:
    """The room of a dotted module name under the package: a top-level
    module or folder, and inside ``spec_decode/`` its modules and folders."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if parts[0] == "spec_decode":
        if len(parts) == 1:
            return "spec_decode/__init__.py"
        return f"spec_decode/{parts[1]}" + ("/" if (PACKAGE / "spec_decode" / parts[1]).is_dir()
                                             else ".py")
    return parts[0] + ("/" if (PACKAGE / parts[0]).is_dir() else ".py")


def dotted(path: Path) -> str:
    """A module's dotted name (a package's for its ``__init__.py``)."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of the package a module makes,
    at its top or inside a function."""
    package = dotted(path) if path.name == "__init__.py" else dotted(path).rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, target))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm_server"):
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("mlx_lm_server")]
    return out


def arrows_up(order: dict[str, int], sources: dict[Path, str]) -> list[str]:
    """Imports that reach another room on the same line or a line above."""
    bad = []
    for path, source in sources.items():
        own = room(dotted(path))
        for line, target in imports(path, source):
            theirs = room(target)
            if theirs != own and order[theirs] <= order[own]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                           f"({own} on line {order[own]}, {theirs} on line {order[theirs]})")
    return bad


def test_every_room_is_on_the_layers_list():
    order = layers(DOC.read_text())
    rooms = {room(dotted(p)) for p in _modules()}
    assert not rooms - set(order), f"rooms not on the layers list: {sorted(rooms - set(order))}"
    assert not set(order) - rooms, f"the layers list names rooms that are gone: " \
                                   f"{sorted(set(order) - rooms)}"


def test_every_import_goes_down_the_layers():
    bad = arrows_up(layers(DOC.read_text()), {p: p.read_text() for p in _modules()})
    assert not bad, "imports that go up or sideways:\n" + "\n".join(bad)


def test_the_layer_rule_catches_an_arrow_up_and_sideways():
    """The reader on small texts: kv importing serving (up) and parallel (the
    same line) is caught, in a function too; runtime (below) and kv's own
    modules are not; inside spec_decode/ the tree importing a proposer is."""
    order = {"serving/": 1, "kv/": 2, "parallel/": 2, "runtime/": 3,
             "spec_decode/proposer/": 4, "spec_decode/tree.py": 5}
    kv = PACKAGE / "kv" / "ragged.py"
    source = ("from ..runtime import ports\nfrom . import rows\nfrom .rows import RowEnds\n"
              "def f():\n    from ..serving import batch\n    import mlx_lm_server.parallel\n")
    bad = arrows_up(order, {kv: source})
    assert [b.split(" imports ")[1].split()[0] for b in bad] == [
        "mlx_lm_server.serving", "mlx_lm_server.parallel"], bad
    tree = PACKAGE / "spec_decode" / "tree.py"
    bad = arrows_up(order, {tree: "from .proposer.base import PLACEHOLDER_TOKEN\n"})
    assert len(bad) == 1 and "spec_decode/proposer/ on line 4" in bad[0]


# ---- the walk of one request ----------------------------------------------------


def walk(text: str) -> list[tuple[str, str]]:
    """docs/architecture.md's walk: (module path under the package, function
    or ``Class.method``) per hop."""
    block = text.split("<!-- walk -->", 1)[1].split("<!-- /walk -->", 1)[0]
    return re.findall(r"`([\w/]+\.py):([\w.]+)`", block)


def defined(source: str, name: str) -> bool:
    """Whether ``name`` (``f``, ``Class`` or ``Class.method``) is defined at
    the top of ``source`` (a method: in its class's body)."""
    scope = ast.parse(source).body
    for part in name.split("."):
        found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.ClassDef)) and n.name == part), None)
        if found is None:
            return False
        scope = found.body
    return True


def test_every_hop_of_the_walk_is_defined_where_it_says():
    hops = walk(DOC.read_text())
    assert len(hops) >= 20
    missing = [f"{path}:{name}" for path, name in hops
               if not (PACKAGE / path).is_file()
               or not defined((PACKAGE / path).read_text(), name)]
    assert not missing, "the walk names hops that are not there:\n" + "\n".join(missing)


def test_the_walk_reader_catches_a_gone_hop():
    source = "class A:\n    def f(self):\n        pass\n\ndef g():\n    pass\n"
    assert defined(source, "A.f") and defined(source, "g") and defined(source, "A")
    assert not defined(source, "A.g") and not defined(source, "f") and not defined(source, "B")
