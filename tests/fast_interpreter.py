"""Faster kernel launches in Triton's interpreter (TRITON_INTERPRET=1) for the CPU test suite (conftest.py installs
it before any kernel runs). Nothing in the library depends on it; the tests run the same, slower, without it.
Measured on a 2-core VM (Triton 3.9): the whole suite 652 -> 475 s, the kernel split tests 51 -> 32 s."""

import os


def install():
    """Two shortcuts around Triton's interpreter launch, which otherwise costs a quarter of the suite's time.
    The interpreter patches every builtin of ``triton.language`` (and of its tensor, math and descriptor types)
    around each kernel launch, finding them with ``inspect.getmembers`` each time, and patches them again, without
    restoring, at every call of a nested ``@triton.jit`` function in every program of the grid.
    1. The builtins never change: look them up once, here, while nothing is patched; each launch then patches
       (and restores) exactly what the interpreter's own lookup would.
    2. A nested call inside a running launch (same thread) whose module sees no language module other than those
       the launch patched finds them patched already: it skips the patching.
    Anything else (other packages, other language modules, an interpreter without these functions) keeps Triton's
    own code. A builtin left unpatched would fail loudly at its first call ("must be provided outside of JIT
    functions"), never compute something else."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import inspect
    import sys
    import threading

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original_builtin = getattr(interpreter, "_patch_builtin", None)
    original_lang = getattr(interpreter, "_patch_lang", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if None in (original_builtin, original_lang, patch_attr, scope_type):
        return
    if list(inspect.signature(original_builtin).parameters) != ["pkg", "builder", "scope"]:
        return
    tl = interpreter.tl
    packages = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    builtins = {
        id(pkg): (pkg, [(name, member) for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)])
        for pkg in packages
        if pkg is not None
    }

    def _patch_builtin(pkg, builder, scope):
        known = builtins.get(id(pkg))
        if known is None or known[0] is not pkg:
            return original_builtin(pkg, builder, scope)
        for name, member in known[1]:
            patch_attr(pkg, name, member, builder, scope)

    grid_executor = getattr(interpreter, "GridExecutor", None)
    grid_call = vars(grid_executor).get("__call__") if grid_executor is not None else None
    if grid_call is None:
        interpreter._patch_builtin = _patch_builtin
        return
    langs_of = {}  # id(fn) -> (fn, ids of the language modules its globals hold)
    launches = threading.local()  # .patched: per running launch of this thread, the language modules patched

    def _patch_lang(fn):
        entry = langs_of.get(id(fn))
        if entry is None or entry[0] is not fn:
            langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
            entry = langs_of[id(fn)] = (fn, langs)
        stack = getattr(launches, "patched", None)
        if stack is None:
            stack = launches.patched = []
        if sys._getframe(1).f_code is not grid_call.__code__:  # a nested call: its patches are never restored
            if stack and entry[1] <= stack[-1]:
                return scope_type()  # inside a launch that patched these already
            scope = original_lang(fn)
            if stack:
                stack[-1] = stack[-1] | entry[1]  # patched now for the rest of the launch
            return scope
        scope = original_lang(fn)  # a launch: restored when it ends
        stack.append(entry[1])
        restore = scope.restore

        def restore_and_pop():
            stack.pop()
            restore()

        scope.restore = restore_and_pop
        return scope

    interpreter._patch_builtin = _patch_builtin
    interpreter._patch_lang = _patch_lang
