"""NKI 0.4's value model: what each kind of value supports while the front end traces a kernel.

The NKI 0.4 front end (leanprover/KLR, the public copy of NKI's tracer, @ 7ccd18c) does not run a kernel's Python: it
interprets it with its own values (``KLR/Trace/Types.lean`` ``Term``, l. 93-118). Each kind of value has a fixed set
of attributes, methods, operators, comparisons, ``in`` tests, iteration, subscripts and builtins; anything else
throws at trace time. :mod:`._subset` checks the syntax; this module checks the values, by running the kernel, and
every Python function it calls, as rewritten code:

**Enforcement.** When a kernel runs, its function and each plain Python function it calls (its own helpers, other
modules' helpers such as nki-library's, NKIObject methods and ``__init__``, functions passed as values; not
nki_emulator's, numpy's, torch's or the standard library's) are rewritten once from their source (an AST rewrite,
cached per function; line numbers kept): attribute loads and stores, subscripts and subscript stores, binary and
unary operators, comparisons, ``in``, ``for`` iterators and the builtins ``len min max abs int float divmod tuple
list dict isinstance`` become calls of the checks below, which look at the values' kinds at run time, then do what
the front end does: mostly what Python does, and where KLR computes something else without refusing, what KLR
computes (integer ``%`` and ``//`` as Lean's Int: ``7 // -2`` is -3; ``min(1, 2.5)`` is 1.0; ``[1, 2].index(5)``
is None; a loop runs over the items its list held when it started). Where KLR silently drops an argument
(``list.pop(0)``, ``list.count(x)``, ``isinstance(x, (A, B))``) the emulator refuses instead. A refusal is a
:class:`NkiValidationError` naming the kernel line, the front end's own words and the source line of the rule. A
kernel's int arguments are checked too. Attribute loads on a global module or class (``nl.ndarray``, ``E.x``) are
left alone, as are ``is None`` tests.

**What it cannot see.** Code it does not rewrite: functions without source (a ``@dataclass``'s generated
``__init__``, lambdas, builtins), properties; what nki_emulator's
own ``nl``/``nisa`` functions do with the values they are given (their arguments are KLR's builtins' business and
are checked there); values of kinds the model does not know (objects of other classes, emulator constants such as
dtypes and enums: passed through unchecked); floats are Python's 64-bit floats, not the guide's 32-bit ones; Python's
short-circuit ``and``/``or`` and ``if`` truthiness are Python's (KLR's ``isTrue``, Types.lean l. 571-604, agrees
except on slices and ellipses).

**Versions.** NKI 0.5 and 0.6 keep this front end; their tensors gain the view methods of the 0.5 API stub
(aws-neuron-sdk ee7d6e00 nki/api/nki/language/__init__.py ``NkiTensor``). NKI 0.7 (Neuron 2.33) specialises kernels
by running plain Python (a tracer), so the whole language is there during specialisation: under
``set_nki_version("0.7")`` a kernel runs as plain Python, unrewritten, and nki.jit skips the syntax check.

The table :data:`VALUE_KINDS` lists every kind, what it supports and the source lines; docs/kernels.md carries it.
"""

import ast
import builtins
import inspect
import operator
import sys
import textwrap
import types
from enum import Enum

import numpy as np

from . import _runtime
from ._memory import NkiTensor
from .language import NKIObject
from ._runtime import NkiValidationError

KLR = "leanprover/KLR KLR/Trace/"
GUIDE = "aws-neuron-sdk 3afa0fdf nki/get-started/nki-language-guide.rst"
STUB = "aws-neuron-sdk 3afa0fdf nki/api/nki/language/__init__.py"

# (kind, what it supports, where the front end says so)
VALUE_KINDS = (
    ("None", "no attributes, operators or order; iterates as empty; len 0",
     f"{KLR}Term.lean l. 552, 114; Python.lean l. 251, 388-398"),
    ("bool", "arithmetic and bitwise with an int (as 0/1), not with a bool or a float; order with numbers",
     f"{KLR}Term.lean l. 103-105, 147-161"),
    ("int", "+ - * / // % ** << >> & | ^ (// and % round as Lean's Int: toward floor of a positive divisor; / "
            "gives a float; a negative ** exponent counts as 0; bitwise on 64-bit unsigned); 32-bit: a result "
            "or a kernel argument outside int32 is refused; no attributes",
     f"{KLR}Term.lean l. 53-74, 552; {GUIDE} l. 145; KLR interop/klr/gather.c l. 816-819, 1723"),
    ("float", "+ - * / // ** with ints and floats; no % and no bitwise operators; no attributes",
     f"{KLR}Term.lean l. 76-85, 106-109, 552"),
    ("string", "+ with a string; order; `in` a string (substring); no subscript, methods or attributes",
     f"{KLR}Term.lean l. 120, 170, 426, 552; Python.lean l. 65"),
    ("tuple", "+ with a tuple, * by an int or bool; order; `in`; iteration; index and slice (step > 0, bounds "
              "checked, no clamping); no methods or attributes",
     f"{KLR}Term.lean l. 122-126, 171, 299-326, 427, 552; Python.lean l. 63, 252"),
    ("list", "append clear copy extend reverse, pop() (no index), index (None when absent), remove (every "
             "equal item); count and sort are not there; + with a list, * by an int; order; `in`; iteration; "
             "index, slice and item assignment (index >= 0)",
     f"{KLR}Term.lean l. 475-487, 121-124; Python.lean l. 281-319; NKI.lean l. 342-351; {GUIDE} l. 157-177"),
    ("dict", "clear copy get items keys pop setdefault values (keys, values and items are lists); string keys; "
             "no `in`, no iteration, no update",
     f"{KLR}Term.lean l. 488-498, 328-334; Python.lean l. 58-66, 246-254, 340-383; NKI.lean l. 352-360; "
     f"{GUIDE} l. 179-199"),
    ("tensor", "shape dtype buffer offset ndim size name address address_name pattern get_pattern is_identity "
               "reshape view ap (0.5+: and the 0.5 stub's view methods); indexing; no operators, `in` or "
               "iteration, no item assignment",
     f"{KLR}Term.lean l. 99-101, 519-542; NKI.lean l. 367-370; {GUIDE} l. 206-245; {STUB} l. 26-104"),
    ("NKIObject object", "its fields (get and set), its class's methods, operator methods it defines "
                         "(__add__, __getitem__, __setitem__, ...); == is structural",
     f"{KLR}Term.lean l. 499-510; NKI.lean l. 165-188, 361-379; {GUIDE} l. 472-530, 564"),
    ("enum member", "name and value; == and != only", f"{GUIDE} l. 532-564"),
    ("slice", "start stop step", f"{KLR}Term.lean l. 543-551"),
    ("module, class, function", "their attributes and calls", f"{KLR}Term.lean l. 471-474"),
    ("builtins", "len (tuple, list, dict), min/max (a tuple or list, or two numbers; an int and a float give a "
                 "float), abs int float (numbers, strings for int/float), divmod (ints), tuple/list (of a "
                 "tuple, list or None), dict() or dict(pairs), isinstance (one class, not a tuple)",
     f"{KLR}Python.lean l. 79-100, 142-240, 271-279, 340-343, 388-398"),
)

_INT32 = (-2 ** 31, 2 ** 31 - 1)
_NUMBERS = ("bool", "int", "float")
_SEQUENCES = ("tuple", "list")
_PASSED = ("opaque", "module", "class", "function")  # kinds whose attributes and operators are not checked here

# tensor attributes: KLR Term.lean l. 519-542, the guide l. 206-245, the 0.4 API stub l. 26-104
_TENSOR_0_4 = frozenset({"dtype", "shape", "address", "offset", "pattern", "reshape", "ap", "buffer", "view", "name",
                         "address_name", "ndim", "size", "get_pattern", "is_identity"})
# NKI 0.5 (Neuron 2.31, aws-neuron-sdk ee7d6e00 nki/api/nki/language/__init__.py NkiTensor, l. 24-394) adds views
_TENSOR_0_5 = _TENSOR_0_4 | {"is_contiguous", "is_indirect", "permute", "broadcast", "expand_dim", "squeeze_dim",
                             "reshape_dim", "flatten_dims", "rearrange", "slice", "select", "vector_select",
                             "indirect"}
_TENSOR_ATTRIBUTES = {"0.4": _TENSOR_0_4, "0.5": _TENSOR_0_5, "0.6": _TENSOR_0_5}
_LIST_METHODS = frozenset({"append", "clear", "copy", "extend", "reverse", "pop", "index", "remove", "count", "sort"})
_DICT_METHODS = frozenset({"clear", "copy", "get", "items", "keys", "pop", "setdefault", "values"})


def kind(value):
    """The front end's kind of ``value``: a key of the model, or "opaque" for values it does not check."""
    found = _KIND_OF_TYPE.get(type(value))
    if found is not None:
        return found
    if isinstance(value, NKIObject):
        return "object"
    for base, name in _KIND_OF_BASE:
        if isinstance(value, base):
            return name
    if isinstance(value, Enum):
        return "opaque" if type(value).__module__.startswith("nki_emulator") else "enum"
    return "class" if isinstance(value, type) else "opaque"


_KIND_OF_TYPE = {type(None): "none", bool: "bool", int: "int", float: "float", str: "string", tuple: "tuple",
                 list: "list", dict: "dict", NkiTensor: "tensor", slice: "slice", types.ModuleType: "module",
                 types.FunctionType: "function", types.MethodType: "function", range: "range"}
_KIND_OF_BASE = ((np.bool_, "bool"), (np.integer, "int"), (np.floating, "float"), (str, "string"),
                 (tuple, "tuple"), (list, "list"), (dict, "dict"))


def _klr_name(value):
    """The kind as KLR's ``Term.kindStr`` (Types.lean l. 122-144) prints it."""
    found = kind(value)
    if found == "object":
        return f"<{type(value).__name__} object>"
    return {"none": "none", "tensor": "access", "function": "source", "enum": f"<{type(value).__name__} object>",
            "range": "range"}.get(found, found)


# ---- refusals ----------------------------------------------------------------------------------------------------

_REWRITTEN = set()  # code objects of rewritten functions: where a refusal looks for the kernel's line


def refuse(words, why, source):
    """Raise the front end's ``words`` at the line of rewritten kernel code that is running."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in _REWRITTEN:
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}: " if frame else ""
    raise NkiValidationError(f"{where}{words} ({why}; NKI {_runtime.nki_version()}'s front end, {source})")


def _check_int(value):
    if not _INT32[0] <= value <= _INT32[1]:
        refuse(f"integer value ({value}) is too {'large' if value > 0 else 'small'}",
               "NKI integers are 32-bit",
               f"{GUIDE} l. 145; the same limit on literals: KLR interop/klr/gather.c l. 816-819")
    return value


def check_arguments(arguments):
    """A kernel's arguments ("argument 0" -> value) as gather.c converts them (``const_exprs``, l. 1723, through
    ``const_expr`` and ``value``, l. 486-565, 798-841): an int outside int32, also inside a tuple, list or dict,
    is refused."""
    for name, value in arguments.items():
        for number in _integers(value):
            if not _INT32[0] <= number <= _INT32[1]:
                raise NkiValidationError(
                    f"nki.jit: kernel {name}: integer value ({number}) is too "
                    f"{'large' if number > 0 else 'small'} (NKI integers are 32-bit; NKI "
                    f"{_runtime.nki_version()}'s front end, leanprover/KLR interop/klr/gather.c l. 816-819, 1723)")


def _integers(value):
    found = kind(value)
    if found == "int":
        yield int(value)
    elif found in _SEQUENCES or found == "dict":
        for item in value.values() if found == "dict" else value:
            yield from _integers(item)


# ---- attributes ---------------------------------------------------------------------------------------------------

def get_attribute(value, name):
    """``value.name`` (Term.lean ``Term.attr``, l. 469-552)."""
    if type(value) is NkiTensor:
        if name in _TENSOR_ATTRIBUTES.get(_runtime._nki_version, _TENSOR_0_5):
            return getattr(value, name)
        refuse(f"unsupported attribute {name} (type is tensor access)", "a tensor's attributes are shape, dtype, "
               "buffer, offset, ndim, size, name, get_pattern, reshape, view, ap ...",
               f"{KLR}Term.lean l. 519-542; {GUIDE} l. 206-245; {STUB} l. 26-104")
    found = kind(value)
    if found in _PASSED:
        return getattr(value, name)
    if found == "list":
        return _list_method(value, name)
    if found == "dict":
        return _dict_method(value, name)
    if found == "object":
        return _object_attribute(value, name)
    if found == "enum" and name in ("name", "value"):
        return getattr(value, name)
    if found == "slice" and name in ("start", "stop", "step"):
        return getattr(value, name)
    if found == "slice":
        refuse(f"{name} is not an attribute {name} of slice", "a slice has start, stop and step",
               f"{KLR}Term.lean l. 543-551")
    refuse(f"unsupported attribute {name}", f"a {_klr_name(value)} has no attributes or methods",
           f"{KLR}Term.lean l. 552")


def _object_attribute(obj, name):
    """An NKIObject's field, or a method of its class (Term.lean l. 499-510)."""
    if name in getattr(obj, "__dict__", ()) or any(name in cls.__dict__ for cls in type(obj).__mro__[:-1]):
        return getattr(obj, name)
    refuse(f"{name} is not an attribute of {type(obj).__name__}", "an object has its fields and its class's methods",
           f"{KLR}Term.lean l. 499-510")


def set_attribute(obj, name, value, written_as):
    """``obj.name = value``: only an NKIObject's fields can be set (NKI.lean ``mutate``, l. 371-381)."""
    if kind(obj) != "object":
        refuse(f"{written_as}.{name} is immutable", f"only NKIObject objects take attribute assignment, not a "
               f"{_klr_name(obj)}", f"{KLR}NKI.lean l. 371-381; {GUIDE} l. 475-491")
    object.__setattr__(obj, name, value) if _is_frozen(obj) else setattr(obj, name, value)


def _is_frozen(obj):
    """A frozen dataclass NKIObject: KLR sets its fields all the same (NKI.lean l. 378-379 ignores Python's
    frozen flag; nki-library's rmsnorm_quant.py declares its NKIObject parameter classes frozen)."""
    params = getattr(type(obj), "__dataclass_params__", None)
    return params is not None and params.frozen


def _list_method(values, name):
    """A list's methods (Term.lean l. 475-487) as KLR's builtins do them (Python.lean l. 281-319)."""
    if name in ("append", "clear", "copy", "reverse"):
        return getattr(values, name)
    if name not in _LIST_METHODS:
        refuse(f"{name} is not an attribute of list", "lists have append, clear, copy, extend, index, pop, remove, "
               "reverse", f"{KLR}Term.lean l. 475-487")
    if name == "sort":
        refuse("unimplemented API builtin.list.sort", "list.sort is named but has no builtin",
               f"{KLR}Term.lean l. 486, 723-726; Python.lean l. 281-319")
    return _LIST_BUILTINS[name](values)


def _list_extend(values):
    def extend(items):
        values.extend(_iterable(items, "list.extend"))
    return extend


def _list_pop(values):
    def pop(*index):
        if index:
            refuse("list.pop takes no index", "KLR's builtin.list.pop drops the argument and pops the last item; "
                   "pop() it is", f"{KLR}Python.lean l. 309-312; Builtin.lean l. 182-195")
        return values.pop()
    return pop


def _list_count(values):
    def count(*item):
        if item:
            refuse("list.count takes no argument", "KLR's builtin.list.count drops it and gives the list's length",
                   f"{KLR}Python.lean l. 293-295; Builtin.lean l. 182-195")
        return len(values)
    return count


def _list_index(values):
    def index(item, start=0, stop=2 ** 64):
        """The first equal item's index, None when there is none in [start, stop) (no ValueError)."""
        found = next((i for i, value in enumerate(values) if value == item), None)
        return found if found is not None and start <= found < stop else None
    return index


def _list_remove(values):
    def remove(item):
        """Every equal item removed; none is no error (Python.lean l. 314-316)."""
        values[:] = [value for value in values if value != item]
    return remove


_LIST_BUILTINS = {"extend": _list_extend, "pop": _list_pop, "count": _list_count, "index": _list_index,
                  "remove": _list_remove}


def _dict_method(mapping, name):
    """A dict's eight methods (Term.lean l. 488-498) as KLR's builtins do them (Python.lean l. 340-383)."""
    if name not in _DICT_METHODS:
        refuse(f"{name} is not an attribute of dict", "dicts have clear, copy, get, items, keys, pop, setdefault, "
               "values", f"{KLR}Term.lean l. 488-498; {GUIDE} l. 179-199")
    if name in ("clear", "copy"):
        return getattr(mapping, name)
    if name == "keys":
        return lambda: list(mapping)
    if name == "values":
        return lambda: list(mapping.values())
    if name == "items":
        return lambda: list(mapping.items())
    method = getattr(mapping, name)

    def keyed(key, default=None):
        _string_key(key, "Failed to resolve an argument 'key', ",
                    f"{KLR}Builtin.lean l. 90-95; FromNKI.lean l. 122-125")
        return method(key, default)
    return keyed


def _string_key(key, prefix, source):
    """A dict key is a string; a dtype (an opaque value here) is one in KLR (Term.lean ``attr`` "dtype", l. 521-527,
    gives the dtype's name), and nki-library's kernel_helpers.py l. 394 looks dtypes up in a dict on hardware."""
    if kind(key) not in ("string", "opaque"):
        refuse(f"{prefix}expecting 'string', got '{_klr_name(key)}'", "dict keys are strings", source)


# ---- subscripts ---------------------------------------------------------------------------------------------------

def get_item(value, key):
    """``value[key]`` (Term.lean ``access``, l. 423-444)."""
    if type(value) is NkiTensor:
        return value[key]
    found = kind(value)
    if found in _SEQUENCES:
        return _sequence_item(value, key)
    if found == "dict":
        _string_key(key, "", f"{KLR}Term.lean l. 328-334; FromNKI.lean l. 122-125")
        if key not in value:
            refuse(f"key {key} not found in dictionary", "the dict has no such key", f"{KLR}Term.lean l. 332")
        return value[key]
    if found == "string":
        refuse("string subscript not implemented", "strings cannot be indexed", f"{KLR}Term.lean l. 426")
    if found in _PASSED or (found == "object" and hasattr(type(value), "__getitem__")):
        return value[key]
    refuse(f"subscript not supported, for '{_klr_name(value)}'", "only tensors, tuples, lists, dicts and objects "
           "with __getitem__ take subscripts", f"{KLR}Term.lean l. 444; NKI.lean l. 209-215")


def _sequence_item(values, key):
    """A tuple's or list's item or slice as ``listAccess`` (Term.lean l. 299-326): no clamping, no step <= 0."""
    source = f"{KLR}Term.lean l. 299-326"
    size = len(values)
    if kind(key) in ("bool", "int"):
        index = int(key) + size if int(key) < 0 else int(key)
        if index < 0:
            refuse(f"negative index ({index}) out of bounds", "the index is before the first item", source)
        if index >= size:
            refuse(f"index ({index}) out of bounds", f"the {_klr_name(values)} has {size} items", source)
        return values[index]
    if type(key) is not slice:
        refuse(f"index must be an integer or slice, got {_klr_name(key)}", "a tuple or list takes one index", source)
    start, stop, step = (_slice_bound(key.start, 0), _slice_bound(key.stop, size), _slice_bound(key.step, 1))
    if step <= 0:
        refuse("slice step cannot be zero or negative", "slices of tuples and lists step forward", source)
    start, stop = start + size if start < 0 else start, stop + size if stop < 0 else stop
    if not (0 <= start <= size and 0 <= stop <= size):
        refuse("slice index out of bounds", f"the slice {key.start}:{key.stop} leaves the {size} items (KLR does "
               "not clamp as Python does)", source)
    return values[start:stop:step]


def _slice_bound(bound, default):
    if bound is None:
        return default
    if kind(bound) not in ("bool", "int"):
        refuse(f"expecting 'integer', got '{_klr_name(bound)}'", "slice bounds are integers",
               f"{KLR}NKI.lean l. 252-260; FromNKI.lean l. 80-89")
    return int(bound)


def set_item(container, key, value):
    """``container[key] = value`` (NKI.lean ``mutate``, l. 337-370)."""
    found = kind(container)
    if found == "list":
        if kind(key) not in ("bool", "int"):
            refuse(f"expecting 'integer', got '{_klr_name(key)}'", "a list item is set by its index",
                   f"{KLR}NKI.lean l. 345; FromNKI.lean l. 80-99")
        if key < 0:
            refuse("expecting positive 'integer', got 'int'", "a list item is set by a non-negative index",
                   f"{KLR}NKI.lean l. 345; FromNKI.lean l. 94-99")
        if key >= len(container):
            refuse("index out of range", f"the list has {len(container)} items", f"{KLR}NKI.lean l. 347-350")
    elif found == "dict":
        _string_key(key, "", f"{KLR}NKI.lean l. 355; FromNKI.lean l. 122-125")
    elif found == "object" and not hasattr(type(container), "__setitem__"):
        refuse(f"class {type(container).__name__} does not have a __setitem__ method", "objects take item "
               "assignment through __setitem__", f"{KLR}NKI.lean l. 361-366")
    elif found not in ("object", "opaque"):
        refuse("Value is not modifiable", f"a {_klr_name(container)} takes no item assignment"
               + ("; write a tile with an nki.isa instruction" if found == "tensor" else ""),
               f"{KLR}NKI.lean l. 367-370")
    container[key] = value


# ---- operators ----------------------------------------------------------------------------------------------------

_PYTHON_OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
                     "mod": operator.mod, "pow": operator.pow, "floor": operator.floordiv,
                     "lshift": operator.lshift, "rshift": operator.rshift, "or": operator.or_, "xor": operator.xor,
                     "and": operator.and_}
_DUNDER = {"div": "truediv", "floor": "floordiv"}
_U64 = 2 ** 64


def binary(op, left, right):
    """``left op right`` as KLR's ``binop`` (Term.lean l. 97-128, 216-226; overloads NKI.lean l. 165-188, 216-224)."""
    kinds = (kind(left), kind(right))
    if _overloaded(op, left, right, kinds) or any(k in _PASSED for k in kinds):
        return _PYTHON_OPERATORS[op](left, right)
    if "tensor" in kinds:
        refuse("binary operators on tensors not supported. Use nki.isa directly.", "tensor arithmetic is an "
               "nki.isa instruction", f"{KLR}Term.lean l. 99-101")
    if "enum" in kinds:
        refuse(f"unimplemented operator '{op}'", "No other binary operators on enum values are supported",
               f"{GUIDE} l. 564")
    if op == "add" and kinds[0] == kinds[1] and kinds[0] in ("string", "list", "tuple"):
        return left + right
    if op == "mul" and (kinds[0] in _SEQUENCES or kinds[1] in _SEQUENCES):
        return _repeat(left, right) if kinds[0] in _SEQUENCES else _repeat(right, left)
    if kinds[0] in ("bool", "int") and kinds[1] in ("bool", "int") and kinds != ("bool", "bool"):
        return _integer_operation(op, int(left), int(right))
    if kinds[0] in ("int", "float") and kinds[1] in ("int", "float"):
        return _float_operation(op, float(left), float(right))
    refuse(f"unimplemented operator '{op}'", f"no {op} between a {_klr_name(left)} and a {_klr_name(right)}",
           f"{KLR}Term.lean l. 97-128")


def _overloaded(op, left, right, kinds):
    """An NKIObject operand whose class defines the operator (``__add__``; ``__radd__`` on the right)."""
    name = _DUNDER.get(op, op)
    return (kinds[0] == "object" and hasattr(type(left), f"__{name}__")) or \
        (kinds[1] == "object" and hasattr(type(right), f"__r{name}__"))


def _repeat(sequence, times):
    """``mulseq`` (Term.lean l. 45-49): by a bool or an int (negative: empty)."""
    if kind(times) == "bool":
        return sequence if times else sequence[:0]
    if kind(times) != "int":
        refuse(f"can't multiply sequence by '{_klr_name(times)}'", "a tuple or list repeats an int number of times",
               f"{KLR}Term.lean l. 45-49")
    return sequence * max(int(times), 0)


def _integer_operation(op, left, right):
    """``intOp``/``uintOp`` (Term.lean l. 53-74): Lean's Int / and % (Euclidean), bitwise on UInt64; 32-bit."""
    if op in ("div", "floor") and right == 0:
        refuse("division by zero", "an integer divided by 0", f"{KLR}Term.lean l. 68, 72")
    if op == "div":
        return left / right
    if op in ("mod", "floor"):
        return _check_int(_lean_division(left, right)[op == "mod"])
    if op == "pow":
        return _check_int(left ** max(right, 0))
    if op in ("add", "sub", "mul"):
        return _check_int(_PYTHON_OPERATORS[op](left, right))
    left, right = left % _U64, right % _U64
    if op in ("lshift", "rshift"):
        right %= 64
    return _check_int(_PYTHON_OPERATORS[op](left, right) % _U64)


def _lean_division(left, right):
    """Lean's ``Int`` ``/`` and ``%`` (Euclidean: the remainder is never negative; ``x / 0`` is 0, ``x % 0`` is x)."""
    if right == 0:
        return 0, left
    remainder = left % abs(right)
    return (left - remainder) // right, remainder


def _float_operation(op, left, right):
    """``floatOp`` (Term.lean l. 76-85): IEEE doubles, no exception on division by 0; no % and no bitwise."""
    if op not in ("add", "sub", "mul", "div", "pow", "floor"):
        refuse(f"floating point numbers do not support operator '{op}'", "% and bitwise operators take integers",
               f"{KLR}Term.lean l. 76-85")
    with np.errstate(all="ignore"):
        left, right = np.float64(left), np.float64(right)
        result = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power}[op](
            left, right) if op != "floor" else np.floor(left / right)
    return float(result)


def negate(value):
    """``-value`` (Python.lean ``builtin.op.negate``, l. 45-49): ints and floats only."""
    found = kind(value)
    if found in ("int", "float") or found in _PASSED or (found == "object" and hasattr(type(value), "__neg__")):
        return _check_int(-value) if found == "int" else -value
    refuse("cannot negate values of this type", f"a {_klr_name(value)} has no negative", f"{KLR}Python.lean l. 45-49")


def invert(value):
    """``~value`` (Python.lean ``builtin.op.invert``, l. 54-56): the int's 32-bit complement."""
    if kind(value) in _PASSED:
        return ~value
    if kind(value) not in ("bool", "int"):
        refuse(f"expecting 'integer', got '{_klr_name(value)}'", "~ takes an integer", f"{KLR}Python.lean l. 54-56")
    return ~_check_int(int(value))


# ---- comparisons, in, iteration -----------------------------------------------------------------------------------

def equal(left, right):
    """``left == right``: structural, objects included (Term.lean l. 202; the guide l. 564)."""
    if isinstance(left, NKIObject) and type(left) is type(right) and type(left).__eq__ is object.__eq__:
        return left is right or vars(left) == vars(right)
    return left == right


def less(left, right):
    """``termLt`` (Term.lean l. 147-182): numbers, strings, and tuples or lists item by item."""
    kinds = (kind(left), kind(right))
    if kinds[0] in _NUMBERS and kinds[1] in _NUMBERS or kinds == ("string", "string"):
        return left < right
    if kinds[0] == kinds[1] and kinds[0] in _SEQUENCES:
        for x, y in zip(left, right):
            if less(x, y):
                return True
            if not equal(x, y):
                return False
        return len(left) < len(right)
    if any(k in _PASSED for k in kinds) or (kinds[0] == "object" and hasattr(type(left), "__lt__")
                                            and type(left).__lt__ is not object.__lt__):
        return left < right
    refuse(f"unsupported comparison between '{_klr_name(left)}' and '{_klr_name(right)}'", "order compares numbers, "
           "strings, tuples and lists", f"{KLR}Term.lean l. 147-182")


def less_equal(left, right):
    return equal(left, right) or less(left, right)  # Term.lean l. 205


def greater(left, right):
    return not equal(left, right) and not less(left, right)  # Term.lean l. 206


def greater_equal(left, right):
    return not less(left, right)  # Term.lean l. 207


def contains(item, container):
    """``item in container`` (Python.lean ``isin``, l. 58-66): tuples, lists, and a string in a string."""
    found = kind(container)
    if found in _SEQUENCES or found in _PASSED or (found == "string" and kind(item) == "string"):
        return item in container
    refuse(f"in operator not support on types {_klr_name(item)} and {_klr_name(container)}",
           "`in` tests tuples, lists and strings" + (", not dicts: test d.get(key) or key in d.keys()"
                                                       if found == "dict" else ""),
           f"{KLR}Python.lean l. 58-66; nki-library core/utils/tensor_view.py l. 683-689 (NKIFE-594)")


def iterate(values):
    """A ``for`` loop's iterator other than a range call (Python.lean ``fetchIter``, l. 246-254; the guide l. 361)."""
    return _iterable(values, "a for loop")


def _iterable(values, what):
    """The items ``values`` gives a loop: those it holds when the loop starts (NKI.lean l. 487-498 fetches them
    once), so appending to a list inside its own loop does not lengthen the loop."""
    found = kind(values)
    if found == "tuple":
        return values
    if found == "list":
        return tuple(values)
    if found == "none":
        return ()
    if found == "opaque":
        return values
    hint = {"dict": " (a dict: loop over d.keys(), d.values() or d.items())",
            "range": " (a range is only a for loop's own iterator: write range(...) in the for header)"}
    refuse("not an iterable object" + hint.get(found, ""), f"{what} takes a tuple, a list or a range, not a "
           f"{_klr_name(values)}", f"{KLR}Python.lean l. 246-254; {GUIDE} l. 361")


# ---- builtins (Python.lean, builtin.python.*) ---------------------------------------------------------------------

def builtin_len(values):
    """``len`` (Python.lean l. 388-398): tuples, lists, None, dicts."""
    found = kind(values)
    if found in _SEQUENCES or found == "dict" or found == "opaque":
        return len(values)
    if found == "none":
        return 0
    refuse(f"expected a list of a dictionary; found {_klr_name(values)}", "len takes a tuple, list or dict",
           f"{KLR}Python.lean l. 388-398")


def _extreme(name, pick, args):
    """``min``/``max`` (Python.lean l. 142-191): one tuple or list, or two numbers; an int and a float give a float."""
    source = f"{KLR}Python.lean l. 142-191"
    if len(args) == 1 and kind(args[0]) in _SEQUENCES:
        args = args[0]
        if not args:
            refuse(f"can't take {name} of empty sequence", "the sequence is empty", source)
    elif len(args) != 2:
        refuse("invalid arguments", f"{name} takes one tuple or list, or two numbers", source)
    result = args[0]
    for value in args[1:] if len(args) > 1 else ():
        kinds = (kind(result), kind(value))
        if not (kinds[0] in ("int", "float") and kinds[1] in ("int", "float")):
            if "opaque" in kinds:
                result = pick(result, value)
                continue
            refuse("invalid arguments", f"{name} compares ints and floats, not a {_klr_name(result)} and a "
                   f"{_klr_name(value)}", source)
        result = pick(float(result), float(value)) if "float" in kinds else pick(result, value)
    return result


def builtin_min(*args):
    return _extreme("min", min, args)


def builtin_max(*args):
    return _extreme("max", max, args)


def builtin_abs(value):
    """``abs`` (Python.lean l. 193-200): bools, ints and floats."""
    found = kind(value)
    if found in _NUMBERS or found in _PASSED:
        return abs(value)
    refuse("abs expects an integer or float number", f"not a {_klr_name(value)}", f"{KLR}Python.lean l. 193-200")


def builtin_int(value):
    """``int`` (Python.lean l. 208-227): None refused; bools, ints, floats (toward 0) and strings."""
    found = kind(value)
    if found == "none":
        refuse("None cannot be converted to an integer", "int(None)", f"{KLR}Python.lean l. 210")
    if found in _NUMBERS or found in _PASSED:
        return _check_int(int(value))
    if found == "string":
        try:
            return _check_int(int(value))
        except ValueError:
            refuse(f"string {value} cannot be converted to an integer", "not an integer",
                   f"{KLR}Python.lean l. 221-226")
    refuse("value cannot be converted to an integer", f"int of a {_klr_name(value)}", f"{KLR}Python.lean l. 227")


def builtin_float(value):
    """``float`` (Python.lean l. 229-237)."""
    found = kind(value)
    if found == "none":
        refuse("None cannot be converted to an number", "float(None)", f"{KLR}Python.lean l. 231")
    if found in _NUMBERS or found in _PASSED or found == "string":
        return float(value)
    refuse("value cannot be converted to an number", f"float of a {_klr_name(value)}", f"{KLR}Python.lean l. 237")


def builtin_divmod(x, y):
    """``divmod`` (Python.lean l. 239-240): ints, Lean's Int division and remainder (no check for 0)."""
    for name, value in (("x", x), ("y", y)):
        if kind(value) not in ("bool", "int"):
            refuse(f"Failed to resolve an argument '{name}', expecting 'integer', got '{_klr_name(value)}'",
                   "divmod takes integers", f"{KLR}Python.lean l. 239-240; Builtin.lean l. 90-95")
    return tuple(_check_int(part) for part in _lean_division(int(x), int(y)))


def builtin_tuple(*values):
    """``tuple`` (Python.lean l. 271-273): of a tuple, a list or None."""
    return tuple(_iterable(_one_argument("tuple", values), "tuple()"))


def builtin_list(*values):
    """``list`` (Python.lean l. 275-279): of a tuple, a list or None."""
    return list(_iterable(_one_argument("list", values), "list()"))


def _one_argument(name, values):
    if len(values) != 1:
        refuse(f"argument 't' not found, in builtin function 'builtin_python_{name}'", f"{name}() takes one tuple, "
               "list or None", f"{KLR}Python.lean l. 271-279; Builtin.lean l. 96-105")
    return values[0]


def builtin_dict(*args, **kwargs):
    """``dict()`` or ``dict(pairs)`` (Python.lean l. 340-343): string keys; keyword arguments are not its parameters."""
    if kwargs:
        refuse(f"unexpected keyword argument '{next(iter(kwargs))}' in builtin function 'builtin_python_dict'",
               "dict() takes no keyword arguments: build the dict with a literal or item assignment",
               f"{KLR}Python.lean l. 340-343; Builtin.lean l. 188-193")
    pairs = list(_iterable(args[0], "dict()")) if args else []
    for pair in pairs:
        if kind(pair) not in _SEQUENCES or len(pair) != 2:
            refuse(f"expecting 'pair', got '{_klr_name(pair)}'", "dict() takes (key, value) pairs",
                   f"{KLR}Python.lean l. 340-343; FromNKI.lean l. 60-64")
        _string_key(pair[0], "", f"{KLR}Python.lean l. 340-343; FromNKI.lean l. 122-125")
    return dict(pairs)


def builtin_isinstance(value, classes):
    """``isinstance`` (Python.lean l. 79-100): one class; KLR matches a tuple of classes against nothing."""
    if kind(classes) == "tuple":
        refuse("isinstance takes one class", "KLR's builtin.python.isinstance compares with one class and gives "
               "False for a tuple of them: test each class", f"{KLR}Python.lean l. 79-100")
    return isinstance(value, classes)


CHECKED_BUILTINS = {"len": builtin_len, "min": builtin_min, "max": builtin_max, "abs": builtin_abs,
                    "int": builtin_int, "float": builtin_float, "divmod": builtin_divmod, "tuple": builtin_tuple,
                    "list": builtin_list, "dict": builtin_dict, "isinstance": builtin_isinstance}


# ---- the rewrite --------------------------------------------------------------------------------------------------

def _fast_binary(op):
    """The checked ``op`` with a fast path for two ints (a result inside int32) or two floats."""
    python, slow = _PYTHON_OPERATORS[op], binary
    low, high = _INT32
    integer_fast = op in ("add", "sub", "mul")
    positive_divisor_fast = op in ("mod", "floor")  # Lean's Int and Python agree for a positive divisor

    def check(left, right):
        if type(left) is int and type(right) is int:
            if integer_fast or (positive_divisor_fast and right > 0):
                result = python(left, right)
                if low <= result <= high:
                    return result
        elif type(left) is float and type(right) is float and integer_fast:
            return python(left, right)
        return slow(op, left, right)
    check.__name__ = f"checked_{op}"
    return check


_HELPERS = {"_nki_attr": get_attribute, "_nki_setattr": set_attribute, "_nki_getitem": get_item,
            "_nki_setitem": set_item, "_nki_eq": equal, "_nki_lt": less, "_nki_le": less_equal, "_nki_gt": greater,
            "_nki_ge": greater_equal, "_nki_in": contains, "_nki_iter": iterate, "_nki_negate": negate,
            "_nki_invert": invert, "_nki_slice": slice,
            **{f"_nki_{op}": _fast_binary(op) for op in _PYTHON_OPERATORS},
            **{f"_nki_b_{name}": check for name, check in CHECKED_BUILTINS.items()}}
_AST_OPERATORS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.Mod: "mod", ast.Pow: "pow",
                  ast.FloorDiv: "floor", ast.LShift: "lshift", ast.RShift: "rshift", ast.BitOr: "or",
                  ast.BitXor: "xor", ast.BitAnd: "and"}
_AST_COMPARISONS = {ast.Eq: "_nki_eq", ast.NotEq: "_nki_eq", ast.Lt: "_nki_lt", ast.LtE: "_nki_le", ast.Gt: "_nki_gt",
                    ast.GtE: "_nki_ge", ast.In: "_nki_in", ast.NotIn: "_nki_in"}
_RANGES = {"range", "affine_range", "sequential_range", "static_range", "dynamic_range"}
_NOT_TRACED = frozenset({"nki_emulator", "nki", "numpy", "torch", "ml_dtypes", "pytest", "_pytest"}) \
    | frozenset(sys.stdlib_module_names)


def _traceable_module(name):
    return (name or "").partition(".")[0] not in _NOT_TRACED


class _Rewrite(ast.NodeTransformer):
    """Turns one function's value operations into calls of the checks above (see the module docstring)."""

    def __init__(self, function, local_names):
        self.globals, self.local_names, self.temporaries = function.__globals__, local_names, 0

    def call(self, helper, *args):
        return ast.Call(ast.Name(helper, ast.Load()), list(args), [])

    def global_value(self, node):
        """What a global (or builtin) name holds now, if ``node`` is such a name; else None."""
        if isinstance(node, ast.Name) and node.id not in self.local_names:
            return self.globals.get(node.id, getattr(builtins, node.id, None))
        return None

    def is_static(self, node):
        """A global module or class named directly: its attributes are the front end's names, not values."""
        return isinstance(self.global_value(node), (types.ModuleType, type))

    def once(self, node):
        """(the expression, an expression giving its value again) evaluating ``node`` once."""
        if isinstance(node, (ast.Name, ast.Constant)):
            return node, ast.parse(ast.unparse(node), mode="eval").body
        self.temporaries += 1
        name = f"_nki_value{self.temporaries}"
        return ast.NamedExpr(ast.Name(name, ast.Store()), node), ast.Name(name, ast.Load())

    def key(self, node):
        if isinstance(node, ast.Slice):
            return self.call("_nki_slice", *(self.visit(part) if part else ast.Constant(None)
                                             for part in (node.lower, node.upper, node.step)))
        if isinstance(node, ast.Tuple):
            return ast.Tuple([self.key(element) for element in node.elts], ast.Load())
        return self.visit(node)

    def visit_Attribute(self, node):
        if not isinstance(node.ctx, ast.Load) or self.is_static(node.value):
            return self.generic_visit(node)
        return self.call("_nki_attr", self.visit(node.value), ast.Constant(node.attr))

    def visit_Subscript(self, node):
        if not isinstance(node.ctx, ast.Load):
            return self.generic_visit(node)
        return self.call("_nki_getitem", self.visit(node.value), self.key(node.slice))

    def visit_BinOp(self, node):
        op = _AST_OPERATORS.get(type(node.op))
        if op is None:  # @: refused by the subset check
            return self.generic_visit(node)
        return self.call(f"_nki_{op}", self.visit(node.left), self.visit(node.right))

    def visit_UnaryOp(self, node):
        number = isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)
        if number or not isinstance(node.op, (ast.USub, ast.Invert)):  # -1: a literal
            return self.generic_visit(node)
        return self.call("_nki_negate" if isinstance(node.op, ast.USub) else "_nki_invert", self.visit(node.operand))

    def visit_Compare(self, node):
        left, parts = self.visit(node.left), []
        for position, (op, right) in enumerate(zip(node.ops, node.comparators)):
            right, again = self.once(self.visit(right)) if position < len(node.ops) - 1 else (self.visit(right), None)
            parts.append(self.comparison(op, left, right))
            left = again
        return parts[0] if len(parts) == 1 else ast.BoolOp(ast.And(), parts)

    def comparison(self, op, left, right):
        native = isinstance(op, (ast.Is, ast.IsNot)) or (isinstance(op, (ast.Eq, ast.NotEq)) and (
            isinstance(left, ast.Constant) or isinstance(right, ast.Constant)))
        if native:
            return ast.Compare(left, [op], [right])
        checked = self.call(_AST_COMPARISONS[type(op)], left, right)
        return ast.UnaryOp(ast.Not(), checked) if isinstance(op, (ast.NotEq, ast.NotIn)) else checked

    def visit_For(self, node):
        is_range = isinstance(node.iter, ast.Call) and _last_name(node.iter.func) in _RANGES
        node = self.generic_visit(node)
        if not is_range:
            node.iter = self.call("_nki_iter", node.iter)
        return node

    def visit_Call(self, node):
        function = node.func
        node.args = [self.visit(argument) for argument in node.args]
        node.keywords = [self.visit(keyword) for keyword in node.keywords]
        if isinstance(function, ast.Name) and function.id not in self.local_names \
                and function.id not in self.globals and hasattr(builtins, function.id):
            if function.id in CHECKED_BUILTINS:
                node.func = ast.Name(f"_nki_b_{function.id}", ast.Load())
            return node
        base = self.global_value(function.value) if isinstance(function, ast.Attribute) else None
        if isinstance(base, (types.ModuleType, type)) and not _traceable_module(getattr(base, "__module__", None)
                                                                                   if isinstance(base, type)
                                                                                   else base.__name__):
            return node  # nl.ndarray(...), nisa.activation(...): the front end's builtins
        node.func = self.call("_nki_fn", self.visit(function))
        return node

    def visit_Assign(self, node):
        target = node.targets[0]
        if len(node.targets) == 1 and isinstance(target, ast.Attribute):
            return ast.Expr(self.call("_nki_setattr", self.visit(target.value), ast.Constant(target.attr),
                                      self.visit(node.value), ast.Constant(ast.unparse(target.value))))
        if len(node.targets) == 1 and isinstance(target, ast.Subscript):
            return ast.Expr(self.call("_nki_setitem", self.visit(target.value), self.key(target.slice),
                                      self.visit(node.value)))
        return self.generic_visit(node)

    def visit_AugAssign(self, node):
        op, target = _AST_OPERATORS.get(type(node.op)), node.target
        if op is None:
            return self.generic_visit(node)
        value = self.visit(node.value)
        if isinstance(target, ast.Name):
            return ast.Assign([ast.Name(target.id, ast.Store())],
                              self.call(f"_nki_{op}", ast.Name(target.id, ast.Load()), value))
        if isinstance(target, ast.Attribute):
            owner, again = self.once(self.visit(target.value))
            current = self.call("_nki_attr", again, ast.Constant(target.attr))
            return ast.Expr(self.call("_nki_setattr", owner, ast.Constant(target.attr),
                                      self.call(f"_nki_{op}", current, value), ast.Constant(ast.unparse(target.value))))
        owner, again = self.once(self.visit(target.value))
        key, key_again = self.once(self.key(target.slice))
        current = self.call("_nki_getitem", again, key_again)
        return ast.Expr(self.call("_nki_setitem", owner, key, self.call(f"_nki_{op}", current, value)))


def _last_name(node):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


_CODE = {}  # a function's code object -> the rewritten code object, or None where there is no source to rewrite
_TRACED = {}  # function -> the function to run in its place (itself where it is not rewritten)
_CONSTRUCTORS = {}  # class -> what calling it in a kernel runs


def traced_callable(function):
    """What a call of ``function`` from rewritten code runs: the rewritten function, method or NKIObject
    constructor where there is one, else ``function`` itself."""
    what = type(function)
    if what is types.FunctionType:
        traced = _TRACED.get(function)
        if traced is None:
            traced = _TRACED[function] = _rewritten(function) if _traceable(function) else function
        return traced
    if what is types.MethodType and type(function.__func__) is types.FunctionType:
        traced = traced_callable(function.__func__)
        return function if traced is function.__func__ else types.MethodType(traced, function.__self__)
    if what is type:
        constructor = _CONSTRUCTORS.get(function)
        if constructor is None:
            constructor = _CONSTRUCTORS[function] = _constructor(function)
        return constructor
    return function


_HELPERS["_nki_fn"] = traced_callable
_HELPER_CELLS = {name: types.CellType(helper) for name, helper in _HELPERS.items()}


def _traceable(function):
    return _traceable_module(function.__module__) and function.__name__ != "<lambda>"


def _constructor(cls):
    """``cls(...)`` running a rewritten ``__init__`` where the class has its own with source."""
    init = getattr(cls, "__init__", None)
    traced = traced_callable(init) if type(init) is types.FunctionType else init
    if traced is init:
        return cls

    def construct(*args, **kwargs):
        obj = cls.__new__(cls)
        traced(obj, *args, **kwargs)
        return obj
    return construct


def _rewritten(function):
    """``function`` with its code rewritten (cached per code object), the same globals, defaults and closure."""
    code = function.__code__
    if code not in _CODE:
        _CODE[code] = _rewrite_code(function)
    rewritten = _CODE[code]
    if rewritten is None:
        return function
    cells = dict(zip(code.co_freevars, function.__closure__ or ()))
    closure = tuple(_HELPER_CELLS.get(name) or cells[name] for name in rewritten.co_freevars)
    traced = types.FunctionType(rewritten, function.__globals__, function.__name__, function.__defaults__, closure)
    traced.__kwdefaults__, traced.__qualname__ = function.__kwdefaults__, function.__qualname__
    traced.__module__, traced.__doc__ = function.__module__, function.__doc__
    return traced


def _rewrite_code(function):
    """The rewritten code object of ``function``: its def, rewritten, inside a factory whose parameters are the
    checks and the function's free variables, compiled with the function's file and line numbers."""
    try:
        lines, first_line = inspect.getsourcelines(function.__code__)  # its own code, not a __wrapped__ one
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef) or definition.name != function.__code__.co_name:
        return None  # a function made by exec, or one whose source is not its own def
    ast.increment_lineno(tree, first_line - 1)
    local_names = {node.id for node in ast.walk(definition) if isinstance(node, ast.Name)
                   and not isinstance(node.ctx, ast.Load)}
    local_names |= {argument.arg for argument in ast.walk(definition.args) if isinstance(argument, ast.arg)}
    local_names |= set(function.__code__.co_freevars)
    # renamed inside the factory, so that a recursive call still finds the global, not the factory's local
    definition.decorator_list, definition.name = [], "__nki_rewritten__"
    definition.body = [_Rewrite(function, local_names).visit(statement) for statement in definition.body]
    parameters = [ast.arg(name) for name in (*_HELPERS, *function.__code__.co_freevars)]
    factory = ast.FunctionDef("__nki_factory__", ast.arguments([], parameters, None, [], [], None, []),
                              [definition, ast.Return(ast.Name(definition.name, ast.Load()))], [], None)
    module = ast.fix_missing_locations(ast.Module([factory], []))
    compiled = compile(module, function.__code__.co_filename, "exec")
    factory_code = next(const for const in compiled.co_consts if isinstance(const, types.CodeType))
    rewritten = next(const for const in factory_code.co_consts
                     if isinstance(const, types.CodeType) and const.co_name == "__nki_rewritten__")
    rewritten = rewritten.replace(co_name=function.__code__.co_name, co_qualname=function.__code__.co_qualname)
    _REWRITTEN.add(rewritten)
    return rewritten
