"""Pure-JAX model architectures, one file each; see step.py for the step contract."""
