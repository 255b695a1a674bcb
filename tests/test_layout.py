"""The code's shape: every module imports on its own, the import graph has no cycle, no module is huge,
and private transformers API is used in one file only."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"hfpaged": ROOT / "hfpaged", "hfpaged.kernels": ROOT / "kernels"}
MAX_LINES = 405


def modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package ``hfpaged`` (``kernels/`` is ``hfpaged.kernels``) by name."""
    found = {}
    for prefix, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The hfpaged modules ``name`` imports at run time (module level or inside functions; not TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in known:
                    found.add(target)  # a submodule
                elif source in known:
                    found.add(source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def test_the_module_import_graph_has_no_cycle():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    # a package imports its parent package implicitly; that edge is not a cycle of ours
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                walk(target)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            walk(name)
    assert len(graph) > 40  # the scan saw the whole package


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    """One fresh interpreter imports each module with no other hfpaged module loaded before it."""
    names = sorted(modules())
    script = f"""
import sys, importlib
import torch, transformers  # heavy third-party imports once
failed = []
for name in {names!r}:
    for loaded in [m for m in sys.modules if m == "hfpaged" or m.startswith("hfpaged.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_is_over_about_400_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_private_transformers_api_is_used_in_hf_compat_only():
    """``model._get_logits_processor`` and friends, ``_eos_token_tensor``, ``_attn_implementation_internal``:
    one file to touch when transformers moves them."""
    private = (
        "._prepare_",
        "._get_logits_processor",
        "._merge_criteria",
        "._eos_token_tensor",
        "._pad_token_tensor",
        "._attn_implementation_internal",
        "._beam_search",
        "._get_top_k",
        "._update_finished_beams",
        "._flatten_beam_dim",
        "._unflatten_beam_dim",
        "._check_early_stop",
        "._validate_generated_length",
        "._get_running_beams",
    )
    users = {
        name
        for name, path in modules().items()
        if any(marker in path.read_text() for marker in private) and not name.endswith("hf_compat")
    }
    assert users == set()
