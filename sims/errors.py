"""The simulator's exception types, in a module of their own: the optional mypyc build (setup.py) compiles
sims.simulator, and mypyc cannot compile subclasses of builtin exceptions, so they live here, uncompiled."""


class InvariantViolation(AssertionError):
    """A Plan asked for something physically impossible (a scheduler bug)."""
