"""A sweep's unit of work: `Cell` (kind, model, method, parameters, a stable id), and `SweepError`.

Light on purpose (json and hashlib only): `sweeps.load` imports it without the engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

NO_METHOD = "-"                 # the hive `method=` value of record and coverage cells
KINDS = ("record", "coverage", "bench", "calibrate")      # the kinds of cell (and of results), one list: the
                                                           # config (`sweeps.config`) and the readers of results
                                                           # (`sweeps.tables.read`) take them from here


class SweepError(ValueError):
    """The sweep config (or its output folder, or the cluster) is unusable; the message names the problem."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:n]


@dataclass(frozen=True)
class Cell:
    """One unit of work and of results: one Parquet file, `kind=<kind>/model=<model>/method=<method>/<id>`."""

    kind: str
    model: str                          # the model's label
    method: str                         # NO_METHOD for record and coverage cells
    params: dict                        # canonical, JSON-able: all the cell function needs
    needs: tuple[str, ...] = ()         # coverage: ids of the record cells whose traces it reads
    id: str = field(default="")

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", digest({"kind": self.kind, "model": self.model, "method": self.method,
                                                   "params": self.params, "needs": list(self.needs)}))

    def describe(self) -> str:
        keys = [k for k in ("prompt_set", "split_value", "policy", "vocab_size", "analysis", "seed")
                if self.params.get(k) is not None]
        extra = " ".join(f"{k}={self.params[k]}" for k in keys)
        return f"{self.kind} {self.model} {self.method} {extra}".rstrip()
