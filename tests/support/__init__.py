"""What the tests share, one module per job: `hf` tiny models and the torch reference, `programs` jaxprs and HLO,
`xla_flags` every test process's compile flags, `engines` an engine's parameters and the XLA side it is checked
against, `servers` rollout-server subprocesses, `processes` the processes a test starts, `runs` `cisjax train` runs,
`steps` the train step's set-up, `publishing` the weight publisher's.

Nothing is imported here: conftest.py reads `xla_flags` before jax is imported."""
