"""The scheduler's exception types, in a module of their own: the optional mypyc build (setup.py) compiles
scheduler.request, and mypyc cannot compile subclasses of builtin exceptions, so they live here, uncompiled."""


class IllegalTransition(RuntimeError):
    """A status change the lifecycle does not allow: a scheduler bug, never user input."""
