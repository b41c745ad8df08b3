"""What a model's steppers compute once and share: compiled steps, constant keys and values.

A `ModelMemo` belongs to one model and is held by whoever holds the model (the chat, STT and
TTS model objects) and handed to the steppers they make; a stepper given none makes its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from moshi_mlx.errors import MoshiError

Value = TypeVar("Value")

# Compiled steps a model keeps, one per choice of sampling (and KV layout, guidance...), the
# least recently used dropped first: a server's clients each choose their sampling.
MAX_STEP_FUNCTIONS = 4


class ModelMemo(Generic[Value]):
    """Values made from `model` by the choice they were made for, the `size` most recently
    used kept (None: all)."""

    def __init__(self, model: object, size: int | None = MAX_STEP_FUNCTIONS):
        self.model = model
        self.size = size
        self._values: OrderedDict[Hashable, Value] = OrderedDict()  # least recently used first

    def get(self, choice: Hashable, make: Callable[[], Value]) -> Value:
        """The value of `choice`, made by `make()` if it is not kept."""
        value = self._values.pop(choice) if choice in self._values else make()
        self._values[choice] = value
        while self.size is not None and len(self._values) > self.size:
            self._values.popitem(last=False)
        return value

    def choices(self) -> list[Hashable]:
        """The kept choices, the least recently used first."""
        return list(self._values)

    def clear(self) -> None:
        """Forget every value."""
        self._values.clear()

    def check_model(self, model: object) -> None:
        """`MoshiError` unless this memo is `model`'s."""
        if model is not self.model:
            raise MoshiError("these compiled steps belong to another model")


def model_memo(
    model: object, memo: ModelMemo[Value] | None, size: int | None = MAX_STEP_FUNCTIONS
) -> ModelMemo[Value]:
    """`memo`, checked to be `model`'s, or a fresh one of `size` for `model`."""
    if memo is None:
        return ModelMemo(model, size)
    memo.check_model(model)
    return memo
