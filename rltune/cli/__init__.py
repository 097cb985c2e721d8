"""The ``rltune`` command line: one thin module per command, heavy imports deferred to the body."""
