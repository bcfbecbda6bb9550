"""A pure-Python reference model of the wire's semantics, for model-based conformance tests."""
