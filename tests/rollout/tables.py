"""Fixture cost tables for the window policy (rollout/window.py): seconds from a function,
never from a timing, so a test's windows are the same on every machine."""
from rollout.window import WINDOWS, CostTable


def cost_table(rows: int, seconds, windows=WINDOWS, fixed=None) -> CostTable:
    """A table of `rows` physical rows from seconds(compact: bool, rows, W) and fixed(W) (None:
    0), at every active count 1..rows."""
    active = list(range(1, rows + 1))
    return CostTable(rows, {W: seconds(False, rows, W) for W in windows},
                     {W: (active, [seconds(True, a, W) for a in active]) for W in windows},
                     None if fixed is None else {W: fixed(W) for W in windows})
