"""A crafted pickle payload for the tests that check resume never runs code from a checkpoint."""

from __future__ import annotations


class Call:
    """Pickles as a call of `fn(*args)`: what a crafted checkpoint would make pickle.load run."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args
