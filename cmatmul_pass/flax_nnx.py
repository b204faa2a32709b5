"""``cmatmul_pass.nnx_jit``: :func:`cmatmul_pass.jit` for Flax NNX code that passes modules
and optimizers to the jitted function and mutates them, as ``flax.nnx.jit`` does.

::

    @cmatmul_pass.nnx_jit(policy="all")
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)   # updates the caller's model and optimizer
        return loss

Each call splits the graph nodes among the arguments (modules, optimizers, ``nnx.Rngs``,
variables: what ``flax.nnx`` treats as a graph node) into their graph definition and their
state with one ``nnx.split`` (so that references shared between them stay shared), and calls
a pure function of that state under :func:`cmatmul_pass.jit`: it merges the state into fresh
nodes, calls the function, which may update their variables, and returns the state they hold
afterwards with the function's outputs.  The caller's nodes then take that state
(``nnx.update``).  The graph definition is a static argument: a call with nodes of another
structure lowers, rewrites and compiles anew, as under ``nnx.jit``.

What ``nnx.jit`` does beyond this is not supported: the function may update variables (weights,
optimizer state, ``Rngs`` counters, batch statistics), not change the graph's structure (add
or remove attributes, submodules or variables: a ``ValueError`` names it), and it returns
arrays and containers of them, not graph nodes.  ``in_shardings`` and ``out_shardings`` are
not taken: the variables' arrays carry their shardings.  ``donate_argnums`` /
``donate_argnames`` donate the nodes' state where every argument holding a node is donated,
and the other arguments where all of those are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from .decorator import JittedFunction, _StaticArgs, jit

#: jax.jit options that name arguments by position or prefix their pytrees: the pure function's
#: arguments are not the caller's
_NOT_TAKEN = ("in_shardings", "out_shardings")


def nnx_jit(fun: Callable | None = None, **options: Any):
    """Like ``flax.nnx.jit(fun, ...)``, running the program rewritten by the collective-matmul
    pass (:func:`cmatmul_pass.jit`, whose options it takes: ``policy``, ``variant``, ``check``,
    ...; and jax.jit's ``static_argnums``, ``static_argnames``, ``donate_argnums``,
    ``donate_argnames``, ``compiler_options``, ``keep_unused``).  Usable as ``@nnx_jit`` and
    ``@nnx_jit(policy="all", ...)``.  See the module docstring for what it supports."""
    if fun is None:
        return functools.partial(nnx_jit, **options)
    return NNXJitted(fun, options)


class NNXJitted:
    """The wrapped function.  ``.report``, ``.stats``, ``.checked``: those of the
    :class:`~cmatmul_pass.decorator.JittedFunction` that runs it (the latest one called, where
    donation makes several); ``.lower(*args)``: its rewritten lowering for these arguments."""

    def __init__(self, fun: Callable, options: dict):
        functools.update_wrapper(self, fun)
        given = [name for name in _NOT_TAKEN if options.get(name) is not None]
        if given:
            raise TypeError(f"cmatmul_pass.nnx_jit does not take {', '.join(given)}: the variables' arrays "
                            "carry their shardings (device_put them, or use cmatmul_pass.jit on a function of "
                            "nnx.split's state)")
        self._fun = fun
        self._static = _StaticArgs(fun, options.pop("static_argnums", None), options.pop("static_argnames", None))
        self._donated = _StaticArgs(fun, options.pop("donate_argnums", None), options.pop("donate_argnames", None))
        self._options = options
        self._jitted: dict[tuple[bool, bool], JittedFunction] = {}
        self._latest: JittedFunction | None = None

    # ------------------------------------------------------------------ what the caller sees
    def __call__(self, *args: Any, **kwargs: Any):
        jitted, call, nodes = self._prepared(args, kwargs)
        out, state = jitted(*call)
        from flax import nnx

        nnx.update(nodes, state)
        return out

    def lower(self, *args: Any, **kwargs: Any):
        jitted, call, _ = self._prepared(args, kwargs)
        return jitted.lower(*call)

    @property
    def report(self):
        return None if self._latest is None else self._latest.report

    @property
    def stats(self):
        return None if self._latest is None else self._latest.stats

    @property
    def checked(self):
        return None if self._latest is None else self._latest.checked

    # ------------------------------------------------------------------ the pure function
    def _prepared(self, args: tuple, kwargs: dict) -> tuple[JittedFunction, tuple, tuple]:
        """The jitted pure function for these arguments, its arguments ``(static, state,
        leaves)``, and the caller's graph nodes (which take the state it returns)."""
        from flax import nnx

        dynamic_args, dynamic_kwargs, statics = self._static.split(args, kwargs)
        leaves, treedef = jax.tree.flatten((dynamic_args, dynamic_kwargs), is_leaf=nnx.graph.is_graph_node)
        where = tuple(nnx.graph.is_graph_node(leaf) for leaf in leaves)
        nodes = tuple(leaf for leaf, node in zip(leaves, where) if node)
        others = [leaf for leaf, node in zip(leaves, where) if not node]
        graphdef, state = nnx.split(nodes)
        jitted = self._jitted_for(self._donation(args, kwargs))
        self._latest = jitted
        return jitted, ((graphdef, treedef, where, statics), state, others), nodes

    def _pure(self, static: tuple, state, others: list):
        from flax import nnx

        graphdef, treedef, where, statics = static
        nodes = nnx.merge(graphdef, state)
        given_nodes, given_others = iter(nodes), iter(others)
        leaves = [next(given_nodes) if node else next(given_others) for node in where]
        dynamic_args, kwargs = jax.tree.unflatten(treedef, leaves)
        args = list(dynamic_args)
        for i, value in statics[0]:
            args.insert(i, value)
        kwargs = {**kwargs, **dict(statics[1])}
        out = self._fun(*args, **kwargs)
        name = getattr(self._fun, "__qualname__", "function")
        if any(nnx.graph.is_graph_node(leaf) for leaf in jax.tree.leaves(out, is_leaf=nnx.graph.is_graph_node)):
            raise TypeError(f"cmatmul_pass.nnx_jit: {name} returns a graph node (a module, an optimizer, a "
                            "variable): return arrays; the nodes among its arguments are updated in place")
        after, new_state = nnx.split(nodes)
        if after != graphdef:
            raise ValueError(f"cmatmul_pass.nnx_jit: {name} changed the structure of the modules it was given "
                             "(added or removed an attribute, a submodule or a variable), which nnx_jit does not "
                             "carry back to the caller's modules: use flax.nnx.jit, or keep the structure")
        return out, new_state

    def _donation(self, args: tuple, kwargs: dict) -> tuple[bool, bool]:
        """(donate the nodes' state, donate the other arguments): each where every argument
        holding such values is donated (never more than was asked)."""
        if not self._donated.argnums and not self._donated.argnames:
            return False, False
        from flax import nnx

        holds_nodes, holds_others = [], []
        given = [(i, a, i in self._donated.argnums) for i, a in enumerate(args)]
        given += [(k, v, k in self._donated.argnames) for k, v in kwargs.items()]
        static = set(self._static.argnums) | set(self._static.argnames)
        for key, value, donated in given:
            if key in static:
                continue
            leaves = jax.tree.leaves(value, is_leaf=nnx.graph.is_graph_node)
            if any(nnx.graph.is_graph_node(leaf) for leaf in leaves):
                holds_nodes.append(donated)
            if any(not nnx.graph.is_graph_node(leaf) for leaf in leaves):
                holds_others.append(donated)
        return bool(holds_nodes) and all(holds_nodes), bool(holds_others) and all(holds_others)

    def _jitted_for(self, donation: tuple[bool, bool]) -> JittedFunction:
        jitted = self._jitted.get(donation)
        if jitted is None:
            donate = tuple(i for i, on in zip((1, 2), donation) if on)

            def pure(static, state, others):
                return self._pure(static, state, others)

            # the user's name (the report's source), not the user's signature (jax.jit reads it)
            pure.__name__ = getattr(self._fun, "__name__", "pure")
            pure.__qualname__ = getattr(self._fun, "__qualname__", pure.__name__)
            jitted = self._jitted[donation] = jit(pure, static_argnums=(0,), donate_argnums=donate or None,
                                                  **self._options)
        return jitted

