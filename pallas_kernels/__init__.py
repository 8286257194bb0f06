"""Pallas kernels, each beside a pure-jnp reference that follows the same block schedule."""
