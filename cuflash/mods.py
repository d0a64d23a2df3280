"""Score and mask modifiers: a small expression language, FlexAttention's idea without torch.

A modifier is one expression in Python syntax, parsed with :mod:`ast` against a whitelisted grammar
(never ``eval``), then

- evaluated vectorized by the NumPy backend and the float64 reference (:meth:`Expr.evaluate`),
- emitted as C++ for the kernel specialization (:meth:`Expr.cpp`),
- differentiated symbolically for the backward (:meth:`Expr.derivative`).

Variables: ``score`` (the scaled score, ``scale * q·k``; score modifiers only), ``b`` (the flattened
batch index), ``h`` (the query head), ``q_idx``, ``kv_idx`` (the query row and key column), ``q_len``,
``kv_len`` (the sequence's own lengths: ``seqlens_q/k`` where given, else the array lengths). Named
arrays (``mod_arrays``) are read as ``name[v1, v2, ...]`` where each index is one of the variables
``b, h, q_idx, kv_idx`` (so an index can never leave the array: its extents are checked against the
problem once, before anything runs), and named scalars (Python numbers or 0-d arrays) as ``name``.

Grammar: numbers, ``True``/``False``, ``+ - * /`` (``/`` is float division), ``// %`` (integers),
unary ``-``, comparisons (chained too), ``and``/``or``/``not``, ``a if c else b``, and the functions
``abs, min, max, exp, log, tanh, sqrt, where(c, a, b)``. A score modifier evaluates to a number, a
mask modifier to a bool. Integers are the kernels' int32: every integer an expression computes, and every integer
array's values, must stay in int32 at every index of the problem (bounds carried through the tree from the
operands' values and the extents, checked before anything runs; NumPy computes in 64 bits and so agrees). Floats
are the working precision (float32, float64 for float64 inputs). ``x // 0`` and ``x % 0`` are 0 (NumPy's),
``min``/``max`` propagate a NaN (``numpy.minimum``/``maximum``). An expression is at most :data:`MAX_TEXT`
characters and :data:`MAX_DEPTH` levels deep, and a score modifier's derivative at most :data:`MAX_DERIVATIVE`
operations.
"""
from __future__ import annotations

import ast
import math
import numbers
import unicodedata
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._lazy import lazy_property

INDEX_VARS = ("b", "h", "q_idx", "kv_idx")
#: the longest modifier text and the deepest expression tree taken (the parser and evaluators recurse over it)
MAX_TEXT, MAX_DEPTH = 20000, 200
#: the most operations a score modifier's derivative may take, written out as the kernels' C++ and NumPy's passes
#: compute it (no common subexpressions: d tanh(u) = (1 - tanh(u)^2) du repeats u, so nested functions grow it
#: quadratically; 150 tanh around a 600-term sum, 6.9 kB of text, gave 383k operations and 2 MB of C++)
MAX_DERIVATIVE = 50000
LENGTH_VARS = ("q_len", "kv_len")
#: names cuflash gives its own operands (bias, ALiBi slopes, softcap): user mod_arrays may not start with it
RESERVED_PREFIX = "cuflash_"
FUNCTIONS = {"abs": 1, "min": 2, "max": 2, "exp": 1, "log": 1, "tanh": 1, "sqrt": 1, "where": 3}
_FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sqrt")
_BIN = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%"}
_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
KINDS = ("score", "mask")


@dataclass(frozen=True)
class Node:
    """One node of the expression tree. ``op``: "const", "var", "array", "scalar", "call", a binary or
    comparison operator, "and", "or", "not", "neg", "if". ``type``: "int", "float" or "bool"."""

    op: str
    type: str
    args: tuple = ()
    value: Any = None  # constant value, variable/array/scalar/function name


@dataclass(frozen=True)
class Operand:
    """A named operand as the language sees it: its type and, for an array, every tuple of indices it is read
    with, one per dimension (e.g. ``(("q_idx",), ("kv_idx",))`` for ``doc[q_idx] == doc[kv_idx]``).

    An index is a variable name. cuflash's own operands (BlockMask grids) may also use ``(variable, d)``, the
    variable divided by ``d`` (a block index), and None, index 0 of a dimension of size 1; and ``table``
    operands (the packed bits of ``BlockMask.from_dense``) are read only by the ``bits`` node."""

    name: str
    type: str
    indexings: tuple = ()  # empty: a scalar
    table: bool = False

    @property
    def is_array(self) -> bool:
        return bool(self.indexings) or self.table


def index_extent(index, extents: dict) -> int:
    """The extent an array dimension read at ``index`` must have (see :class:`Operand`)."""
    if index is None:
        return 1
    if isinstance(index, tuple):
        return -(-extents[index[0]] // index[1])
    return extents[index]


def index_value(index, env: dict):
    """The NumPy index array of one dimension read at ``index``."""
    if index is None:
        return 0
    if isinstance(index, tuple):
        return env[index[0]] // index[1]
    return env[index]


def _float(n: Node) -> Node:
    """``n`` in a float context: integers are converted explicitly (C++ and NumPy then agree on every op)."""
    return n if n.type == "float" else Node("float", "float", (n,))


def _type_of_dtype(dtype) -> str:
    if np.dtype(dtype).name == "bfloat16":  # ml_dtypes' bfloat16 has kind "V"
        return "float"
    kind = np.dtype(dtype).kind
    if kind == "b":
        return "bool"
    if kind in "iu":
        return "int"
    if kind == "f":
        return "float"
    raise TypeError(f"mod_arrays entries must be bool, integer or floating point, got dtype {dtype}")


class _Parser:
    def __init__(self, text: str, kind: str, arrays: dict, what: str):
        self.text, self.kind, self.arrays, self.what = text, kind, arrays, what
        self.operands: dict[str, Operand] = {}

    def fail(self, node, message):
        col = getattr(node, "col_offset", None)
        where = f" at column {col + 1}" if col is not None else ""
        token = ast.get_source_segment(self.text, node) if hasattr(node, "lineno") else None
        raise ValueError(f"{self.what}: {message}{where}" + (f" ({token!r})" if token else "") +
                         f" in {self.text!r}")

    # ------------------------------------------------------------------ nodes
    def visit(self, node) -> Node:
        method = getattr(self, "visit_" + type(node).__name__, None)
        if method is None:
            self.fail(node, f"{type(node).__name__} is not part of the modifier grammar (numbers, variables, "
                            f"arrays indexed by b/h/q_idx/kv_idx, arithmetic, comparisons, and/or/not, "
                            f"if-else, {', '.join(FUNCTIONS)})")
        return method(node)

    def visit_Expression(self, node):
        return self.visit(node.body)

    def visit_Constant(self, node):
        v = node.value
        if isinstance(v, bool):
            return Node("const", "bool", value=v)
        if isinstance(v, int):
            if abs(v) >= 2**31:
                self.fail(node, "integer constants must fit in 32 bits (the kernels' index arithmetic)")
            return Node("const", "int", value=v)
        if isinstance(v, float):
            return Node("const", "float", value=v)
        self.fail(node, f"constant of type {type(v).__name__} is not allowed")

    def visit_Name(self, node):
        name = node.id
        if name == "score":
            if self.kind != "score":
                self.fail(node, "'score' is only available to a score modifier")
            return Node("var", "float", value=name)
        if name in INDEX_VARS + LENGTH_VARS:
            return Node("var", "int", value=name)
        if name in ("inf", "nan"):
            return Node("const", "float", value=float(name))
        if name in self.arrays:
            value = self.arrays[name]
            if _is_scalar(value):
                t = "float" if isinstance(value, float) else _scalar_type(value)
                self.operands[name] = Operand(name, t)
                return Node("scalar", t, value=name)
            self.fail(node, f"array {name!r} must be indexed by {', '.join(INDEX_VARS)} (e.g. {name}[h])")
        self.fail(node, f"unknown name {name!r}: the variables are score, {', '.join(INDEX_VARS + LENGTH_VARS)}, "
                        f"and the names of mod_arrays ({', '.join(sorted(self.arrays)) or 'none given'})")

    def visit_Subscript(self, node):
        if not isinstance(node.value, ast.Name) or node.value.id not in self.arrays or \
                _is_scalar(self.arrays[node.value.id]):
            self.fail(node, "only arrays of mod_arrays can be indexed")
        name = node.value.id
        array = self.arrays[name]
        index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        names = []
        for i in index:
            if not (isinstance(i, ast.Name) and i.id in INDEX_VARS):
                self.fail(i, f"array indices must be the variables {', '.join(INDEX_VARS)} (so no index can "
                             f"leave the array)")
            names.append(i.id)
        if len(set(names)) != len(names):
            self.fail(node, f"array {name!r} indexed twice by the same variable")
        if len(names) != array.ndim:
            self.fail(node, f"array {name!r} has {array.ndim} dimensions but is indexed by {len(names)}")
        t = _type_of_dtype(array.dtype)
        seen = self.operands.get(name, Operand(name, t)).indexings
        self.operands[name] = Operand(name, t, seen + (tuple(names),) if tuple(names) not in seen else seen)
        return Node("array", t, value=(name, tuple(names)))

    def visit_UnaryOp(self, node):
        a = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return Node("not", "bool", (self.need(node, a, "bool"),))
        if isinstance(node.op, (ast.USub, ast.UAdd)):
            self.need(node, a, "number")
            return a if isinstance(node.op, ast.UAdd) else Node("neg", a.type, (a,))
        self.fail(node, "unary operator not allowed")

    def visit_BinOp(self, node):
        op = _BIN.get(type(node.op))
        if op is None:
            self.fail(node, f"operator {type(node.op).__name__} is not allowed (+ - * / // % only)")
        a, b = self.need(node, self.visit(node.left), "number"), self.need(node, self.visit(node.right), "number")
        if op in ("//", "%"):
            if a.type != "int" or b.type != "int":
                self.fail(node, f"'{op}' takes integers")
            return Node(op, "int", (a, b))
        if op == "/" or "float" in (a.type, b.type):
            return Node(op, "float", (_float(a), _float(b)))
        return Node(op, "int", (a, b))

    def visit_BoolOp(self, node):
        op = "and" if isinstance(node.op, ast.And) else "or"
        values = [self.need(node, self.visit(v), "bool") for v in node.values]
        out = values[0]
        for v in values[1:]:
            out = Node(op, "bool", (out, v))
        return out

    def visit_Compare(self, node):
        left = self.visit(node.left)
        out = None
        for op, right_node in zip(node.ops, node.comparators):
            right = self.visit(right_node)
            sym = _CMP.get(type(op))
            if sym is None:
                self.fail(node, f"comparison {type(op).__name__} is not allowed")
            if sym in ("==", "!=") and (left.type == "bool") != (right.type == "bool"):
                self.fail(node, "== and != compare two numbers or two bools")
            if sym not in ("==", "!="):
                self.need(node, left, "number"), self.need(node, right, "number")
            if _inexact(left) or _inexact(right):
                self.fail(node, f"a comparison of what {'/'.join(_INEXACT)} give decides elements differently on "
                                f"different backends (NumPy, the C library and CUDA round these functions each their "
                                f"own way): compare their arguments instead (exp(a) >= exp(b) is a >= b), or use them "
                                f"in a score's value only")
            if "float" in (left.type, right.type):
                cmp = Node(sym, "bool", (_float(left), _float(right)))
            else:
                cmp = Node(sym, "bool", (left, right))
            out = cmp if out is None else Node("and", "bool", (out, cmp))
            left = right
        return out

    def visit_IfExp(self, node):
        return self._where(node, self.visit(node.test), self.visit(node.body), self.visit(node.orelse))

    def visit_Call(self, node):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
            self.fail(node, f"only the functions {', '.join(FUNCTIONS)} can be called (positional arguments)")
        name = node.func.id
        if len(node.args) != FUNCTIONS[name]:
            self.fail(node, f"{name} takes {FUNCTIONS[name]} argument(s), got {len(node.args)}")
        args = [self.visit(a) for a in node.args]
        if name == "where":
            return self._where(node, *args)
        for a in args:
            self.need(node, a, "number")
        if name in _FLOAT_FUNCTIONS or "float" in (a.type for a in args):
            return Node("call", "float", tuple(_float(a) for a in args), name)
        return Node("call", "int", tuple(args), name)

    # ------------------------------------------------------------------ helpers
    def _where(self, node, c, a, b):
        self.need(node, c, "bool")
        if (a.type == "bool") != (b.type == "bool"):
            self.fail(node, "both branches must be numbers or both bools")
        if a.type != "bool" and "float" in (a.type, b.type):
            return Node("if", "float", (c, _float(a), _float(b)))
        return Node("if", a.type, (c, a, b))

    def need(self, node, n: Node, what: str) -> Node:
        ok = n.type == "bool" if what == "bool" else n.type in ("int", "float")
        if not ok:
            self.fail(node, f"expected {'a bool' if what == 'bool' else 'a number'} here, got {n.type}")
        return n


def _is_scalar(value) -> bool:
    return isinstance(value, numbers.Number) or (hasattr(value, "ndim") and value.ndim == 0)


def scalar_value(value):
    """The Python number a scalar operand holds: a number, or a 0-d NumPy or CuPy array (CuPy's converts only
    through ``.item()``)."""
    return value.item() if hasattr(value, "item") else value


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, numbers.Integral):
        return "int"
    if isinstance(value, numbers.Real):
        return "float"
    if not hasattr(value, "dtype"):  # a complex number, a string, ...
        raise TypeError(f"mod_arrays entries must be arrays or real scalars (bool, int, float), got "
                        f"{type(value).__name__}")
    return _type_of_dtype(value.dtype)


# ------------------------------------------------------------------------------------------------ Expr
@dataclass(frozen=True)
class Expr:
    """A parsed, type-checked modifier. ``root`` is the tree, ``operands`` the arrays and scalars it reads."""

    text: str
    kind: str
    root: Node
    operands: tuple  # Operand, sorted by name

    def evaluate(self, env: dict, values: dict, dtype=np.float64):
        """Vectorized value: ``env`` maps ``score``/``b``/``h``/``q_idx``/``kv_idx`` to broadcastable arrays,
        ``values`` the operand names to host arrays/numbers; floats computed in ``dtype``."""
        return _evaluate(self.root, env, values, np.dtype(dtype))

    def cpp(self, read, real: str = "float") -> str:
        """C++ text of the expression. ``read(name, index)`` gives the C++ expression of array ``name``'s element
        at the index variables ``index`` (a tuple), or of scalar ``name`` (``index`` None). ``real``: the type of
        float operations, "float" (the 16-bit and float32 kernels) or "double" (the float64 kernels)."""
        return _cpp(self.root, read, real)

    def derivative(self, wrt: str = "score") -> "Expr":
        """d(expression)/d(wrt), simplified, where ``wrt`` is ``"score"`` or an array operand read at the
        problem's own index (``bias[b, h, q_idx, kv_idx]``): the factor the backward multiplies dS by."""
        if self.kind != "score":
            raise ValueError("only a score modifier has a derivative")
        root = _simplify(_d(self.root, wrt))
        size = _size(root, {})
        if size > MAX_DERIVATIVE:
            raise ValueError(f"score_mod: its derivative would take {size} operations, at most {MAX_DERIVATIVE} (each "
                             f"function nested around a long expression repeats it there); nest fewer levels")
        return Expr(f"d/d{wrt}({self.text})", "score", root, self.operands)

    def compose(self, inner: "Expr") -> "Expr":
        """This score modifier applied to the result of ``inner`` (``score`` replaced by ``inner``'s tree)."""
        if self.kind != "score" or inner.kind != "score":
            raise ValueError("only score modifiers compose")
        return Expr(f"{self.text} ∘ {inner.text}", "score", _substitute(self.root, inner.root),
                    _merge_operands(inner, self))

    def renamed(self, mapping: dict) -> "Expr":
        """The same expression with operands renamed (BlockMask's ``&``/``|`` keep two masks' operands apart)."""
        def ren(n: Node) -> Node:
            value = n.value
            if n.op == "array":
                value = (mapping.get(value[0], value[0]), value[1])
            elif n.op == "scalar":
                value = mapping.get(value, value)
            elif n.op == "bits":
                value = (ren(value[0]), mapping.get(value[1], value[1])) + value[2:]
            return Node(n.op, n.type, tuple(ren(a) for a in n.args), value)

        ops = tuple(sorted((Operand(mapping.get(o.name, o.name), o.type, o.indexings, o.table) for o in self.operands),
                           key=lambda o: o.name))
        return Expr(self.text, self.kind, ren(self.root), ops)

    def bound(self, names: dict) -> "Expr":
        """The same expression with the variables of ``names`` (``q_len``/``kv_len``) read as the int scalar operands
        ``names[var]`` instead (``BlockMask.from_mask_mod`` fixes the lengths its rule reads to the mask's own)."""
        def bind(n: Node) -> Node:
            if n.op == "var" and n.value in names:
                return Node("scalar", "int", value=names[n.value])
            value = (bind(n.value[0]),) + n.value[1:] if n.op == "bits" else n.value
            return Node(n.op, n.type, tuple(bind(a) for a in n.args), value)

        read = [v for v in names if _uses(self.root, v)]
        ops = {o.name: o for o in self.operands}
        ops.update({names[v]: Operand(names[v], "int") for v in read})
        return Expr(self.text, self.kind, bind(self.root), tuple(sorted(ops.values(), key=lambda o: o.name)))

    def reads(self, var: str) -> bool:
        """Whether the expression depends on the index variable ``var`` (``b``, ``h``, ...): read as a variable, or
        as an index of an array operand."""
        return _reads_var(self.root, var)

    @property
    def uses_float(self) -> bool:
        """Whether the expression computes in floats (its value may then depend on the working precision)."""
        return _any_float(self.root)

    def check_against(self, values: dict, extents: dict, what: str):
        """The expression against a problem of ``extents`` (``b``, ``h``, ``q_idx``, ``kv_idx``): every array
        operand is read at the problem's own indices, so its shape must be their extents exactly, and every
        integer it computes must stay in int32 (:meth:`check_int_range`)."""
        for op in self.operands:
            if op.table:
                continue
            for index in op.indexings:
                want = tuple(index_extent(v, extents) for v in index)
                got = tuple(np.shape(values[op.name]))
                if got != want:
                    shown = ", ".join(f"{v}: {extents[v]}" for v in index if isinstance(v, str))
                    raise ValueError(f"{what}: {op.name}[{', '.join(map(str, index))}] needs shape {want} ({shown}), "
                                     f"got {got}")
        self.check_int_range(values, extents, what)

    def check_int_range(self, values: dict, extents: dict, what: str):
        """Every integer the expression computes stays in int32, the kernels' integers, for every index inside
        the problem (NumPy computes in 64 bits: only so do the backends agree): bounds carried through the tree
        from the operands' values and the indices' extents. Raises a ValueError naming the first that may not."""
        if all(n > 0 for n in extents.values()):  # an empty problem evaluates nothing
            _int_range(self.root, values, extents, what, self.text)

    @property
    def uses_score(self) -> bool:
        return _uses(self.root, "score")

    @property
    def float_constants(self) -> tuple:
        """The float literals of the expression (a problem refuses one beyond its working precision, as it refuses
        such a number in ``mod_arrays``)."""
        return tuple(_float_constants(self.root))


def _size(n: Node, memo: dict) -> int:
    """The operations of the tree written out (a subtree counted wherever it appears), in time linear in its
    distinct nodes."""
    key = id(n)
    if key not in memo:
        memo[key] = 1 + sum(_size(a, memo) for a in n.args) + (_size(n.value[0], memo) if n.op == "bits" else 0)
    return memo[key]


def _float_constants(n: Node):
    if n.op == "const" and n.type == "float":
        yield n.value
    if n.op == "bits":
        yield from _float_constants(n.value[0])
    for a in n.args:
        yield from _float_constants(a)


#: the functions no two backends round alike (sqrt, abs, min and max are exact or correctly rounded everywhere)
_INEXACT = ("exp", "log", "tanh")


def _inexact(n: Node) -> bool:
    """Whether ``n`` reads the result of an :data:`_INEXACT` function (its depth is bounded by :data:`MAX_DEPTH`)."""
    return (n.op == "call" and n.value in _INEXACT) or any(_inexact(a) for a in n.args)


def _depth(tree) -> int:
    """The depth of an :mod:`ast` tree once parsed into :class:`Node` s, without recursion (a deep tree is what is
    being checked): a ``BoolOp`` of n values or a ``Compare`` of n comparisons is one node in :mod:`ast` but a chain
    n - 1 (n) deep once folded into binary nodes (``q_idx >= kv_idx and True and ...`` of 500 values, 4.5 kB, was a
    RecursionError in the evaluators)."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        step = len(node.values) - 1 if isinstance(node, ast.BoolOp) else \
            len(node.comparators) if isinstance(node, ast.Compare) else 1
        todo.extend((child, d + max(step, 1)) for child in ast.iter_child_nodes(node))
    return deepest


def parse(text: str, *, kind: str, arrays: Optional[dict] = None, what: Optional[str] = None,
          internal: bool = False) -> Expr:
    """Parse and type-check a modifier. ``kind``: "score" (a number) or "mask" (a bool); ``arrays``: the
    ``mod_arrays`` (arrays and scalars) it may read; ``what`` names it in errors (default ``score_mod``/
    ``mask_mod``). Raises ``TypeError``/``ValueError`` naming the offending token."""
    what = what or f"{kind}_mod"
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string holding one expression, got {type(text).__name__}")
    arrays = dict(arrays or {})
    for name in arrays:
        if not isinstance(name, str) or not name.isidentifier() or name in INDEX_VARS + LENGTH_VARS + (
                "score", "inf", "nan") or name in FUNCTIONS or (name.startswith(RESERVED_PREFIX) and not internal):
            raise ValueError(f"mod_arrays key {name!r} must be an identifier other than the variables, the functions "
                             f"and names starting with {RESERVED_PREFIX!r}")
        if unicodedata.normalize("NFKC", name) != name:  # the expression's names are read in NFKC form
            raise ValueError(f"mod_arrays key {name!r} must be written as Python reads it in an expression, "
                             f"{unicodedata.normalize('NFKC', name)!r} (NFKC): the text's {name!r} names that")
    if len(text) > MAX_TEXT:
        raise ValueError(f"{what} must be at most {MAX_TEXT} characters, got {len(text)}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"{what}: not one Python expression ({exc.msg} at column {exc.offset}) in {text!r}") \
            from None
    except (RecursionError, MemoryError):
        raise ValueError(f"{what} is nested too deeply for the parser ({len(text)} characters)") from None
    if _depth(tree) > MAX_DEPTH:  # the parser, the evaluators and the derivative recurse over the tree
        raise ValueError(f"{what} is nested {_depth(tree)} levels deep; at most {MAX_DEPTH} (split a long sum into "
                         f"mod_arrays, or nest it less)")
    parser = _Parser(text.strip(), kind, arrays, what)
    root = parser.visit(tree)
    if kind == "mask" and root.type != "bool":
        raise ValueError(f"{what} must evaluate to a bool (True keeps the score), got {root.type} in {text!r}")
    if kind == "score" and root.type == "bool":
        raise ValueError(f"{what} must evaluate to a number, got bool in {text!r}")
    if kind == "score":
        root = _float(root)
    return Expr(text.strip(), kind, root, tuple(sorted(parser.operands.values(), key=lambda o: o.name)))


def _uses(n: Node, name: str) -> bool:
    """Whether ``n`` reads the variable ``name`` (or the array operand ``name``)."""
    return (n.op == "var" and n.value == name) or (n.op == "array" and n.value[0] == name) or \
        (n.op == "bits" and _uses(n.value[0], name)) or any(_uses(a, name) for a in n.args)


def _reads_var(n: Node, var: str) -> bool:
    if n.op == "var" and n.value == var:
        return True
    if n.op == "array" and any(i == var or (isinstance(i, tuple) and i[0] == var) for i in n.value[1]):
        return True
    if n.op == "bits" and _reads_var(n.value[0], var):
        return True
    return any(_reads_var(a, var) for a in n.args)


def _any_float(n: Node) -> bool:
    return n.type == "float" or (n.op == "bits" and _any_float(n.value[0])) or any(_any_float(a) for a in n.args)


def _substitute(n: Node, inner: Node) -> Node:
    if n.op == "var" and n.value == "score":
        return inner
    return Node(n.op, n.type, tuple(_substitute(a, inner) for a in n.args), n.value)


def _merge_operands(*exprs) -> tuple:
    """The union of the operands of ``exprs``, an array's indexings merged."""
    ops: dict[str, Operand] = {}
    for e in exprs:
        for o in e.operands:
            if o.name in ops:
                o = Operand(o.name, o.type, tuple(dict.fromkeys(ops[o.name].indexings + o.indexings)), o.table)
            ops[o.name] = o
    return tuple(sorted(ops.values(), key=lambda o: o.name))


def combine(op: str, a: Expr, b: Expr) -> Expr:
    """``a and b`` / ``a or b`` of two mask expressions (BlockMask's ``&`` and ``|``)."""
    word = {"and": "and", "or": "or"}[op]
    return Expr(f"({a.text}) {word} ({b.text})", "mask", Node(op, "bool", (a.root, b.root)), _merge_operands(a, b))


def grid_member(grid: str, grid_shape: tuple, block: tuple, rule: Optional[Expr], grid_type="int") -> Expr:
    """The membership of a BlockMask: its block state ``grid`` (0 skipped, 1 partial, 2 full) read at
    (b, h, q_idx // block_q, kv_idx // block_k), and inside partial blocks ``rule`` (None: kept)."""
    index = (None if grid_shape[0] == 1 else "b", None if grid_shape[1] == 1 else "h",
             ("q_idx", block[0]), ("kv_idx", block[1]))
    cell = Node("array", grid_type, value=(grid, index))
    full = Node("==", "bool", (cell, Node("const", "int", value=2)))
    part = Node("==", "bool", (cell, Node("const", "int", value=1)))
    inner = part if rule is None else Node("and", "bool", (part, rule.root))
    ops = (Operand(grid, grid_type, (index,)),) + (rule.operands if rule is not None else ())
    text = f"{grid}[cell] == 2 or {grid}[cell] == 1" + (f" and ({rule.text})" if rule is not None else "")
    return Expr(text, "mask", Node("or", "bool", (full, inner)), tuple(sorted(
        {o.name: o for o in ops}.values(), key=lambda o: o.name)))


def dense_bits(slot: str, table: str, grid_shape: tuple, block: tuple) -> Expr:
    """The element rule of ``BlockMask.from_dense`` inside partial blocks: bit ``(q_idx % bq) * bk + kv_idx % bk``
    of the packed bits of the block's slot (``slot`` read like a grid, ``table`` ``(partial blocks, bytes)``)."""
    index = (None if grid_shape[0] == 1 else "b", None if grid_shape[1] == 1 else "h",
             ("q_idx", block[0]), ("kv_idx", block[1]))
    node = Node("bits", "bool", value=(Node("array", "int", value=(slot, index)), table) + tuple(block))
    return Expr(f"bits({slot}, {table})", "mask", node,
                (Operand(slot, "int", (index,)), Operand(table, "int", table=True)))


# ------------------------------------------------------------------------------------------------ int32 bounds
INT32 = (-2**31, 2**31 - 1)


def _int_range(n: Node, values, extents, what, text):
    """``(lo, hi)`` of an integer node over the problem (None for floats and bools, whose int children are
    still checked), by interval arithmetic: sound, so a refusal may be cautious but a pass is a guarantee."""
    args = [_int_range(a, values, extents, what, text) for a in n.args]
    if n.type != "int":
        return None
    op = n.op
    if op == "const":
        r = (n.value, n.value)
    elif op == "var":
        top = extents["q_idx" if n.value == "q_len" else "kv_idx" if n.value == "kv_len" else n.value]
        r = (0, top) if n.value in LENGTH_VARS else (0, top - 1)
    elif op == "scalar":
        v = int(scalar_value(values[n.value]))
        r = (v, v)
    elif op == "array":
        a = values[n.value[0]]
        r = (int(a.min()), int(a.max())) if a.size else (0, 0)
    elif op == "bits":
        return None
    elif op in ("+", "-", "*"):
        (a0, a1), (b0, b1) = args
        ends = {"+": (a0 + b0, a1 + b1), "-": (a0 - b1, a1 - b0)}.get(op) or (a0 * b0, a0 * b1, a1 * b0, a1 * b1)
        r = (min(ends), max(ends))
    elif op == "//":  # |a // b| <= |a| for b != 0, and x // 0 is 0
        m = max(abs(args[0][0]), abs(args[0][1]))
        r = (-m, m)
    elif op == "%":  # the divisor's sign, below its magnitude; x % 0 is 0
        r = (min(0, args[1][0] + 1), max(0, args[1][1] - 1))
    elif op == "neg":
        r = (-args[0][1], -args[0][0])
    elif op == "if":
        r = (min(args[1][0], args[2][0]), max(args[1][1], args[2][1]))
    elif n.value == "abs":
        lo, hi = args[0]
        r = (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    else:  # min, max
        pick = min if n.value == "min" else max
        r = (pick(args[0][0], args[1][0]), pick(args[0][1], args[1][1]))
    if r[0] < INT32[0] or r[1] > INT32[1]:
        shown = _cpp(n, lambda name, index: name if index is None else f"{name}[{', '.join(map(_show, index))}]")
        raise ValueError(f"{what}: the integer {shown} may reach {r[0] if r[0] < INT32[0] else r[1]} here, outside "
                         f"int32 (the CUDA kernels' integers) in {text!r} (bounds taken for each operand on its own, "
                         f"over the problem's extents: cautious where operands are tied, as q_idx and q_len); "
                         f"compute it in float (1.0 * x) or keep the operands smaller")
    return r


def _show(index) -> str:
    """An array index as the text reads it (see :class:`Operand`)."""
    return "0" if index is None else f"{index[0]} // {index[1]}" if isinstance(index, tuple) else index


# ------------------------------------------------------------------------------------------------ NumPy
_NP = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide, "//": np.floor_divide, "%": np.mod,
       "==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater,
       ">=": np.greater_equal, "and": np.logical_and, "or": np.logical_or, "not": np.logical_not,
       "neg": np.negative, "if": np.where, "abs": np.abs, "min": np.minimum, "max": np.maximum, "exp": np.exp,
       "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt}


def _evaluate(n: Node, env, values, dtype):
    def num(x, t):  # floats in the working precision; integers in 64 bits (a uint8 array's 3 - 5 is -2); bools
        if t == "float":  # a float64 operand past float32's range is inf there, as the kernels' cast makes it (a
            with np.errstate(over="ignore", under="ignore"):  # problem refuses it; a BlockMask classifies in float32)
                return np.asarray(x).astype(dtype, copy=False)
        return np.asarray(x).astype(np.int64, copy=False) if t == "int" else x

    if n.op == "const":
        if n.type != "float":
            return n.value
        with np.errstate(over="ignore"):  # a literal past float32's range is inf there, as an operand is (above)
            return dtype.type(n.value)
    if n.op == "var":
        return num(env[n.value], n.type)
    if n.op == "scalar":
        return num(np.asarray(values[n.value])[()], n.type)
    if n.op == "array":
        name, index = n.value
        return num(np.asarray(values[name])[tuple(index_value(v, env) for v in index)], n.type)
    if n.op == "bits":  # packed bits of BlockMask.from_dense: table[slot][e / 8] >> e % 8, e the offset in the block
        slot, table, bq, bk = n.value
        e = (env["q_idx"] % bq) * bk + env["kv_idx"] % bk
        s = _evaluate(slot, env, values, dtype)
        return ((np.asarray(values[table])[np.maximum(s, 0), e >> 3] >> (e & 7)) & 1).astype(bool) & (s >= 0)
    args = [_evaluate(a, env, values, dtype) for a in n.args]
    if n.op == "float":
        return num(args[0], "float")
    with np.errstate(all="ignore"):
        return _NP[n.value if n.op == "call" else n.op](*args)


# ------------------------------------------------------------------------------------------------ C++
#: min/max propagate a NaN as NumPy's minimum/maximum do (fminf/fmaxf would drop it): kernels/mods.cuh
_CPP_FLOAT = {"abs": "fabsf", "min": "nan_min", "max": "nan_max", "exp": "expf", "log": "logf", "tanh": "tanhf",
              "sqrt": "sqrtf"}
#: the same in float64, for the float64 kernels (kernels/wide_scores.cuh): float operations in double
_CPP_DOUBLE = {"abs": "fabs", "min": "nan_min", "max": "nan_max", "exp": "exp", "log": "log", "tanh": "tanh",
               "sqrt": "sqrt"}


def _cpp_real(value: float, double: bool) -> str:
    """A float constant in C++, as the value NumPy's evaluation computes with (``dtype.type(value)``): in float
    kernels the float32 nearest the double, written so that the compiler reads exactly it. The double's decimal
    string with an ``f`` was rounded to float a second time (1 + 2^-24, a tie, became 1 + 2^-23 where NumPy has 1:
    a mask of other elements), and one past float32's range was a compile error in NVRTC ("floating constant is out
    of range"; 1e-50, or 1e-25 ** 2 folded in a derivative): now 0 there, as in NumPy. The float32 value's shortest
    double digits name it exactly (a float is a double, and its neighbours are far wider apart)."""
    if not double:
        with np.errstate(over="ignore", under="ignore"):
            value = float(np.float32(value))
    if math.isinf(value):
        if double:
            return "wide::Real<double>::pos_inf()" if value > 0 else "wide::Real<double>::neg_inf()"
        return "pos_inf()" if value > 0 else "neg_inf()"
    if math.isnan(value):
        return "__longlong_as_double(0x7ff8000000000000LL)" if double else "__int_as_float(0x7fc00000)"
    return f"{value!r}" if double else f"{value!r}f"


#: float arithmetic as CUDA's correctly rounded intrinsics, never contracted ((float, double) kernels' names); the
#: emulator has twins of them (kernels/emulate/intrinsics.h)
_CPP_ROUNDED = {"+": ("__fadd_rn", "__dadd_rn"), "-": ("__fsub_rn", "__dsub_rn"), "*": ("__fmul_rn", "__dmul_rn")}


def _cpp(n: Node, read, real: str = "float") -> str:
    op = n.op
    double = real == "double"
    if op == "const":
        if n.type == "bool":
            return "true" if n.value else "false"
        if n.type == "int":
            return str(n.value)
        return _cpp_real(float(n.value), double)
    if op == "var":
        return n.value
    if op == "scalar":
        return read(n.value, None)
    if op == "array":
        return read(*n.value)
    if op == "bits":
        slot, table, bq, bk = n.value
        return (f"dense_bit({_cpp(slot, read, real)}, {read(table, 'table')}, "
                f"(q_idx % {bq}) * {bk} + kv_idx % {bk})")
    a = [_cpp(x, read, real) for x in n.args]
    if op == "float":
        return f"{real}({a[0]})"
    if op == "neg":
        return f"(-{a[0]})"
    if op == "not":
        return f"(!{a[0]})"
    if op in ("and", "or"):
        return f"({a[0]} {'&&' if op == 'and' else '||'} {a[1]})"
    if op == "if":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    if op == "//":  # Python's floor division and modulo, not C's truncation
        return f"floor_div({a[0]}, {a[1]})"
    if op == "%":
        return f"floor_mod({a[0]}, {a[1]})"
    if op == "call":
        fn = (_CPP_DOUBLE if double else _CPP_FLOAT)[n.value] if n.type == "float" else \
            ("::abs" if n.value == "abs" else n.value)
        return f"{fn}({', '.join(a)})"
    if n.type == "float" and op in _CPP_ROUNDED:
        # each step rounded, as NumPy rounds it: NVRTC contracts a plain `a * b - c` into one FMA (--fmad=true is
        # its default), so `q_idx * 0.1 - kv_idx * 0.1 >= 0` kept other elements than to_dense and the NumPy backend
        # (half the diagonal of that causal rule dropped), and the forward and backward kernels could disagree
        return f"{_CPP_ROUNDED[op][double]}({a[0]}, {a[1]})"
    return f"({a[0]} {op} {a[1]})"


# ------------------------------------------------------------------------------------------------ d/dscore
def _const(x: float) -> Node:
    return Node("const", "float", value=float(x))


def _d(n: Node, wrt: str = "score") -> Node:
    """The derivative of a float node with respect to ``wrt`` (``score``, or an array operand read at the
    problem's own index), by the chain rule node by node."""
    if not _uses(n, wrt) or n.type != "float":
        return _const(0)
    op, args = n.op, n.args
    if op in ("var", "array"):
        return _const(1)
    if op == "float":
        return _d(args[0], wrt)
    if op in ("+", "-"):
        return Node(op, "float", (_d(args[0], wrt), _d(args[1], wrt)))
    if op == "neg":
        return Node("neg", "float", (_d(args[0], wrt),))
    if op == "*":
        return Node("+", "float", (Node("*", "float", (_d(args[0], wrt), args[1])),
                                   Node("*", "float", (args[0], _d(args[1], wrt)))))
    if op == "/":  # (da - (a/b) db) / b, not (da b - a db) / b^2: b^2 overflows where a/b does not (softcap 1e30)
        db = _d(args[1], wrt)
        num = _d(args[0], wrt) if _is(db, 0) else Node("-", "float", (_d(args[0], wrt), Node("*", "float", (n, db))))
        return Node("/", "float", (num, args[1]))
    if op == "if":
        return Node("if", "float", (args[0], _d(args[1], wrt), _d(args[2], wrt)))
    if op == "call":
        f, a = n.value, args[0]
        da = _d(a, wrt)
        if f == "exp":
            outer = n
        elif f == "log":
            outer = Node("/", "float", (_const(1), a))
        elif f == "tanh":
            outer = Node("-", "float", (_const(1), Node("*", "float", (n, n))))
        elif f == "sqrt":
            outer = Node("/", "float", (_const(0.5), n))
        elif f == "abs":  # sign(a); 0 at 0, as torch
            outer = Node("if", "float", (Node(">", "bool", (a, _const(0))), _const(1),
                                         Node("if", "float", (Node("<", "bool", (a, _const(0))), _const(-1),
                                                              _const(0)))))
        else:  # min / max: the derivative of the branch taken (the first on ties)
            cmp = "<=" if f == "min" else ">="
            return Node("if", "float", (Node(cmp, "bool", args), _d(args[0], wrt), _d(args[1], wrt)))
        return Node("*", "float", (outer, da))
    raise ValueError(f"score_mod: the operation {op!r} has no derivative with respect to {wrt}")


def _is(n: Node, x: float) -> bool:
    return n.op == "const" and n.type == "float" and n.value == x


def _simplify(n: Node) -> Node:
    """The identities of 0 and 1 that differentiation leaves (``1 * x``, ``x + 0``), and nothing else: arithmetic of
    the user's literals stays for the evaluation in the working precision, as the forward does it (folded here in
    float64, ``((1.0 + 1e-8) - 1.0) * 1e8`` was 1 in the backward and 0 in a float32 forward)."""
    args = tuple(_simplify(a) for a in n.args)
    n = Node(n.op, n.type, args, n.value)
    if n.op == "*":
        if _is(args[0], 0) or _is(args[1], 0):
            return _const(0)
        if _is(args[0], 1):
            return args[1]
        if _is(args[1], 1):
            return args[0]
    if n.op == "+":
        if _is(args[0], 0):
            return args[1]
        if _is(args[1], 0):
            return args[0]
    if n.op == "-" and _is(args[1], 0):
        return args[0]
    if n.op == "neg" and _is(args[0], 0):
        return _const(0)
    return n


# ------------------------------------------------------------------------------------------------ the bundle
#: the built-in modifiers in the order they apply, after the scale and before the user's score_mod:
#: FA2's softcap (``c·tanh(s/c)``), an additive bias, FA2's ALiBi (``-slope·|i + Lk - Lq - j|``).
SOFTCAP = "cuflash_softcap * tanh(score / cuflash_softcap)"
BIAS = "score + cuflash_bias[b, h, q_idx, kv_idx]"
ALIBI = "score - cuflash_alibi[b, h] * abs(q_idx + kv_len - q_len - kv_idx)"


@dataclass(frozen=True)
class Modifiers:
    """Everything one call modifies: the composed score modifier (``score``; None: the scaled score as is),
    the user's mask modifier (``mask``; evaluated on every tile), their operands' values (``values``: name →
    array on the problem's array module, or a number), and for ``bias=`` its operand name, the caller's
    shape (``bias_shape``: dbias is returned in it) and the (B|1, H|1, Sq|1, Sk|1) shape that the backends sum
    dbias to (``bias_compact``: 1 along the axes the caller's bias broadcasts)."""

    score: Optional[Expr]
    mask: Optional[Expr]
    values: dict
    bias_shape: Optional[tuple] = None
    bias_compact: Optional[tuple] = None

    @lazy_property  # one differentiation per call: the NumPy backward asked again at every tile strip
    def dscore(self) -> Optional[Expr]:
        """d(score modifier)/d(score): the backward's factor on dS; None when there is no score modifier."""
        return None if self.score is None else self.score.derivative("score")

    @lazy_property
    def dbias(self) -> Optional[Expr]:
        """d(score modifier)/d(bias element): the factor dbias is dS times (1 unless a score_mod follows)."""
        return None if self.bias_shape is None else self.score.derivative("cuflash_bias")

    @property
    def key(self) -> str:
        """What the compiled code depends on: the expressions and their operands' types and indexings."""
        parts = [e.text + repr(e.operands) for e in (self.score, self.mask) if e is not None]
        return " | ".join(parts)
