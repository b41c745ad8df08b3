"""One protocol for every streaming state: KV caches, conv tails, and trees of them.

As in mlx-lm's `models/cache.py`, a state exposes its arrays as `state` (a tree of lists and
dicts of `mx.array`s: what a caller evaluates with a step's outputs, and what is saved), its
other settings as `meta_state` (a tuple of strings), and is rebuilt from both by
`from_state`. `flatten_states` and `unflatten_states` turn any tree of states (and plain
arrays) into safetensors' arrays and string metadata and back, with no per-class code.
`from_state` takes the arrays as they are, without copies: step the original or the
rebuilt state on, not both (a `KVCache` writes into its buffers in place).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Protocol, runtime_checkable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

_CLASS, _META = "state_class.", "state_meta."


@runtime_checkable
class StreamingState(Protocol):
    """A caller-owned streaming state: arrays, string settings, rebuilt from both."""

    @property
    def state(self) -> Any:
        """The arrays, a tree of lists and dicts of `mx.array`s (empty before a first step)."""
        ...

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Everything else the state needs, as strings."""
        ...

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...]) -> StreamingState:
        """The state with these arrays and settings."""
        ...


def is_state(node: object) -> bool:
    """Whether `node` is a `StreamingState` (a leaf of a tree of states), by its class: an
    `isinstance` of the protocol would compute every `state` property it meets."""
    kind = type(node)
    return all(hasattr(kind, name) for name in ("state", "meta_state", "from_state"))


class BaseState:
    """`meta_state` empty by default, and `from_state` through the `state` and `meta_state`
    setters (mlx-lm's `_BaseCache`); subclasses are found by name when a file is read."""

    classes: ClassVar[dict[str, type[BaseState]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        BaseState.classes[cls.__name__] = cls

    @property
    def meta_state(self) -> tuple[str, ...]:
        return ()

    @meta_state.setter
    def meta_state(self, meta_state: tuple[str, ...]) -> None:
        if meta_state:
            raise ValueError(f"{type(self).__name__} has no meta state, got {meta_state}")

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...]) -> BaseState:
        obj = cls.__new__(cls)
        obj.meta_state = meta_state
        obj.state = state
        return obj


def state_arrays(state: StreamingState) -> list[mx.array]:
    """Every array of `state`, in a flat list (to evaluate, or to count bytes)."""
    return [array for _, array in tree_flatten(state.state)]


def _leaf_paths(tree: Any) -> list[tuple[str, Any]]:
    return tree_flatten(tree, is_leaf=is_state)


def _subtree(tree: Any, path: str) -> Any:
    """The part of `tree` at a dotted `path`; [] where a file kept no arrays for it."""
    for key in path.split(".") if path else []:
        if isinstance(tree, dict):
            tree = tree.get(key, [])
        elif isinstance(tree, (list, tuple)) and key.isdigit() and int(key) < len(tree):
            tree = tree[int(key)]
        else:
            return []
    return tree


class StateTree(BaseState):
    """A state made of named parts (its attributes), each a state or a list or dict tree of
    them: its `state` is the parts' states in the same tree, its `meta_state` each leaf's
    path, class and meta state. Subclasses are dataclasses of their parts."""

    def _parts(self) -> dict[str, Any]:
        return vars(self)

    def leaves(self) -> list[StreamingState]:
        """Every state of the tree, depth first."""
        return [leaf for _, leaf in _leaf_paths(self._parts())]

    def reset(self) -> None:
        """Reset every leaf (a new stream)."""
        for leaf in self.leaves():
            leaf.reset()

    @property
    def state(self) -> dict[str, Any]:
        return tree_unflatten([(path, leaf.state) for path, leaf in _leaf_paths(self._parts())])

    @state.setter
    def state(self, state: dict[str, Any]) -> None:
        for path, leaf in _leaf_paths(self._parts()):
            leaf.state = _subtree(state, path)

    @property
    def meta_state(self) -> tuple[str, ...]:
        leaves = _leaf_paths(self._parts())
        return tuple(json.dumps([p, type(s).__name__, *s.meta_state]) for p, s in leaves)

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...]) -> StateTree:
        leaves = []
        for entry in meta_state:
            path, name, *meta = json.loads(entry)
            leaf = BaseState.classes[name].from_state(_subtree(state, path), tuple(meta))
            leaves.append((path, leaf))
        return cls(**tree_unflatten(leaves))


def flatten_states(tree: Any) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and the string metadata of a tree (dicts and lists) whose leaves are states
    or arrays, for `mx.save_safetensors`; `unflatten_states` rebuilds the tree."""
    arrays: dict[str, mx.array] = {}
    metadata: dict[str, str] = {}
    for path, leaf in _leaf_paths(tree):
        if not is_state(leaf):
            arrays[path] = leaf
            continue
        metadata[_CLASS + path] = type(leaf).__name__
        metadata[_META + path] = json.dumps(list(leaf.meta_state))
        arrays.update(tree_flatten(leaf.state, prefix=f".{path}"))
    return arrays, metadata


def unflatten_states(arrays: dict[str, mx.array], metadata: dict[str, str]) -> Any:
    """The tree `flatten_states` flattened (metadata keys it did not write are ignored);
    KeyError or ValueError for a file that does not hold one."""
    leaves, claimed = [], set()
    for key, name in metadata.items():
        if not key.startswith(_CLASS):
            continue
        path = key[len(_CLASS) :]
        own = {k: a for k, a in arrays.items() if k.startswith(f"{path}.")}
        claimed.update(own)
        state = tree_unflatten([(k[len(path) + 1 :], a) for k, a in own.items()]) if own else []
        meta = tuple(json.loads(metadata[_META + path]))
        leaves.append((path, BaseState.classes[name].from_state(state, meta)))
    leaves += [(k, a) for k, a in arrays.items() if k not in claimed]
    return tree_unflatten(leaves)
