"""Attributes and environment variables set for the length of a run and
set back after: how the planner puts its own versions of torch's and its
libraries' functions in place while a script or a model runs.
"""
import contextlib
import os


@contextlib.contextmanager
def replaced(*patches):
    """Each (owner, name, value): `owner.name` is `value` inside, what it was
    after (as it stood in the owner's own dict where it stood there: a
    class's staticmethod stays one)."""
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            own = vars(owner)
            stack.callback(setattr, owner, name, own[name] if name in own else getattr(owner, name))
            setattr(owner, name, value)
        yield


@contextlib.contextmanager
def environment(**values):
    """os.environ with `values` set inside, as it was after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
