"""The one registry helper (aqn_jax/registry.py) and the tables built on it."""

import pytest


def test_registry_refuses_unknown_and_duplicate_names():
    from aqn_jax.registry import Registry

    reg = Registry("config.x.kind")

    @reg.register("a")
    def a():
        return 1

    reg.register("b", 2)
    assert reg.names() == ("a", "b") and reg.get("a") is a and reg["b"] == 2
    assert "a" in reg and "c" not in reg and len(reg) == 2
    with pytest.raises(ValueError, match=r"^config\.x\.kind='c'; allowed: \('a', 'b'\)$"):
        reg.get("c")
    with pytest.raises(ValueError, match=r"^config\.y=None; allowed"):
        reg.check(None, "config.y")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a", 3)
    reg.unregister("b")
    assert reg.names() == ("a",)
