"""Nested structures of arrays ("trees"): the form a batch's inputs and targets take.

A tree is a leaf (an array, a tensor, an :class:`~hvdtrain.data.contracts.ArraySpec`), or a tuple,
list or dict of trees; ``None`` is the empty tree (no targets). Dict keys are visited in sorted
order, as ``tf.nest`` and torch's pytree do, so a tree flattens to the same leaves in both
frameworks. Nothing here imports a framework: a leaf is whatever is not a container.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hvdtrain.errors import HvdtrainError

Tree = Any
"""A leaf, ``None``, or a tuple, list or dict of trees."""


def is_node(tree: Tree) -> bool:
    """Whether ``tree`` is a container (or ``None``) rather than a leaf."""
    return tree is None or isinstance(tree, (tuple, list, dict))


def _items(tree: Tree) -> list[tuple[Any, Tree]]:
    """A node's children with their keys, in the order leaves are visited."""
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [(key, tree[key]) for key in sorted(tree)]
    return list(enumerate(tree))


def _rebuild(like: Tree, children: list[Tree]) -> Tree:
    """A node of ``like``'s kind (tuple, named tuple, list, dict) holding ``children``."""
    if like is None:
        return None
    if isinstance(like, dict):
        return dict(zip(sorted(like), children, strict=True))
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*children)
    return type(like)(children)


def path_name(path: tuple[Any, ...]) -> str:
    """A leaf's place in its tree as a subscript, ``['mask']`` or ``[0]`` (empty for the root)."""
    return "".join(f"[{key!r}]" for key in path)


def _kind(tree: Tree) -> str:
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return "dict"
    return "sequence" if isinstance(tree, (tuple, list)) else "leaf"


def _mismatch(first: Tree, other: Tree) -> str:
    """How ``other``'s node differs from ``first``'s, or an empty string when they match (a tuple
    matches a list of the same length: a user's items may mix them)."""
    kind = _kind(first)
    if kind != _kind(other):
        return f"{describe(first)} against {describe(other)}"
    if kind == "dict" and sorted(first) != sorted(other):
        return f"keys {sorted(first)} against {sorted(other)}"
    if kind == "sequence" and len(first) != len(other):
        return f"{len(first)} items against {len(other)}"
    return ""


def map_tree(fn: Callable[..., Any], *trees: Tree, where: str = "") -> Tree:
    """``fn`` applied to the leaves of ``trees`` taken together (all of one structure), in a tree of
    the first one's structure. Raises :class:`~hvdtrain.errors.HvdtrainError` naming the place
    where the structures differ, prefixed by ``where``."""
    return _map(fn, trees, (), where)


def _map(fn: Callable[..., Any], trees: Sequence[Tree], path: tuple[Any, ...], where: str) -> Tree:
    first = trees[0]
    for other in trees[1:]:
        problem = _mismatch(first, other)
        if problem:
            raise HvdtrainError(f"{where}{path_name(path)}: structures differ: {problem}")
    if not is_node(first):
        return fn(*trees)
    children = [_map(fn, [t[key] for t in trees], (*path, key), where) for key, _ in _items(first)]
    return _rebuild(first, children)


def leaves_with_paths(tree: Tree, path: tuple[Any, ...] = ()
                      ) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The leaves of ``tree`` in order, each with its path of keys."""
    if not is_node(tree):
        yield path, tree
        return
    for key, child in _items(tree):
        yield from leaves_with_paths(child, (*path, key))


def leaves(tree: Tree) -> list[Any]:
    """The leaves of ``tree`` in order (dict keys sorted)."""
    return [leaf for _, leaf in leaves_with_paths(tree)]


def unflatten(like: Tree, new_leaves: Sequence[Any]) -> Tree:
    """A tree of ``like``'s structure whose leaves are ``new_leaves``, in :func:`leaves` order."""
    supply = iter(new_leaves)
    tree = map_tree(lambda _: next(supply), like)
    if next(supply, supply) is not supply:
        raise ValueError("unflatten: more leaves than the structure holds")
    return tree


def describe(tree: Tree) -> str:
    """A one-line description of a tree: its structure, with each array's dtype and shape."""
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{key!r}: {describe(value)}" for key, value in _items(tree)) + "}"
    if isinstance(tree, (tuple, list)):
        inner = ", ".join(describe(value) for value in tree)
        return f"({inner},)" if isinstance(tree, tuple) and len(tree) == 1 else (
            f"({inner})" if isinstance(tree, tuple) else f"[{inner}]")
    if hasattr(tree, "dtype") and hasattr(tree, "shape"):
        return f"{dtype_name(tree.dtype)}{list(tree.shape)}"
    return repr(tree)


def dtype_name(dtype: Any) -> str:
    """A NumPy, torch or TensorFlow dtype (or a dtype name) by its name: ``int64``."""
    return getattr(dtype, "name", None) or str(dtype).replace("torch.", "")


def stack(samples: Sequence[Tree], where: str = "") -> Tree:
    """One batch from per-sample trees of one structure: each leaf's samples stacked along a new
    first axis. Raises :class:`~hvdtrain.errors.HvdtrainError` when the samples' structures or a
    leaf's shapes differ."""
    def stacked(*arrays: np.ndarray) -> np.ndarray:
        try:
            return np.stack(arrays)
        except ValueError as exc:
            shapes = sorted({np.shape(a) for a in arrays})
            raise HvdtrainError(f"{where}: samples of different shapes {shapes} cannot make one "
                                f"batch ({exc})") from None
    return map_tree(stacked, *samples, where=where)


def take(tree: Tree, indices: np.ndarray) -> Tree:
    """The rows ``indices`` of every array of ``tree``."""
    return map_tree(lambda array: array[indices], tree)


def leading_size(tree: Tree) -> int:
    """The batch size of a batch's tree: the first dimension of its first leaf (0 when it has no
    leaf). Works on NumPy arrays and on both frameworks' tensors."""
    first = next(iter(leaves_with_paths(tree)), None)
    return 0 if first is None else int(first[1].shape[0])
