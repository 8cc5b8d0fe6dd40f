"""A faster scan for Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test runs), the same patches applied.

Each kernel launch, and again each call of a ``@triton.jit`` helper from inside a kernel, runs the interpreter's
``_patch_lang``, whose ``_patch_builtin`` walks ``inspect.getmembers`` of triton.language, its core, math and
tensor class (dir, getattr and a sort of some 300 members each) to find the builtins to wrap. The helpers are
called per program (the frame attention's norm/rope per head, ...), so on CPU that scan took about a third of the
interpreter's time. Which names hold builtins does not change: they are listed once here, before any kernel runs,
and each scan checks only those names, wrapping exactly what the full scan wraps (a name whose member is already
wrapped is skipped by both). ``tests/test_kernels.py`` checks the two scans patch the same names.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Swap the interpreter's ``_patch_builtin`` for the listed-names scan; False (nothing changed) where this
    Triton has no such function or the names cannot be listed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or is_builtin is None or getattr(original, "listed_names", None) is not None:
        return False
    packages = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    # listed before any kernel runs, so no member is wrapped yet (keyed by id: a module is not always hashable)
    listed = {id(pkg): (pkg, [name for name, member in inspect.getmembers(pkg) if is_builtin(member)])
              for pkg in packages if pkg is not None}

    def patch_builtin(pkg, builder, scope):
        entry = listed.get(id(pkg))
        if entry is None or entry[0] is not pkg:  # a package not listed: the full scan
            return original(pkg, builder, scope)
        for name in entry[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.listed_names = {id(pkg): names for pkg, names in listed.values()}
    patch_builtin.original = original
    interpreter._patch_builtin = patch_builtin
    return True
