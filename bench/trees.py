"""The `--tree` option of the benches that compare two checkouts: which checkout's package a run imports.

Nothing here imports the package: `use_tree` must run before anything does.
"""

import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
THIS_CHECKOUT = os.path.dirname(BENCH)


def add_tree_option(parser) -> None:
    parser.add_argument("--tree", default=THIS_CHECKOUT,
                        help="the checkout whose package is measured (default: this one)")


def use_tree(path: str, *inside: str) -> str:
    """Put the package of checkout `path` (and its folders `inside`, then this folder's helpers) first on the
    import path; the checkout's absolute path."""
    tree = os.path.abspath(path)
    sys.path[:0] = [tree, *(os.path.join(tree, folder) for folder in inside), BENCH]
    return tree
