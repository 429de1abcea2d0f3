"""The NKI meta-programming subset: which Python a kernel (and every function it calls) may use.

The NKI compiler specialises a kernel by interpreting a restricted subset of Python and refuses the
rest with a compile error, while a simulator that runs the kernel as Python accepts anything ("Kernels
that use unsupported Python constructs will execute successfully on the simulator but fail to compile
for hardware": aws-neuron/aws-neuron-sdk, nki/guides/nki_simulator.rst). This emulator checks the
subset instead, when ``nki.jit`` wraps a kernel, so such a kernel fails here too, naming the construct
and its line. The rules and where they come from:

- Values are None, bools, 32-bit ints and floats, strings and tensors; containers are tuples, lists,
  dicts with string keys and classes deriving from NKIObject; control flow is ``if``, ``for`` over
  ranges/lists/tuples and ``while``; functions are inlined and may be passed as values
  (aws-neuron-sdk nki/get-started/nki-language-guide.rst, "NKI Values", "Control Flow", "Class
  Support", "Composable Kernels"). So generators, comprehensions (generator objects, sets), lambdas,
  nested function or class definitions, ``yield``, ``try``, ``with``, ``global``/``nonlocal``,
  ``async``/``await`` and set literals have no place; nor have the builtins that make iterator objects
  (``zip``, ``enumerate``, ``map``, ``filter``, ``reversed``, ``iter``) or consume them (``sum``,
  ``sorted``, ``any``, ``all``): aws-neuron/nki-library's kernels use none of them, and write explicit
  loops with ``.append`` instead.
- ``is`` / ``is not`` are not supported (use ``==`` / ``!=``), and a kernel signature has no
  keyword-only ``*`` separator (aws-neuron-sdk nki/migration/index.rst, "Language restrictions").
  Comparisons with the literal None are the exception: nki-library's kernels, which that compiler
  builds, test arguments with ``x is None`` / ``x is not None`` throughout (e.g.
  src/nkilib_src/nkilib/core/attention/attention_bwd.py), so the emulator accepts exactly that form.

Checked: the kernel function and, transitively, every plain function of the kernel's own module that
it names (those are inlined into it at specialisation).
"""

import ast
import inspect
import textwrap
import types

from ._runtime import NkiValidationError

_REFUSED_NODES = {
    ast.GeneratorExp: "a generator expression (generators are not NKI values; write a loop)",
    ast.ListComp: "a list comprehension (write a loop with .append)",
    ast.SetComp: "a set comprehension (sets are not NKI containers)",
    ast.DictComp: "a dict comprehension (write a loop)",
    ast.Lambda: "a lambda (define a module-level function; functions can be passed as values)",
    ast.Yield: "yield (generators are not NKI values)",
    ast.YieldFrom: "yield from (generators are not NKI values)",
    ast.FunctionDef: "a nested function definition (define helpers at module level)",
    ast.AsyncFunctionDef: "an async function definition",
    ast.ClassDef: "a class definition inside a kernel (declare NKIObject classes at module level)",
    ast.Try: "try/except (not part of the NKI meta-programming language)",
    ast.With: "a with statement (not part of the NKI meta-programming language)",
    ast.Global: "global (kernels must be pure functions of their arguments)",
    ast.Nonlocal: "nonlocal (kernels must be pure functions of their arguments)",
    ast.Await: "await",
    ast.Set: "a set literal (sets are not NKI containers)",
}
if hasattr(ast, "TryStar"):
    _REFUSED_NODES[ast.TryStar] = _REFUSED_NODES[ast.Try]

_REFUSED_BUILTINS = ("zip", "enumerate", "map", "filter", "reversed", "iter", "sum", "sorted", "any", "all")

_checked = set()  # code objects already found to be inside the subset


def check_kernel(fn):
    """Raise NkiValidationError listing every construct outside the NKI subset in ``fn`` and in the
    functions of its module that it reaches by name."""
    queue, seen, problems = [fn], set(), []
    while queue:
        function = queue.pop()
        if function.__code__ in seen or function.__code__ in _checked:
            continue
        seen.add(function.__code__)
        if function.__name__ == "<lambda>":
            problems.append(f"{function.__code__.co_filename}:{function.__code__.co_firstlineno}: a lambda as a "
                            "kernel or helper (define it with def at module level)")
            continue
        tree, first_line, path = _parse(function)
        problems += _problems(function, tree, first_line, path, is_kernel=function is fn)
        for name in _names(tree):
            value = function.__globals__.get(name)
            if isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
                queue.append(value)
    if problems:
        raise NkiValidationError(f"nki.jit: {fn.__qualname__} uses Python outside the NKI meta-programming subset:\n  "
                                 + "\n  ".join(problems))
    _checked.update(seen)


def _parse(function):
    lines, first_line = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    return tree.body[0], first_line, inspect.getsourcefile(function)


def _names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            yield node.id


def _identity_test_not_against_none(compare):
    operands = [compare.left] + compare.comparators
    for i, op in enumerate(compare.ops):
        if isinstance(op, (ast.Is, ast.IsNot)):
            right = operands[i + 1]
            if not (isinstance(right, ast.Constant) and right.value is None):
                return True
    return False


def _problems(function, tree, first_line, path, is_kernel):
    """'file:line in function: construct' for each construct outside the subset, in line order."""
    found = []  # (line, construct)
    if is_kernel and tree.args.kwonlyargs:
        found.append((first_line, "a keyword-only '*' separator in the kernel signature"))
    for node in ast.walk(tree):
        if node is tree:
            continue
        line = first_line + getattr(node, "lineno", 1) - 1
        kind = _REFUSED_NODES.get(type(node))
        if kind is not None:
            found.append((line, kind))
        elif isinstance(node, ast.Compare) and _identity_test_not_against_none(node):
            found.append((line, "'is' / 'is not' other than against None (use == / !=)"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFUSED_BUILTINS \
                and node.func.id not in function.__globals__:  # the builtin, not a module's own function
            found.append((line, f"{node.func.id}() (write an explicit loop)"))
    found.sort(key=lambda item: item[0])
    return [f"{path}:{line} in {function.__qualname__}: {construct}" for line, construct in found]
