"""The NKI meta-programming subset: which Python a kernel (and every function it calls) may use.

The NKI compiler specialises a kernel by interpreting a restricted subset of Python and refuses the
rest with a compile error, while a simulator that runs the kernel as Python accepts anything ("Kernels
that use unsupported Python constructs will execute successfully on the simulator but fail to compile
for hardware": aws-neuron/aws-neuron-sdk, nki/guides/nki_simulator.rst). This emulator checks the
subset instead, when ``nki.jit`` wraps a kernel, so such a kernel fails here too, naming the construct,
its line and the front end's own words.

The rules are those of the public NKI front end, leanprover/KLR @ 7ccd18c ("KLR is an IR for NKI"):
interop/klr/gather.c turns CPython's AST into KLR's Python AST, KLR/NKI/Simplify.lean turns that into
the kernel AST (KLR/NKI/Basic.lean), KLR/NKI/Annotations.lean reads its ranges and ``with`` blocks, and
KLR/Trace/*.lean interpret it. Quoted text is the front end's error message (sic). AWS's language guide
(aws-neuron-sdk nki/get-started/nki-language-guide.rst, "NKI Values", "Control Flow") agrees where it
says anything; the migration guide's "Language restrictions" differ on keyword-only parameters and
``is`` (below).

- Statements: nested ``def``/``class``, ``del``, ``type``, ``async``, ``match``, ``raise``, ``try``,
  ``import``, ``global``, ``nonlocal`` are refused ("NKI does not support ...", gather.c ``stmt``,
  l. 1322-1371); ``assert`` is the way to fail.
- Expressions: lambdas, comprehensions, generator expressions, ``yield``, ``await``, ``:=`` and set
  literals: "unsupported expression" (gather.c ``expr``, l. 1079). Values are None, bools, ints,
  floats, strings, tensors, tuples, lists, dicts and NKIObject objects (Simplify.lean ``value``,
  Trace/Types.lean ``Term``).
- A ``for`` target is one plain name: "expecting simple variable" (Simplify.lean ``simpleVar``, l. 279,
  used by ``stmt'`` l. 372; Basic.lean ``forLoop (x : Name)``); unpack in the body instead
  (``for span in spans: start, count = span``). No ``else`` on ``for``/``while`` ("for-orelse is not
  supported in NKI", "while-orelse ...": ``stmt'`` l. 371, 380).
- Assignment (Simplify.lean ``pattern``, ``letSet``, l. 299-316): targets are names, tuples of names
  (nested: KLR/NKI/Patterns.lean indexes them), or one subscript/attribute to mutate. An attribute
  inside a tuple target: "expecting simple variable"; anything else there: "expecting pattern"; two
  mutated targets in one statement: "mutating assignments must be in separate statements"; a list
  target is a mutation of nothing: "mutation not supported" (Trace/NKI.lean ``mutate``).
- ``*x`` and ``**x`` in calls, displays and targets: "tuple expansion is not supported", "keyword
  expansion is not supported" (Simplify.lean ``expr'`` l. 224, ``keywords`` l. 264); ``def f(*args)``:
  "varargs are not supported in NKI" (``params`` l. 416). ``**kwargs`` is only warned about there, and
  keyword-only parameters are accepted (the check is commented out, l. 421): so, unlike the migration
  guide's "Language restrictions" (aws-neuron-sdk nki/migration/index.rst), the emulator accepts a
  ``*`` separator, following KLR.
- Operators: ``@`` is refused ("the matmul operator is not supported in NKI", ``binOp`` l. 106);
  ``in`` only on its own, not in a chained comparison ("the 'in' operator is not supported in NKI",
  ``cmpOp`` l. 90, ``expr'`` l. 209). ``x is None`` / ``x is not None`` are rewritten to ``==`` / ``!=``
  (``expr'`` l. 205); any other ``is`` is also compiled as ``==``, with the warning "the 'is' operator
  is not supported in NKI, use ==" (``cmpOp`` l. 84). The emulator, which runs Python's ``is``, refuses
  those instead, so that its result cannot differ from the compiled ``==``: as the migration guide says.
- Literals: dict keys are string literals ("expecting string", ``strValue``); ``...`` only inside a
  subscript ("invalid use of ellipsis", ``value`` l. 60, ``index``); ints fit 32 bits ("integer value
  (...) is too large", gather.c ``value`` l. 819); f-strings have no format spec ("NKI does no support
  format specifiers", gather.c l. 1057).
- ``with``: only ``with nl.no_reorder():`` (Simplify.lean ``stmt'`` l. 382-393: "NKI only supports
  with statements with a single, simple function call as context"; Annotations.lean ``withType``:
  "invalid with context ... (only no_reorder is supported)"); the block is recorded in the trace for the
  scheduler (``nl.no_reorder``).
- Decorators: staticmethod, dataclass and nki.jit ("unsupported decorator ...", Simplify.lean
  ``decorator`` l. 432; matched here by last name, as the front end sees the resolved ``nki.jit`` and
  the emulator's module is called ``nki_emulator``).
- Builtins: those KLR defines (Trace/Python.lean, ``builtin.python.*``): isinstance, type, slice,
  print, min and max (one sequence or two numbers: "invalid arguments", l. 150-191), abs, str, bool,
  int, float, divmod, tuple, list, dict, len; ``range`` and nl's ``*_range`` only as the iterator of a
  ``for``, with 1 to 3 positional arguments (Annotations.lean ``iterator``: "invalid range arguments";
  Trace/NKI.lean ``range``, "only in a for-loop context"). So no zip, enumerate, map, filter, sum,
  sorted, any, all, round, getattr, ...: aws-neuron/nki-library's kernels use none of them either, and
  write explicit loops with ``.append``. Of ``math``: pi, e, inf, nan, ceil, floor, gcd, log2, log10,
  pow, sqrt (Trace/Python.lean ``pythonEnv``, ``math.*``).

- Globals and modules (gather.c ``reference``, l. 722-790, resolves every name and attribute chain
  when it gathers the kernel; ``const_expr``/``value``, l. 486-565 and 798-841, turn values into
  constants): a global or module constant holding an int outside int32, also inside a tuple, list or
  dict, is refused ("integer value (...) is too large"/"too small", l. 816-819); numpy's functions and
  types are not gathered ("skip numpy", ``add_work`` l. 252), so ``np.exp`` is "name numpy.exp not
  found"; a builtin (C) function of another module (``os.getcwd``) becomes None. Module constants
  (``np.pi``, ``os.sep``), Python functions and classes of other modules are accepted, as there.
- ``for x in d`` over a dict: "not an iterable object" (Trace/Python.lean ``fetchIter``, l. 246-254;
  only None, tuples and lists iterate); checked where the iterator is a dict display or ``dict(...)``.
- Run time, outside this module: a kernel's parameters all come from its caller, defaults unused
  ("argument ... not supplied", KLR/NKI/Simplify.lean ``args`` l. 492-505; ``Kernel`` in __init__.py);
  tensor subscripts follow KLR/Trace/Term.lean (no negative integer index, chained subscripts as
  ``NkiTensor.__getitem__`` in _memory.py says).

Checked: the kernel function and, transitively, every plain function of the kernel's own module that
it names (those are inlined into it at specialisation). What depends on the values at run time
(iterating a dict held in a variable, attributes of tensors, methods of lists and dicts:
Trace/Term.lean ``attr``; operators, ``in``, builtins' arguments, 32-bit integers) is checked when the
kernel runs, by :mod:`._values`, in every function it calls.
"""

import ast
import builtins
import inspect
import math
import textwrap
import types

from ._runtime import NkiValidationError

_STATEMENTS = {  # gather.c, stmt()
    ast.FunctionDef: "NKI does not support inner function definitions (define helpers at module level)",
    ast.ClassDef: "NKI does not support 'class' definitions within a function (declare them at module level)",
    ast.Delete: "NKI does not support 'del' statements at this time",
    ast.AsyncFunctionDef: "NKI does not support 'async'",
    ast.AsyncFor: "NKI does not support 'async'",
    ast.AsyncWith: "NKI does not support 'async'",
    ast.Match: "NKI does not support 'match' statements at this time. Use 'if/elif' or dict lookups instead",
    ast.Raise: "NKI does not support 'raise' statements. Use 'if/else' control flow within kernels, or "
               "'assert' for fatal errors",
    ast.Try: "NKI does not support 'try' statements",
    ast.Import: "NKI does not support 'import' statements within a function",
    ast.ImportFrom: "NKI does not support 'import' statements within a function",
    ast.Global: "NKI does not support 'global' statements",
    ast.Nonlocal: "NKI does not support 'nonlocal' statements",
}
for _name, _refusal in (("TryStar", _STATEMENTS[ast.Try]), ("TypeAlias", "NKI does not support 'type' statements")):
    if hasattr(ast, _name):  # Python 3.11+, 3.12+
        _STATEMENTS[getattr(ast, _name)] = _refusal

_EXPRESSIONS = {  # gather.c, expr(): "unsupported expression"
    ast.Lambda: "a lambda; define a module-level function, functions can be passed as values",
    ast.ListComp: "a list comprehension; write a loop with .append",
    ast.SetComp: "a set comprehension; sets are not NKI values",
    ast.DictComp: "a dict comprehension; write a loop",
    ast.GeneratorExp: "a generator expression; write a loop",
    ast.Yield: "yield", ast.YieldFrom: "yield from", ast.Await: "await",
    ast.NamedExpr: "an assignment expression :=",
    ast.Set: "a set literal; sets are not NKI values",
}

_BUILTINS = {"isinstance", "type", "slice", "print", "min", "max", "abs", "str", "bool", "int", "float", "divmod",
             "tuple", "list", "dict", "len", "range"}
_RANGES = {"range", "static_range", "affine_range", "sequential_range", "dynamic_range"}
_MATH = {"pi", "e", "inf", "nan", "ceil", "floor", "gcd", "log2", "log10", "pow", "sqrt"}
_DECORATORS = {"jit", "staticmethod", "dataclass"}
_INT32_MAX = 2 ** 31 - 1

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
        lines, first_line = inspect.getsourcelines(function)
        tree = ast.parse(textwrap.dedent("".join(lines))).body[0]
        found = sorted(_problems(function, tree), key=lambda problem: problem[0])
        problems += [f"{inspect.getsourcefile(function)}:{first_line + line - 1} in {function.__qualname__}: {what}"
                     for line, what in found]
        for node in ast.walk(tree):
            value = function.__globals__.get(node.id) if isinstance(node, ast.Name) else None
            if isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
                queue.append(value)
    if problems:
        raise NkiValidationError(f"nki.jit: {fn.__qualname__} uses Python outside the NKI meta-programming subset:\n  "
                                 + "\n  ".join(problems))
    _checked.update(seen)


def _problems(function, tree):
    """(line in the source, what) for each construct outside the subset in ``tree``, ``function``'s def."""
    nodes = list(ast.walk(tree))[1:]
    loop_iterators = {id(node.iter) for node in nodes if isinstance(node, ast.For)}
    subscripts = [node.slice for node in nodes if isinstance(node, ast.Subscript)]
    indexes = {id(index) for s in subscripts for index in (s.elts if isinstance(s, ast.Tuple) else [s])}
    local_names = {node.id for node in nodes if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    local_names |= {arg.arg for arg in ast.walk(tree.args) if isinstance(arg, ast.arg)}
    local_names |= set(function.__code__.co_freevars)

    def builtin(name):  # the name means Python's builtin here
        return name in vars(builtins) and name not in local_names and name not in function.__globals__

    def name_problem(node):
        """What is wrong with ``node`` where that depends on what a name means in ``function``: a local, one
        of ``function``'s globals or modules, or a Python builtin."""
        match node:
            case ast.Name(id=name, ctx=ast.Load()) if builtin(name) and name not in _BUILTINS:
                return f"{name} is not one of NKI's Python builtins"  # Trace/Python.lean, builtin.python.*
            case ast.Attribute(value=ast.Name(id=name), attr=attr) if function.__globals__.get(name) is math:
                return None if attr in _MATH else f"math.{attr} is not in NKI's math library"  # pythonEnv
            case ast.Attribute(value=ast.Name(id=name), attr=attr) if name not in local_names \
                    and isinstance(function.__globals__.get(name), types.ModuleType):
                return _module_attribute_problem(function.__globals__[name], attr)
            case ast.Name(id=name, ctx=ast.Load()) if name not in local_names and name in function.__globals__:
                return _constant_problem(function.__globals__[name], name)
            case ast.Call(func=callee, args=args, keywords=keywords) if _last_name(callee) in _RANGES:
                # Trace/NKI.lean range: "only in a for-loop context"; Annotations.lean iterator
                if id(node) not in loop_iterators:
                    return f"{ast.unparse(callee)}() outside a for-loop header (a range is only a loop's iterator)"
                if keywords or not 1 <= len(args) <= 3:
                    return "invalid range arguments (1 to 3 positional arguments)"
            case ast.Call(func=ast.Name(id="min" | "max" as name), args=args, keywords=keywords) if builtin(name):
                if keywords or len(args) not in (1, 2):  # Trace/Python.lean, l. 150-191
                    return f"invalid arguments ({name}() takes one sequence or two numbers)"
        return None

    if tree.args.vararg:
        yield tree.lineno, "varargs are not supported in NKI"
    for decorator in tree.decorator_list:
        if _last_name(decorator.func if isinstance(decorator, ast.Call) else decorator) not in _DECORATORS:
            yield decorator.lineno, f"unsupported decorator {ast.unparse(decorator)}"
    for node in nodes:
        what = _statement_problem(node) or _expression_problem(node, indexes) or name_problem(node)
        if what:
            yield node.lineno, what


def _statement_problem(node):
    """What the front end refuses in a statement, whatever its names mean: whole kinds of statement
    (gather.c ``stmt``, l. 1322-1371), loops (Simplify.lean ``stmt'``, l. 371-380), assignments and
    ``with`` blocks."""
    if type(node) in _STATEMENTS:
        return _STATEMENTS[type(node)]
    match node:
        case ast.For(orelse=[_, *_]):
            return "for-orelse is not supported in NKI"  # stmt' l. 371
        case ast.While(orelse=[_, *_]):
            return "while-orelse is not supported in NKI"  # stmt' l. 380
        case ast.For(target=target) if not isinstance(target, ast.Name):  # simpleVar l. 279, from stmt' l. 372
            return (f"expecting simple variable (the loop target {ast.unparse(target)}; loop over one name "
                    "and unpack it in the body)")
        case ast.For(iter=ast.Dict() | ast.Call(func=ast.Name(id="dict"))):  # Trace/Python.lean fetchIter l. 246-254
            return "not an iterable object (a dict; loop over its .keys(), .values() or .items())"
        case ast.Assign(targets=targets):
            return _assignment_problem(targets)
        case ast.With(items=items):
            return _with_problem(items)
    return None


def _expression_problem(node, indexes):
    """What the front end refuses in an expression, whatever its names mean: gather.c ``expr`` (l. 1079)
    and ``value`` (l. 819, 1057); Simplify.lean ``expr'``, ``binOp``, ``cmpOp``, ``keywords``,
    ``strValue`` and ``value``. ``indexes`` holds the ids of the nodes that are (one of) a subscript's
    indexes, the only place for ``...``."""
    if type(node) in _EXPRESSIONS:
        return f"unsupported expression ({_EXPRESSIONS[type(node)]})"
    match node:
        case ast.BinOp(op=ast.MatMult()) | ast.AugAssign(op=ast.MatMult()):
            return "the matmul operator is not supported in NKI"  # binOp l. 106
        case ast.Compare():
            return _comparison_problem(node)
        case ast.Starred():
            return "tuple expansion is not supported"  # expr' l. 224
        case ast.keyword(arg=None):
            return "keyword expansion is not supported"  # keywords l. 264
        case ast.Dict(keys=keys) if not all(isinstance(key, ast.Constant) and isinstance(key.value, str)
                                            for key in keys):
            return "expecting string (dict keys must be string literals)"  # strValue
        case ast.Constant(value=value) if value is Ellipsis and id(node) not in indexes:
            return "invalid use of ellipsis"  # value l. 60, index
        case ast.Constant(value=int(value)) if not isinstance(value, bool) and value > _INT32_MAX:
            return f"integer value ({value}) is too large"  # gather.c value l. 819
        case ast.FormattedValue(format_spec=spec) if spec is not None:
            return "NKI does no support format specifiers"  # gather.c l. 1057
    return None


def _constant_problem(value, name):
    """What gather.c refuses in a global the kernel names (``value``, l. 798-841, through ``const_expr``,
    l. 486-565, which walks tuples, lists and dicts): an int outside int32."""
    if isinstance(value, (tuple, list)):
        for item in value:
            problem = _constant_problem(item, name)
            if problem:
                return problem
    elif isinstance(value, dict):
        return _constant_problem(tuple(value.values()), name)
    elif isinstance(value, int) and not isinstance(value, bool) and not -_INT32_MAX - 1 <= value <= _INT32_MAX:
        return f"integer value ({value}) is too {'large' if value > 0 else 'small'} (the global {name})"
    return None


def _module_attribute_problem(module, attr):
    """``module.attr`` as gather.c's ``reference`` (l. 722-790) resolves it when it gathers the kernel: a
    Python function is gathered as kernel code, a class as an NKI class, a module stays a path, any other
    value becomes a constant through ``const_expr``/``value``. numpy's functions and types are skipped
    (``add_work``, l. 252: "skip numpy"), so the front end does not find them; builtin (C) functions, such
    as ``os.getcwd``, have no ``__dict__`` and ``value`` turns them into None. nki's own modules are
    KLR's builtins, not checked here."""
    qualified = f"{module.__name__}.{attr}"
    if module.__name__.split(".")[0] in ("nki", "nki_emulator"):
        return None
    if not hasattr(module, attr):
        return f"name {qualified} not found"
    value = getattr(module, attr)
    if module.__name__.split(".")[0] == "numpy" and (callable(value) or isinstance(value, type)):
        return f"name {qualified} not found (the front end does not gather numpy's functions and types)"
    if isinstance(value, (types.FunctionType, type, types.ModuleType)) or hasattr(value, "__dict__"):
        return None
    if callable(value):
        return f"{qualified} is a builtin function, which the front end reads as None (use nl or math)"
    return _constant_problem(value, qualified)


def _last_name(expr):
    """'b' of a name or attribute chain a.b, else None."""
    return expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else None


def _assignment_problem(targets):
    if sum(isinstance(target, (ast.Subscript, ast.Attribute)) for target in targets) > 1:
        return "mutating assignments must be in separate statements"
    for target in targets:
        if isinstance(target, ast.List):
            return "mutation not supported (a list as assignment target; write a tuple)"
        if isinstance(target, ast.Tuple):
            problem = _pattern_problem(target)
            if problem:
                return problem
    return None


def _pattern_problem(pattern):
    """What is wrong in a tuple assignment target: names or nested tuples of names only."""
    for element in pattern.elts:
        if isinstance(element, ast.Tuple):
            problem = _pattern_problem(element)
            if problem:
                return problem
        elif isinstance(element, ast.Attribute):
            return f"expecting simple variable ({ast.unparse(element)} in a tuple target)"
        elif not isinstance(element, (ast.Name, ast.Starred)):  # a Starred one is refused by itself
            return f"expecting pattern ({ast.unparse(element)} in a tuple target)"
    return None


def _with_problem(items):
    context = items[0].context_expr
    if len(items) > 1 or items[0].optional_vars or not isinstance(context, ast.Call) or context.args \
            or context.keywords or _last_name(context.func) is None:
        return "NKI only supports with statements with a single, simple function call as context"
    if _last_name(context.func) != "no_reorder":
        return f"invalid with context {ast.unparse(context.func)} (only no_reorder is supported)"
    return None


def _comparison_problem(compare):
    operators = compare.ops
    if len(operators) > 1 and any(isinstance(op, (ast.In, ast.NotIn)) for op in operators):
        return "the 'in' operator is not supported in NKI (in a chained comparison)"
    right = compare.comparators[0]
    if len(operators) == 1 and isinstance(right, ast.Constant) and right.value is None:
        return None  # x is None, x is not None
    for op in operators:
        if isinstance(op, ast.Is):
            return "the 'is' operator is not supported in NKI, use =="
        if isinstance(op, ast.IsNot):
            return "the 'is not' operator is not supported in NKI, use !="
    return None
