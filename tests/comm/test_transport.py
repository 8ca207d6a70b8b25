"""The process-group transport satisfies the Transport protocol the collectives call, name for
name and parameter for parameter."""

import inspect

from cgx2.comm import Transport, process_group


def _parameters(fn) -> list[tuple[str, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.default) for p in params]


def test_the_process_group_transport_is_a_transport():
    assert isinstance(process_group, Transport)
    wanted = [n for n, v in vars(Transport).items() if callable(v) and not n.startswith("_")]
    assert len(wanted) == 7
    for name in wanted:
        assert _parameters(getattr(process_group, name)) == _parameters(getattr(Transport, name))


def test_a_module_lacking_a_call_is_not_a_transport():
    import types

    partial = types.SimpleNamespace(**{n: getattr(process_group, n)
                                       for n in ("all_to_all", "all_gather", "wait")})  # fmt: skip
    assert not isinstance(partial, Transport)
