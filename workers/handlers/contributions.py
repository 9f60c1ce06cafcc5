"""Feature contributions of gradient-boosted trees, read off each record's leaves.

A gradient-boosted model's raw score (a binary classifier's log-odds, a regressor's
prediction) is a constant plus ``learning_rate`` times the value of the leaf each tree
sends the record to. Along a tree's path from its root to that leaf, every split moves
the node value from the parent's to the child's; crediting that move to the split's
feature (the path attribution of Saabas, as ``treeinterpreter`` computes it for
scikit-learn) gives each feature a contribution, and

    base value + sum of the contributions = the raw score

exactly, record by record. For each tree the credit of every node's path is summed once
at load, a (nodes, features) table, so a batch costs one ``apply`` (the leaf of every
record in every tree) and a gather: no walk per record. It is a cheaper attribution than
SHAP's (which averages over feature orders) and can credit a feature for a split that
only matters together with another; docs/models.md says so beside the result shape.

Built for scikit-learn's ``GradientBoostingClassifier`` with two classes and
``GradientBoostingRegressor``; ``tree_contributions`` answers None for any other model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TreeContributions", "tree_contributions"]


class TreeContributions:
    """Each row's feature contributions to a gradient-boosted model's raw score."""

    def __init__(self, estimator: Any) -> None:
        """``estimator``: a fitted GradientBoostingClassifier (two classes) or Regressor."""
        trees = [stage[0].tree_ for stage in estimator.estimators_]
        width = int(estimator.n_features_in_)
        nodes = max(tree.node_count for tree in trees)
        self._estimator = estimator
        self._tables = np.zeros((len(trees), nodes, width))
        for n, tree in enumerate(trees):
            self._tables[n, : tree.node_count] = _path_credit(tree, width)
        self._tables *= float(estimator.learning_rate)
        zero = np.zeros((1, width), dtype=np.float32)
        self.base_value = float(_raw(estimator, zero)[0] - self(zero)[0].sum())
        """The raw score of a record before any split: the same for every record."""

    def __call__(self, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
        """(N, F) contributions for (N, F) rows, in the raw score's units."""
        leaves = self._estimator.apply(rows)  # (N, trees, 1): each row's leaf in each tree
        leaves = leaves.reshape(len(rows), -1).astype(np.intp)
        per_tree = self._tables[np.arange(leaves.shape[1]), leaves]  # (N, trees, F)
        summed: np.ndarray[Any, np.dtype[np.float64]] = per_tree.sum(axis=1)
        return summed


def tree_contributions(model: object) -> TreeContributions | None:
    """Contributions for ``model``, or None where its family has none built here."""
    from sklearn.ensemble import GradientBoostingClassifier, GradientBoostingRegressor

    if isinstance(model, GradientBoostingRegressor):
        return TreeContributions(model)
    if isinstance(model, GradientBoostingClassifier) and len(model.classes_) == 2:
        return TreeContributions(model)
    return None


def _path_credit(tree: Any, width: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """(nodes, F): for each node, the value moves along its path from the root, each
    credited to the feature its parent split on."""
    credit = np.zeros((tree.node_count, width))
    value = tree.value.reshape(tree.node_count, -1)[:, 0]
    stack = [0]
    while stack:
        node = stack.pop()
        for child in (tree.children_left[node], tree.children_right[node]):
            if child < 0:  # a leaf has no children
                continue
            credit[child] = credit[node]
            credit[child, tree.feature[node]] += value[child] - value[node]
            stack.append(child)
    return credit


def _raw(estimator: Any, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if hasattr(estimator, "decision_function"):
        return np.asarray(estimator.decision_function(rows), dtype=np.float64).reshape(-1)
    return np.asarray(estimator.predict(rows), dtype=np.float64).reshape(-1)
