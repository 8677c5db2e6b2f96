"""The copy recipe keeping its recent losses in a deque, a state a weights-only load refuses
(tests/test_recipe_state.py)."""

from collections import deque

from fw_copy_recipe import CopyRecipe


class KeepsDeque(CopyRecipe):
    def state_dict(self) -> dict:
        return {"batches": self.batches, "recent": deque([1.0, 2.0], maxlen=4)}
