"""Hand-written Pallas kernels (each with a plain-jnp reference path)."""
