"""Serving-engine extras (vLLM): SFT data generation and the serving benchmark.

Optional GPU features: nothing here is imported by the training library, and vLLM itself is imported only when a
command needs it, so CPU users never install it.
"""
