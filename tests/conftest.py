import jax

# Eight host devices for the sequence-parallel tests; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
# Exactness is asserted in float64; float32 cases ask for float32 explicitly.
jax.config.update("jax_enable_x64", True)
