"""The objectives and the settings a run gives them: GKD's λ, the JSD β, the loss temperature τ.

    SETTINGS["lam"].check("gkd", 1.5)   # ValueError: gkd.lam must lie in [0, 1], got 1.5
    OBJECTIVE_SETTINGS["gkd"]           # ("lam", "beta", "temperature")

Each setting is declared once here, with its range and default: the run config's `distill.*`
and `distill.phases[i].*` keys take them (opd/config/training.py), a phase passes the ones its
objective reads under the same names (opd/distill/phases.py), and the objective's dataclass
fields of those names check them (opd/distill/objectives.py).  Pure Python (no torch), so the
config's `objective` choices are read from `OBJECTIVE_SETTINGS` too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One objective setting: its name, default and range (None = unbounded on that side)."""
    name: str
    default: float
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    @property
    def bounds(self) -> dict[str, float]:
        """The range as `pydantic.Field` keywords (ge, gt, le, lt)."""
        return {k: v for k, v in dict(ge=self.ge, gt=self.gt, le=self.le, lt=self.lt).items()
                if v is not None}

    def check(self, objective: str, value: float) -> None:
        """ValueError naming `objective.name` when `value` is outside the range."""
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        if not ok:
            if self.ge is not None and self.le is not None:
                want = f"lie in [{self.ge:g}, {self.le:g}]"
            else:
                want = " and ".join(f"be {op} {v:g}" for op, v in
                                    ((">=", self.ge), (">", self.gt), ("<=", self.le),
                                     ("<", self.lt)) if v is not None)
            raise ValueError(f"{objective}.{self.name} must {want}, got {value}")


LAM = Setting("lam", 1.0, ge=0.0, le=1.0)           # GKD: P(a step's batch is the student's)
BETA = Setting("beta", 0.5, ge=0.0, le=1.0)         # JSD: 0 = forward KL(P||Q), 1 = reverse
TEMPERATURE = Setting("temperature", 1.0, gt=0.0)   # τ of teacher and student logits

SETTINGS = {s.name: s for s in (LAM, BETA, TEMPERATURE)}

OBJECTIVE_SETTINGS: dict[str, tuple[str, ...]] = {
    "gkd": ("lam", "beta", "temperature"),
    "varkd": ("beta", "temperature"),
    "kd": ("temperature",),
    "seqkd": (),
}
"""The objectives by name (opd/distill/objectives.py registers a class under each) and the
settings each reads; the order is the one error messages list them in."""
