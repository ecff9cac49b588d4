"""The scheduler's exception types, in a module of their own: the optional mypyc build (setup.py) compiles
scheduler.request, and mypyc cannot compile subclasses of builtin exceptions, so they live here, uncompiled."""


class IllegalTransition(RuntimeError):
    """A status change the lifecycle does not allow: a scheduler bug, never user input."""


class RefusedAction(ValueError):
    """An action an instance cannot carry out in its state (scheduler.instance): a model not resident, a request
    whose KV is elsewhere, weights that do not fit. The executor or engine turns it into its own error."""


class NoKvRoom(RefusedAction):
    """The refusal of KV that does not fit the device (scheduler.instance.KvPlaces with a capacity): an engine
    answers it with its out-of-KV error, which the pool handles as a refusal, not a lost instance."""
