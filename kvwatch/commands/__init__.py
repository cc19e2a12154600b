"""The command line's commands; each module exposes ``add_parser()`` and ``run()``."""
