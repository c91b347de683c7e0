import jax

# Exactness is asserted in float64; float32 cases ask for float32 explicitly.
jax.config.update("jax_enable_x64", True)
