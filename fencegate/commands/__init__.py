"""One module per `fencegate` subcommand: ``add_arguments(parser)`` and ``run(args)``."""
