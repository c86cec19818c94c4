"""The one registry type (fsdata.common.registry): decorator, order, help, unknown names, duplicates."""

from __future__ import annotations

import pytest

from fsdata.errors import ConfigError
from fsdata.common.registry import Registry


def test_register_lists_in_order_with_help_and_refuses_duplicates_and_unknown_names():
    reg: Registry[object] = Registry("widget", lambda: "--widget")

    @reg.register("b")
    class B:
        """Bees first.

        More text."""

    @reg.register("a", help="an A")
    class A:
        pass

    assert reg.names() == ("b", "a") and B.name == "b" and reg.get("a") is A and "a" in reg
    assert reg.help("b") == "Bees first." and reg.help("a") == "an A" and reg.help("zz") == ""
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a")(type("A2", (), {}))
    with pytest.raises(ConfigError) as e:
        reg.get("c")
    assert str(e.value) == "unknown --widget 'c'; use one of b, a"
    reg.unregister("a")
    reg.unregister("never")
    assert reg.names() == ("b",)
