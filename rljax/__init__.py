"""rljax: RL post-training of Mixture-of-Experts language models in JAX.

Deterministic numerics needs process-wide XLA flags, installed by the first
`Numerics("deterministic")` made before JAX starts (see `rljax.numerics`); a process that
runs only fast numerics keeps XLA's defaults.
"""
