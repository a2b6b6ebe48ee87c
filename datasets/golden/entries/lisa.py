"""LISA: LMFlow's DynamicLayerActivationCallback as a wrapper around any optimizer."""

OPTIMIZER = "lisa"
UPSTREAM_LABEL = "LMFlow DynamicLayerActivationCallback (no optimizer math)"
EXEMPT = """LMFlow's LISA is a training callback with no optimizer math of its own: the
step is the inner optimizer's (covered by that optimizer's golden data) with the
frozen layers skipped exactly as NULL gradients, tested bit for bit against the
plain inner optimizer in tests/unit/test_lisa.c; the layer sampler deliberately
uses a counter-based generator instead of NumPy's global RNG (docs/lisa.md), so
upstream's draws cannot be matched."""
