"""Model runners: one module per backend, each implementing ``engine.runner_interface.Runner``."""
