"""A linear program built row by row, solved with HiGHS through `scipy.optimize.linprog`.

Variables are non-negative; rows are sparse lists of (variable, coefficient). scipy is imported only
when a program is solved (the `bench` and `dev` extras install it; the services never solve one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cacheflow_common.errors import CacheFlowError

Row = Sequence[tuple[int, float]]


class InfeasibleError(CacheFlowError):
    """The solver found no solution (a bug in the formulation: every relaxation here is feasible)."""


class LinearProgram:
    def __init__(self) -> None:
        self.n = 0
        self._ub: tuple[list[int], list[int], list[float], list[float]] = ([], [], [], [])  # rows, cols, values, rhs
        self._eq: tuple[list[int], list[int], list[float], list[float]] = ([], [], [], [])

    def var(self) -> int:
        """A new variable >= 0; its index."""
        self.n += 1
        return self.n - 1

    def le(self, row: Row, rhs: float) -> None:
        """sum(coefficient * variable) <= rhs."""
        self._add(self._ub, row, rhs)

    def eq(self, row: Row, rhs: float) -> None:
        """sum(coefficient * variable) == rhs."""
        self._add(self._eq, row, rhs)

    def minimize(self, objective: Mapping[int, float]) -> float:
        """The optimum of `objective` (variable -> coefficient), solved exactly by HiGHS (dual simplex)."""
        result = self._solve(objective)
        if result.status != 0:
            raise InfeasibleError(f"the linear program was not solved: {result.message}")
        return float(result.fun)

    def feasible(self) -> bool:
        """Whether any point satisfies every row."""
        result = self._solve({})
        if result.status not in (0, 2):
            raise InfeasibleError(f"the linear program was not solved: {result.message}")
        return bool(result.status == 0)

    def _solve(self, objective: Mapping[int, float]) -> Any:
        import numpy as np
        from scipy.optimize import linprog
        from scipy.sparse import csr_matrix

        c = np.zeros(self.n)
        for v, coef in objective.items():
            c[v] += coef

        def matrix(part: tuple[list[int], list[int], list[float], list[float]]) -> tuple[object, object]:
            rows, cols, values, rhs = part
            if not rhs:
                return None, None
            return csr_matrix((values, (rows, cols)), shape=(len(rhs), self.n)), np.array(rhs)

        a_ub, b_ub = matrix(self._ub)
        a_eq, b_eq = matrix(self._eq)
        return linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")

    @staticmethod
    def _add(part: tuple[list[int], list[int], list[float], list[float]], row: Row, rhs: float) -> None:
        rows, cols, values, rhs_list = part
        i = len(rhs_list)
        for v, coef in row:
            if coef:
                rows.append(i)
                cols.append(v)
                values.append(coef)
        rhs_list.append(rhs)
