"""The command layer: one module per `cisjax <command>`, each `add_args(parser)` + `run(args, overrides)`."""
