"""NKI 0.4's value model (nki_emulator/_values.py): one pair of kernels per rule, as in test_emulator_rules.py. The
broken kernel steps outside what the front end's values support and is refused with the front end's words and the
source line; its twin differs in that one point and runs, giving the value the front end computes. Rules from
leanprover/KLR KLR/Trace/{Term,Python,NKI}.lean and aws-neuron-sdk 3afa0fdf nki-language-guide.rst."""

import functools
import inspect
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

import nki_emulator
import nki_emulator.isa as nisa
import nki_emulator.language as nl
from nki_emulator import NkiValidationError


@pytest.fixture(autouse=True)
def _nki_0_4():
    version = nki_emulator.set_nki_version("0.4")
    yield
    nki_emulator.set_nki_version(version)


def add_item(mapping):
    """A helper: the rules hold in every function a kernel calls."""
    mapping.update({"b": 2})
    return mapping


def set_item(mapping):
    mapping["b"] = 2
    return mapping


def dict_update(x):
    return len(add_item({"a": 1}))


def dict_item_assignment(x):
    return len(set_item({"a": 1}))


def in_a_dict(x):
    flags = {"causal": True}
    return "causal" in flags


def in_a_dicts_keys(x):
    flags = {"causal": True}
    return "causal" in flags.keys()


def loop_over_a_dict(x):
    sizes, total = {"a": 1, "b": 2}, 0
    for name in sizes:
        total += sizes[name]
    return total


def loop_over_a_dicts_items(x):
    sizes, total = {"a": 1, "b": 2}, 0
    for item in sizes.items():
        total += item[1]
    return total


def string_method(x):
    return "q,k".split(",")


def string_concatenation(x):
    return "q" + "," + "k"


def tuple_method(x):
    return (4, 8, 16).index(8)


def tuple_loop(x):
    found = None
    for position in range(3):
        if (4, 8, 16)[position] == 8:
            found = position
    return found


def list_insert(x):
    values = [2, 3]
    values.insert(0, 1)
    return values


def list_append(x):
    values = [1, 2]
    values.append(3)
    return values


def list_sort(x):
    values = [3, 1]
    values.sort()
    return values


def list_reverse(x):
    values = [3, 1]
    values.reverse()
    return values


def list_pop_first(x):
    values = [1, 2, 3]
    return values.pop(0)


def list_pop(x):
    values = [1, 2, 3]
    return values.pop()


def list_count(x):
    return [1, 2, 2].count(2)


def list_index_absent(x):
    return [1, 2, 2].index(5)  # KLR: None, no ValueError


def float_modulo(x):
    return 7.5 % 2


def integer_modulo(x):
    return 7 % 2


def string_repetition(x):
    return "ab" * 2


def tuple_repetition(x):
    return (1, 2) * 2


def bool_plus_float(x):
    return True + 0.5


def bool_times_int(x):
    return True * 3 + 0.5


def tensor_plus_one(x):
    return x + 1


def tensor_shape_plus_one(x):
    return x.shape[0] + 1


def negative_bool(x):
    return -True


def negative_int(x):
    return -x.shape[1]


def overflowing_int(x):
    return x.shape[0] * 65536 * 65536


def int32_int(x):
    return (x.shape[0] * 65536 - 1) * 4096 + 4095


def integer_division_by_a_negative(x):
    """Lean's Int division: 7 // -2 is -3 and 7 % -2 is 1 (Python: -4 and -1)."""
    return 7 // -(x.shape[0] // 4), 7 % -(x.shape[0] // 4)


def len_of_a_string(x):
    return len("rows")


def len_of_a_tuple(x):
    return len(("r", "o", "w", "s"))


def min_of_bools(x):
    return min(True, 2)


def min_of_int_and_float(x):
    return min(1, 2.5)  # KLR: 1.0, a float


def dict_with_keywords(x):
    return dict(a=1)


def dict_from_pairs(x):
    return dict([("a", 1)])


def int_key(x):
    table = {}
    table[1] = 2
    return table


def string_key(x):
    table = {}
    table["1"] = 2
    return table


def tuple_slice_past_the_end(x):
    return (1, 2, 3)[0:5]


def tuple_slice(x):
    return (1, 2, 3)[0:3]


def string_subscript(x):
    return "rows"[0]


def none_less_than_one(x):
    return None < 1


def none_equals_one(x):
    return None == 1


def tensor_attribute_set(x):
    x.label = "input"
    return x.shape


class Tiles(nl.NKIObject):
    """An NKIObject whose fields a kernel reads and sets, and whose method it calls (the guide l. 472-530)."""

    count = 0
    label = None

    def bump(self, by):
        self.count += by
        return self.count


def object_unknown_attribute(x):
    tiles = Tiles(0, "q")
    return tiles.size


def object_fields_and_methods(x):
    tiles = Tiles(1, "q")
    tiles.label = tiles.label + "k"
    tiles.bump(x.shape[0])
    return tiles.count, tiles.label, tiles == Tiles(tiles.count, "qk")


def tensor_strides(x):
    return x.strides


def tensor_shape_and_pattern(x):
    return x.shape, x.ndim, x.get_pattern()


class Rule(NamedTuple):
    broken: object
    twin: object
    match: tuple  # fragments of the refusal: the front end's words and the source
    twin_result: object  # what the twin gives, as the front end computes it


RULES = {
    "dict has no update": Rule(dict_update, dict_item_assignment,
                               ("update is not an attribute of dict", "Term.lean l. 488-498"), 2),
    "in on a dict": Rule(in_a_dict, in_a_dicts_keys,
                         ("in operator not support on types string and dict", "Python.lean l. 58-66"), True),
    "a dict does not iterate": Rule(loop_over_a_dict, loop_over_a_dicts_items,
                                    ("not an iterable object", "Python.lean l. 246-254"), 3),
    "strings have no methods": Rule(string_method, string_concatenation,
                                    ("unsupported attribute split", "Term.lean l. 552"), "q,k"),
    "tuples have no methods": Rule(tuple_method, tuple_loop, ("unsupported attribute index", "Term.lean l. 552"), 1),
    "list methods are ten": Rule(list_insert, list_append,
                                 ("insert is not an attribute of list", "Term.lean l. 475-487"), (1, 2, 3)),
    "list.sort has no builtin": Rule(list_sort, list_reverse, ("unimplemented API builtin.list.sort",), (1, 3)),
    "list.pop takes no index": Rule(list_pop_first, list_pop, ("list.pop takes no index", "Python.lean l. 309-312"), 3),
    "list.count takes no argument": Rule(list_count, list_index_absent,
                                         ("list.count takes no argument", "Python.lean l. 293-295"), None),
    "floats have no %": Rule(float_modulo, integer_modulo,
                             ("floating point numbers do not support operator 'mod'", "Term.lean l. 76-85"), 1),
    "strings do not repeat": Rule(string_repetition, tuple_repetition,
                                  ("unimplemented operator 'mul'", "Term.lean l. 97-128"), (1, 2, 1, 2)),
    "a bool does not add to a float": Rule(bool_plus_float, bool_times_int,
                                           ("unimplemented operator 'add'", "Term.lean l. 97-128"), 3.5),
    "tensors take no operators": Rule(tensor_plus_one, tensor_shape_plus_one,
                                      ("binary operators on tensors not supported", "Term.lean l. 99-101"), 9),
    "a bool has no negative": Rule(negative_bool, negative_int,
                                   ("cannot negate values of this type", "Python.lean l. 45-49"), -16),
    "integers are 32-bit": Rule(overflowing_int, int32_int,
                                ("integer value (34359738368) is too large", "nki-language-guide.rst l. 145"),
                                2 ** 31 - 1),
    "Lean's integer division": Rule(overflowing_int, integer_division_by_a_negative, ("too large",), (-3, 1)),
    "len takes no string": Rule(len_of_a_string, len_of_a_tuple,
                                ("expected a list of a dictionary; found string", "Python.lean l. 388-398"), 4),
    "min takes numbers, not bools": Rule(min_of_bools, min_of_int_and_float,
                                         ("invalid arguments", "Python.lean l. 142-191"), 1.0),
    "dict() takes no keywords": Rule(dict_with_keywords, dict_from_pairs,
                                     ("unexpected keyword argument 'a'", "Python.lean l. 340-343"), {"a": 1}),
    "dict keys are strings": Rule(int_key, string_key, ("expecting 'string', got 'int'", "NKI.lean l. 355"),
                                  {"1": 2}),
    "slices do not clamp": Rule(tuple_slice_past_the_end, tuple_slice,
                                ("slice index out of bounds", "Term.lean l. 299-326"), (1, 2, 3)),
    "strings take no subscript": Rule(string_subscript, len_of_a_tuple,
                                      ("string subscript not implemented", "Term.lean l. 426"), 4),
    "None has no order": Rule(none_less_than_one, none_equals_one,
                              ("unsupported comparison between 'none' and 'int'", "Term.lean l. 147-182"), False),
    "only objects take attribute assignment": Rule(tensor_attribute_set, object_fields_and_methods,
                                                   ("x.label is immutable", "NKI.lean l. 371-381"), (9, "qk", True)),
    "an object has its fields and methods": Rule(object_unknown_attribute, object_fields_and_methods,
                                                 ("size is not an attribute of Tiles", "Term.lean l. 499-510"),
                                                 (9, "qk", True)),
    "a tensor's attributes": Rule(tensor_strides, tensor_shape_and_pattern,
                                  ("unsupported attribute strides (type is tensor access)", "Term.lean l. 519-542"),
                                  ((8, 16), 2, ((16, 8), (1, 16)))),
}


@pytest.mark.parametrize("name", list(RULES))
def test_value_rule_refuses_the_breaking_kernel_and_runs_its_twin(name):
    rule, x = RULES[name], np.zeros((8, 16), np.float32)
    with pytest.raises(NkiValidationError) as refusal:
        nki_emulator.jit(rule.broken)(x)
    for fragment in rule.match:
        assert fragment in str(refusal.value), str(refusal.value)
    assert nki_emulator.jit(rule.twin)(x) == rule.twin_result


def test_a_refusal_names_the_line_of_the_helper_that_breaks_the_rule():
    with pytest.raises(NkiValidationError) as refusal:
        nki_emulator.jit(dict_update)(np.zeros((8, 16), np.float32))
    line = inspect.getsourcelines(add_item)[1] + 2
    assert f"{__file__}:{line} in add_item: update is not an attribute of dict" in str(refusal.value)


def apply(function, x):
    return function(x)


def kernel_passing_a_helper(x):
    """A helper passed as a value is traced too (the guide l. 566-600)."""
    return apply(dict_update, x)


def copy_rows(x):
    """A tile kernel whose Python around the instructions is all NKI 0.4 values."""
    sizes = {"rows": x.shape[0], "cols": x.shape[1]}
    t = nl.ndarray((sizes["rows"], sizes["cols"]), x.dtype, buffer=nl.sbuf)
    for half in (0, 1):
        rows = slice(half * sizes["rows"] // 2, (half + 1) * sizes["rows"] // 2)
        nisa.dma_copy(dst=t[rows, :], src=x[rows, :])
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_helpers_passed_as_values_are_traced_and_tile_kernels_run():
    x = np.arange(128, dtype=np.float32).reshape(8, 16)
    with pytest.raises(NkiValidationError, match="update is not an attribute of dict"):
        nki_emulator.jit(kernel_passing_a_helper)(x)
    np.testing.assert_array_equal(nki_emulator.jit(copy_rows)(x), x)


def expand_a_dim(x):
    return x.expand_dim(1).shape


def test_nki_0_7_runs_kernels_as_python_and_0_5_tensors_have_view_methods():
    """NKI 0.7 (Neuron 2.33) specialises by running Python: a dict's update and `in` on a dict run there, and
    integers divide as Python's. NKI 0.5's tensors gain view methods (API stub ee7d6e00), which 0.4's lack."""
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(NkiValidationError, match="unsupported attribute expand_dim"):
        nki_emulator.jit(expand_a_dim)(x)
    nki_emulator.set_nki_version("0.6")
    assert nki_emulator.jit(expand_a_dim)(x) == (8, 1, 16)
    with pytest.raises(NkiValidationError, match="update is not an attribute of dict"):
        nki_emulator.jit(dict_update)(x)
    nki_emulator.set_nki_version("0.7")
    assert nki_emulator.jit(dict_update)(x) == 2 and nki_emulator.jit(in_a_dict)(x) is True
    assert nki_emulator.jit(integer_division_by_a_negative)(x) == (-4, -1)


def test_docs_carry_the_value_table():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    for kind, supports, source in nki_emulator.VALUE_KINDS:
        assert f"| {kind} | {supports.replace('|', '/')} | {source} |" in docs, kind


def isinstance_of_a_tuple(x):
    return isinstance(1, (int, float))


def isinstance_of_a_class(x):
    return isinstance(1, int) or isinstance(1, float)


def divmod_by_zero(x):
    """Lean's Int: x / 0 is 0 and x % 0 is x, and divmod does not check (Python.lean l. 239-240)."""
    return divmod(7, x.shape[0] - 8), divmod(-7, 2)


def test_isinstance_takes_one_class_and_divmod_divides_as_lean():
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(NkiValidationError, match="isinstance takes one class.*Python.lean l. 79-100"):
        nki_emulator.jit(isinstance_of_a_tuple)(x)
    assert nki_emulator.jit(isinstance_of_a_class)(x) is True
    assert nki_emulator.jit(divmod_by_zero)(x) == ((0, 7), (-4, 1))


def wrapped_target(x):
    return "the wrapped function"


def test_a_kernel_wrapped_with_functools_wraps_runs_its_own_code():
    """The rewrite reads the source of the function's own code, not of its __wrapped__ (kernels' tests wrap
    kernels with functools.wraps to inject faults)."""
    def wrapper(x):
        return "the wrapper"

    kernel = functools.wraps(wrapped_target)(wrapper)
    assert nki_emulator.jit(kernel)(np.zeros((8, 16), np.float32)) == "the wrapper"


def loop_appending_to_its_list(x):
    values = [1, 2]
    for value in values:
        if len(values) < 8:
            values.append(value + 2)
    return values


def test_a_loop_runs_over_the_items_its_list_held_when_it_started():
    """KLR fetches a loop's items once (NKI.lean l. 487-498); Python would run until the list had 8 items."""
    assert nki_emulator.jit(loop_appending_to_its_list)(np.zeros((8, 16), np.float32)) == (1, 2, 3, 4)


def kernel_of_a_count(x, count):
    return count


def test_a_kernel_argument_is_a_32_bit_integer():
    """gather.c converts a kernel's arguments as constants (l. 1723, ``value`` l. 816-819)."""
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(NkiValidationError, match=r"argument 'count': integer value \(2147483648\) is too large"):
        nki_emulator.jit(kernel_of_a_count)(x, count=2 ** 31)
    with pytest.raises(NkiValidationError, match=r"argument 1: integer value \(-2147483649\) is too small"):
        nki_emulator.jit(kernel_of_a_count)(x, (1, -2 ** 31 - 1))
    assert nki_emulator.jit(kernel_of_a_count)(x, count=2 ** 31 - 1) == 2 ** 31 - 1


def comprehension(x):
    return sum([size * 2 for size in x.shape])


def test_nki_0_7_takes_the_whole_language():
    """Syntax too: 0.4's front end refuses a comprehension and sum (_subset.py); 0.7 runs them as Python."""
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(NkiValidationError, match="list comprehension"):
        nki_emulator.jit(comprehension)
    nki_emulator.set_nki_version("0.7")
    assert nki_emulator.jit(comprehension)(x) == 48


_LARGEST = {nl.float32: 3.4e38, nl.bfloat16: 3.39e38}


def largest_of_dtype(x):
    """A dtype is a string to KLR (Term.lean l. 521-527): nki-library's kernel_helpers.py l. 394 keys a dict by it."""
    return _LARGEST.get(x.dtype, None)


def test_a_dtype_keys_a_dict():
    assert nki_emulator.jit(largest_of_dtype)(np.zeros((8, 16), np.float32)) == 3.4e38
